//! Parquet output (feature `parquet`, polars): `cases.parquet` (one row per case, metrics as a
//! JSON string column) and one `<section>.parquet` per table section (`ab_table`, `bench_table`,
//! `layer_table`, ...), for notebooks and dashboards. Written next to cases.csv by `render`.

use crate::Report;
use polars::prelude::*;
use std::path::Path;

fn io(e: PolarsError) -> std::io::Error {
    std::io::Error::other(format!("parquet: {e}"))
}

fn write(df: &mut DataFrame, path: &Path) -> std::io::Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let f = std::fs::File::create(&tmp)?;
    ParquetWriter::new(f).finish(df).map_err(io)?;
    std::fs::rename(&tmp, path)
}

/// Writes cases.parquet and one file per table section into `dir`.
pub fn write_all(r: &Report, dir: &Path) -> std::io::Result<()> {
    let ids: Vec<&str> = r.cases.iter().map(|c| c.id.as_str()).collect();
    let devices: Vec<&str> = r.cases.iter().map(|c| c.device.as_str()).collect();
    let verdicts: Vec<String> = r.cases.iter().map(|c| serde_json::to_value(c.verdict).ok().and_then(|v| v.as_str().map(String::from)).unwrap_or_default()).collect();
    let rules: Vec<&str> = r.cases.iter().map(|c| c.tolerance.rule.as_str()).collect();
    let bounds: Vec<f64> = r.cases.iter().map(|c| c.tolerance.bound).collect();
    let margins: Vec<f64> = r.cases.iter().map(|c| c.margin).collect();
    let metrics: Vec<String> = r.cases.iter().map(|c| serde_json::to_string(&c.metrics).unwrap_or_default()).collect();
    let mut df = df!("id" => ids, "device" => devices, "verdict" => verdicts, "rule" => rules, "bound" => bounds, "margin" => margins, "metrics_json" => metrics).map_err(io)?;
    write(&mut df, &dir.join("cases.parquet"))?;
    for (key, v) in &r.sections {
        let (Some(cols), Some(rows)) = (v.get("columns").and_then(|c| c.as_array()), v.get("rows").and_then(|r| r.as_array())) else { continue };
        let columns: Vec<Column> = cols
            .iter()
            .enumerate()
            .map(|(i, name)| {
                let values: Vec<String> = rows.iter().map(|row| row.get(i).and_then(|c| c.as_str()).unwrap_or("").to_string()).collect();
                Column::new(name.as_str().unwrap_or("?").into(), values)
            })
            .collect();
        let mut df = DataFrame::new_infer_height(columns).map_err(io)?;
        write(&mut df, &dir.join(format!("{key}.parquet")))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases_and_tables_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let case = crate::Case {
            id: "x(a=1)".into(),
            device: "cpu".into(),
            verdict: crate::Verdict::Pass,
            metrics: Default::default(),
            tolerance: crate::Tolerance { rule: "r".into(), bound: 1.0 },
            margin: 0.5,
            message: None,
        };
        let mut r = Report::new("t", crate::Provenance::collect(1), vec![case.clone(), case]);
        r.add_table("ab_table", "t", &["pair", "change"], vec![vec!["1".into(), "+1%".into()], vec!["2".into(), "-1%".into()], vec!["3".into(), "0%".into()]]);
        write_all(&r, dir.path()).unwrap();
        let read = |f: &str| ParquetReader::new(std::fs::File::open(dir.path().join(f)).unwrap()).finish().unwrap();
        assert_eq!(read("cases.parquet").height(), 2);
        let t = read("ab_table.parquet");
        assert_eq!((t.height(), t.width()), (3, 2));
    }
}
