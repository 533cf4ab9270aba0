//! `cargo xtask report merge DIR... --out DIR`, `cargo xtask report render DIR` and
//! `cargo xtask report compare BASE NEW` (what got worse since a baseline run).

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
        /// The shards' report directories (each holding report.json), e.g. from `kernels --shard K/N`.
        #[arg(required = true)]
        dirs: Vec<PathBuf>,
        /// Where the merged report.json, report.md, junit.xml and cases.csv go.
        #[arg(long)]
        out: PathBuf,
    },
    /// Re-renders report.md, junit.xml and cases.csv from DIR/report.json.
    Render {
        /// A report directory (holding report.json); the files are written next to it.
        dir: PathBuf,
    },
    /// Compares a run (NEW, a report directory) with a baseline run (BASE: the last good commit)
    /// case by case: exit 1 when a case that passed no longer does, a baseline case is missing,
    /// or a case's measured error grew more than --factor times to above --floor of its bound.
    Compare {
        /// The baseline run's report directory (holding report.json).
        base: PathBuf,
        /// The run to judge: a report directory of the same suite(s).
        new: PathBuf,
        /// Growth of a case's measured error that counts as a change.
        #[arg(long, default_value_t = 2.0, allow_negative_numbers = true)]
        factor: f64,
        /// Fraction of its bound a grown error must exceed to count as a regression (growth among
        /// errors far below their bounds is listed, not failed).
        #[arg(long, default_value_t = 0.01, allow_negative_numbers = true)]
        floor: f64,
        /// How many changes of each kind to print.
        #[arg(long, default_value_t = 20)]
        show: usize,
    },
}

/// Shards merge only if they are of one suite and one commit (where both say which) and no case (id and device) is in two of them:
/// a shard given twice, or two runs of one shard, would count its cases twice.
fn check_shards(dirs: &[PathBuf], parts: &[Report]) -> Result<(), Exit> {
    let refuse = |message: String| Err(Exit::new(2, message));
    let mut seen: std::collections::HashMap<(&str, &str), usize> = Default::default();
    for (i, r) in parts.iter().enumerate() {
        if r.suite != parts[0].suite {
            return refuse(format!("{} is a `{}` report and {} a `{}` one: only shards of one suite merge", dirs[0].display(), parts[0].suite, dirs[i].display(), r.suite));
        }
        if let (Some(a), Some(b)) = (&parts[0].provenance.git_rev, &r.provenance.git_rev) {
            if a != b {
                return refuse(format!("{} was run at commit {a} and {} at {b}: shards of two versions do not merge into one report (run every shard of one commit)", dirs[0].display(), dirs[i].display()));
            }
        }
        for c in &r.cases {
            if let Some(j) = seen.insert((c.id.as_str(), c.device.as_str()), i) {
                let (a, b) = (dirs[j].display(), dirs[i].display());
                return refuse(if i == j {
                    format!("{a} holds case `{}` on {} twice", c.id, c.device)
                } else {
                    format!("case `{}` on {} is in both {a} and {b} (a shard given twice?): merged, it would count twice", c.id, c.device)
                });
            }
        }
    }
    Ok(())
}

pub fn main(a: ReportArgs) -> Result<u8, Exit> {
    match a.action {
        Action::Merge { dirs, out } => {
            let parts = dirs.iter().map(|d| Report::read(d)).collect::<Result<Vec<_>, _>>()?;
            check_shards(&dirs, &parts)?;
            let merged = Report::merge(parts).ok_or_else(|| Exit::new(2, "nothing to merge"))?;
            merged.write(&out).map_err(|e| super::io_exit(&out, e))?; // provenance of the shards, unchanged
            super::kernels::print_summary(&merged);
            outln!("merged {} reports into {}", dirs.len(), out.join("report.json").display());
            Ok(merged.exit_code())
        }
        Action::Compare { base, new, factor, floor, show } => compare(&base, &new, factor, floor, show),
        Action::Render { dir } => {
            let r = Report::read(&dir)?;
            r.render(&dir).map_err(|e| super::io_exit(&dir, e))?;
            outln!("rendered {}", dir.display());
            Ok(r.exit_code())
        }
    }
}

fn compare(base: &std::path::Path, new: &std::path::Path, factor: f64, floor: f64, show: usize) -> Result<u8, Exit> {
    use reports::compare::Change;
    if !(factor.is_finite() && factor > 1.0 && floor.is_finite() && (0.0..=1.0).contains(&floor)) {
        return Err(Exit::new(2, format!("--factor {factor} must be a finite number above 1 and --floor {floor} between 0 and 1")));
    }
    let (b, n) = (Report::read(base)?, Report::read(new)?);
    if b.suite != n.suite {
        return Err(Exit::new(2, format!("{} is a {} report, {} a {} one: compare runs of the same suites", base.display(), b.suite, new.display(), n.suite)));
    }
    let c = reports::compare::compare(&b, &n, factor, floor);
    if c.matched == 0 {
        return Err(Exit::new(2, format!("the two reports share no case (id and device): nothing was compared ({} and {} cases)", b.cases.len(), n.cases.len())));
    }
    let kinds: [(&str, fn(&Change) -> bool); 7] = [
        ("no longer passes", |c| matches!(c, Change::NoLongerPasses { .. })),
        ("missing from the new run", |c| matches!(c, Change::Missing)),
        ("error grew", |c| matches!(c, Change::Grew { .. })),
        ("error grew, still under the floor", |c| matches!(c, Change::GrewWithinFloor { .. })),
        ("now passes", |c| matches!(c, Change::NowPasses { .. })),
        ("error shrank", |c| matches!(c, Change::Shrank { .. })),
        ("new", |c| matches!(c, Change::New)),
    ];
    for (title, is) in kinds {
        let mut of: Vec<&(String, String, Change)> = c.changes.iter().filter(|x| is(&x.2)).collect();
        if of.is_empty() {
            continue;
        }
        let ratio = |x: &Change| match x {
            Change::Grew { ratio, .. } | Change::GrewWithinFloor { ratio, .. } | Change::Shrank { ratio, .. } => *ratio,
            _ => 0.0,
        };
        of.sort_by(|x, y| ratio(&y.2).total_cmp(&ratio(&x.2)).then(x.0.cmp(&y.0)));
        outln!("{title} ({}):", of.len());
        for (id, device, ch) in of.iter().take(show) {
            let what = match ch {
                Change::NoLongerPasses { was, now } => format!("{was:?} -> {now:?}"),
                Change::NowPasses { was } => format!("{was:?} -> Pass"),
                Change::Grew { base, now, bound, ratio } | Change::GrewWithinFloor { base, now, bound, ratio } => format!("{base:.3e} -> {now:.3e} ({ratio:.1}x; bound {bound:.3e})"),
                Change::Shrank { base, now, ratio } => format!("{base:.3e} -> {now:.3e} ({ratio:.1}x smaller)"),
                Change::Missing | Change::New => String::new(),
            };
            outln!("  {device:<10} {id} {what}");
        }
        if of.len() > show {
            outln!("  ... and {} more", of.len() - show);
        }
    }
    let regressions = c.regressions().count();
    outln!("{} cases compared ({} in the baseline, {} now): {regressions} regressions", c.matched, b.cases.len(), n.cases.len());
    Ok(if regressions > 0 { 1 } else { 0 })
}
