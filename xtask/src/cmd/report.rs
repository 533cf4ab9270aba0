//! `cargo xtask report merge DIR... --out DIR` and `cargo xtask report render DIR`.

use crate::Exit;
use reports::Report;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ReportArgs {
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand)]
enum Action {
    /// Merges shard reports (each a directory with report.json) into one.
    Merge {
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        #[arg(long)]
        out: PathBuf,
    },
    /// Re-renders report.md, junit.xml and cases.csv from DIR/report.json.
    Render { dir: PathBuf },
}

pub fn main(a: ReportArgs) -> Result<u8, Exit> {
    match a.action {
        Action::Merge { dirs, out } => {
            let parts = dirs.iter().map(|d| Report::read(d)).collect::<Result<Vec<_>, _>>()?;
            let merged = Report::merge(parts).ok_or_else(|| Exit { code: 2, message: "nothing to merge".into() })?;
            merged.write(&out).map_err(|e| super::io_exit(&out, e))?; // provenance of the shards, unchanged
            super::kernels::print_summary(&merged);
            outln!("merged {} reports into {}", dirs.len(), out.join("report.json").display());
            Ok(merged.exit_code())
        }
        Action::Render { dir } => {
            let r = Report::read(&dir)?;
            r.render(&dir).map_err(|e| super::io_exit(&dir, e))?;
            outln!("rendered {}", dir.display());
            Ok(r.exit_code())
        }
    }
}
