//! report.md: a report rendered for where it is read — a pull request, a CI job summary, an
//! issue. The summary comes first (the suite's lead tables, the verdict and counts, the counts by
//! rung and device, the failures, the first chart); the detail (coverage by op, per-pair or
//! per-layer tables, every case) is folded in `<details>` blocks below. Unsupported cases are
//! counted, never listed one by one. Whatever the report holds, the text stays under
//! [`MARKDOWN_LIMIT`]: a GitHub job summary refuses more than 1 MiB. Detail that does not fit is
//! cut at a row, and the cut says how many rows report.json and cases.csv hold beyond it.

use crate::{settings, Case, Report, Verdict};
use std::fmt::Write as _;

/// The most bytes report.md may have: a GitHub job summary accepts at most 1 MiB.
pub const MARKDOWN_LIMIT: usize = 1 << 20;
/// What the summary part may use; the folded detail gets what is left below the limit, less a
/// reserve for the lines that close it.
const SUMMARY_BUDGET: usize = 256 * 1024;
const CLOSING_RESERVE: usize = 4 * 1024;
/// Failures listed in the summary; the rest are in the folded case table and cases.csv.
const MAX_FAILURES_LISTED: usize = 50;
/// Cases listed in the folded case table (nearest their bounds first).
const MAX_CASES_LISTED: usize = 200;
/// A failure's message in the summary, at most this many characters.
const MAX_MESSAGE_CHARS: usize = 300;

/// Text cut to `n` characters, with an ellipsis when it was cut.
fn clip(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n).collect::<String>() + "…"
    }
}

/// A table cell: pipes escaped, line breaks as spaces.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

/// The verdict of the whole report in one word, as the exit code has it.
pub fn verdict_word(code: u8) -> &'static str {
    match code {
        0 => "PASS",
        1 => "FAIL",
        2 => "COULD NOT RUN",
        _ => "INCONCLUSIVE",
    }
}

/// What a case measured against its bound, as one cell: `error / bound` where the rule is an
/// upper bound, the measured value beside it, else the verdict's message or a dash. A column of
/// one kind of number: never a max-abs measurement beside an RMS bound.
fn measured(c: &Case) -> (String, String) {
    match c.error_over_bound() {
        Some(r) if c.tolerance.rule.contains("<=") => (format!("{r:.3}"), format!("{:.3e} ≤ {:.3e}", c.tolerance.bound - c.margin, c.tolerance.bound)),
        Some(r) => (format!("{r:.3}"), format!("bound {:.3e}", c.tolerance.bound)),
        None => ("—".into(), "—".into()),
    }
}

/// Rows appended while they fit in `budget` bytes; returns how many did not.
fn push_rows(out: &mut String, rows: impl Iterator<Item = String>, budget: usize) -> usize {
    let mut left_out = 0;
    for r in rows {
        if left_out > 0 || out.len() + r.len() > budget {
            left_out += 1;
        } else {
            out.push_str(&r);
        }
    }
    left_out
}

impl Report {
    /// Counts by rung and device: (rung, device) -> [pass, fail, unsupported, error, inconclusive].
    pub fn counts_by_rung(&self) -> std::collections::BTreeMap<(String, String), [usize; 5]> {
        let mut m: std::collections::BTreeMap<(String, String), [usize; 5]> = Default::default();
        for c in &self.cases {
            let cell = m.entry((Self::rung(&c.id), c.device.clone())).or_default();
            cell[match c.verdict {
                Verdict::Pass => 0,
                Verdict::Fail => 1,
                Verdict::Unsupported => 2,
                Verdict::Error => 3,
                Verdict::Inconclusive => 4,
            }] += 1;
        }
        m
    }

    pub(crate) fn markdown(&self, with_cases: bool) -> String {
        let mut out = format!("# Touchstone `{}` report\n\n", self.suite);
        let p = &self.provenance;
        let speed = matches!(self.suite.as_str(), "bench" | "ab" | "ab-calibrate" | "roofline") || self.sections.contains_key("bench_table");
        out += &self.sections_markdown(Placement::Lead, SUMMARY_BUDGET);
        if speed && p.machine.get("build_profile").is_some_and(|b| b != "release") {
            out += "> **Warning: measured with a debug build** (`cargo xtask` builds the dev profile). Publish figures from `cargo xtask-release …` or an installed `touchstone`.\n\n";
        }
        let s = &self.summary;
        let code = self.exit_code();
        let _ = write!(out, "**{}** (exit {code}): **{} executed, {} passed, {} failed, {} unsupported, {} errors", verdict_word(code), s.executed, s.passed, s.failed, s.unsupported, s.errors);
        if s.inconclusive > 0 {
            let _ = write!(out, ", {} inconclusive", s.inconclusive);
        }
        out += "**\n\n";
        let by_rung = self.counts_by_rung();
        if by_rung.len() > 1 {
            out += "| rung | device | passed | failed | unsupported | errors |\n|---|---|---|---|---|---|\n";
            for ((rung, device), [p, f, u, e, i]) in &by_rung {
                let _ = writeln!(out, "| {rung} | {} | {p} | {f} | {u} | {} |", cell(device), e + i);
            }
            out += "\n";
        }
        let failing: Vec<&Case> = self.cases.iter().filter(|c| matches!(c.verdict, Verdict::Fail | Verdict::Error)).collect();
        if !failing.is_empty() {
            out += "## Failures\n\n| case | device | verdict | error / bound | measured | message |\n|---|---|---|---|---|---|\n";
            let rows = failing.iter().take(MAX_FAILURES_LISTED).map(|c| {
                let (ratio, value) = measured(c);
                format!("| `{}` | {} | {:?} | {ratio} | {value} | {} |\n", cell(&clip(&c.id, 200)), cell(&c.device), c.verdict, cell(&clip(c.message.as_deref().unwrap_or(""), MAX_MESSAGE_CHARS)))
            });
            let cut = push_rows(&mut out, rows, SUMMARY_BUDGET);
            let more = failing.len().saturating_sub(MAX_FAILURES_LISTED) + cut;
            if more > 0 {
                let _ = writeln!(out, "\n… and {more} more failing cases (cases.csv, report.json).");
            }
            out += "\n";
        }
        out += &self.sections_markdown(Placement::Body, SUMMARY_BUDGET);
        let charts = self.charts().unwrap_or_default();
        if let Some((stem, c)) = charts.first() {
            let _ = write!(out, "![{}]({stem}.png)\n\n", cell(&c.title));
        }
        // Provenance, compact.
        let _ = write!(out, "touchstone {}", p.touchstone_version);
        if let Some(r) = &p.touchstone_revision {
            let _ = write!(out, " (revision {r})");
        }
        match &p.git_rev {
            Some(r) => {
                let _ = write!(out, "; ran in git {}{}", r.chars().take(12).collect::<String>(), if p.dirty == Some(true) { " with uncommitted changes" } else { "" });
            }
            None => out += "; ran outside a git repository",
        }
        let _ = write!(out, "; host `{}`, CPU {}, {} threads", p.host, p.cpu, p.threads);
        if !p.machine.is_empty() {
            let m = |k: &str| p.machine.get(k).map(String::as_str).unwrap_or("?");
            let _ = write!(out, "; {} cores, {} GiB, {} (kernel {}), governor {}; built by {} ({} profile)", m("cores"), m("memory_gib"), m("os"), m("kernel"), m("governor"), m("rustc"), m("build_profile"));
        }
        if let (Some(t0), Some(t1)) = (&p.started_at, &p.finished_at) {
            let _ = write!(out, "; run from {t0} to {t1}");
        }
        out += "\n\n";
        if let Some(c) = &p.context {
            let _ = write!(out, "models configured for a context of {c} positions (`--context`)\n\n");
        }
        for (name, what) in &p.devices {
            let _ = writeln!(out, "- device `{name}`: {what}");
        }
        if !p.devices.is_empty() {
            out += "\n";
        }
        if speed {
            for n in settings::timing_notes(&p.machine_settings) {
                let _ = writeln!(out, "- timing note: {n}");
            }
            if !p.machine_settings.is_empty() {
                let kv: Vec<String> = p.machine_settings.iter().map(|(k, v)| format!("`{k}={v}`")).collect();
                let _ = write!(out, "\nmachine settings: {}\n\n", kv.join(", "));
            }
        }
        // The summary is bounded above; the detail gets what is left.
        let budget = MARKDOWN_LIMIT - CLOSING_RESERVE;
        if charts.len() > 1 {
            out += "<details><summary>More charts</summary>\n\n";
            for (stem, c) in &charts[1..] {
                if out.len() + 200 < budget {
                    let _ = write!(out, "![{}]({stem}.png)\n\n", cell(&c.title));
                }
            }
            out += "</details>\n\n";
        }
        let detail = self.sections_markdown(Placement::Detail, budget.saturating_sub(out.len()));
        if !detail.is_empty() {
            out += &detail;
        }
        let cov = self.coverage();
        if cov.len() > 1 && with_cases {
            let devices: std::collections::BTreeSet<String> = cov.values().flat_map(|d| d.keys().cloned()).collect();
            let mut t = String::from("<details><summary>Coverage by op and type (pass / fail / unsupported / error)</summary>\n\n| op | type |");
            for d in &devices {
                let _ = write!(t, " {} |", cell(d));
            }
            let _ = write!(t, "\n|---|---|{}\n", "---|".repeat(devices.len()));
            let rows = cov.iter().map(|((op, dt), per)| {
                let mut r = format!("| {} | {} |", cell(op), cell(dt));
                for d in &devices {
                    r += &match per.get(d) {
                        Some([p, f, u, e]) if *u > 0 && p + f + e == 0 => " unsupported |".to_string(),
                        Some([p, f, u, e]) => format!(" {p} / {f} / {u} / {e} |"),
                        None => " - |".to_string(),
                    };
                }
                r + "\n"
            });
            let cut = push_rows(&mut t, rows, budget.saturating_sub(out.len() + 200));
            if cut > 0 {
                let _ = write!(t, "\n… {cut} more rows (cases.csv).\n");
            }
            out += &t;
            out += "\n</details>\n\n";
        }
        if with_cases {
            // The cases nearest their bounds (failures first): where a change would go red next.
            // Every case is in cases.csv and report.json.
            let mut listed: Vec<(&Case, f64)> = self.cases.iter().filter(|c| c.verdict != Verdict::Unsupported).map(|c| (c, c.error_over_bound().filter(|r| r.is_finite()).unwrap_or(f64::NEG_INFINITY))).collect();
            let failed = |c: &Case| matches!(c.verdict, Verdict::Fail | Verdict::Error);
            listed.sort_by(|(a, ra), (b, rb)| failed(b).cmp(&failed(a)).then(rb.total_cmp(ra)));
            if !listed.is_empty() {
                let shown = listed.len().min(MAX_CASES_LISTED);
                let _ = write!(
                    out,
                    "<details><summary>The {shown} cases nearest their bounds, of {} ({} unsupported counted above, not listed; cases.csv has every case)</summary>\n\n| case | device | verdict | error / bound | measured | rule |\n|---|---|---|---|---|---|\n",
                    listed.len(),
                    s.unsupported
                );
                let rows = listed.iter().take(shown).map(|(c, _)| {
                    let (ratio, value) = measured(c);
                    format!("| `{}` | {} | {:?} | {ratio} | {value} | {} |\n", cell(&clip(&c.id, 200)), cell(&c.device), c.verdict, cell(&clip(&c.tolerance.rule, 200)))
                });
                let cut = push_rows(&mut out, rows, budget.saturating_sub(200));
                if cut > 0 {
                    let _ = write!(out, "\n… {cut} more cut to keep this file under 1 MiB.\n");
                }
                out += "\n</details>\n";
            }
        }
        out
    }

    /// The sections placed at `placement`, as Markdown, within `budget` bytes: tables
    /// (`{title, columns, rows}`) as tables (folded when they are detail), other values as one
    /// JSON line each, folded, when short; charts are drawn by the caller.
    fn sections_markdown(&self, placement: Placement, budget: usize) -> String {
        let mut out = String::new();
        let mut raw = String::new();
        for (key, v) in &self.sections {
            if key == "charts" {
                continue;
            }
            let is_table = v.get("columns").and_then(|c| c.as_array()).is_some() && v.get("rows").and_then(|r| r.as_array()).is_some();
            let flag = |k: &str| v.get(k).and_then(|l| l.as_bool()).unwrap_or(false);
            let here = match placement {
                Placement::Lead => is_table && flag("lead"),
                Placement::Body => is_table && !flag("lead") && !flag("detail"),
                Placement::Detail => !is_table || flag("detail"),
            };
            if !here {
                continue;
            }
            if !is_table {
                let text = v.to_string();
                if text.len() <= 400 {
                    let _ = writeln!(raw, "- **{key}**: `{}`", text.replace('`', "'"));
                } else {
                    let _ = writeln!(raw, "- **{key}**: {} bytes of data in report.json", text.len());
                }
                continue;
            }
            let cols = v["columns"].as_array().cloned().unwrap_or_default();
            let title = v.get("title").and_then(|t| t.as_str()).unwrap_or(key);
            let mut t = String::new();
            if placement == Placement::Detail {
                let _ = write!(t, "<details><summary>{}</summary>\n\n", cell(title));
            } else {
                let _ = write!(t, "## {title}\n\n");
            }
            t += "|";
            for c in &cols {
                let _ = write!(t, " {} |", cell(c.as_str().unwrap_or("")));
            }
            let _ = write!(t, "\n|{}\n", "---|".repeat(cols.len()));
            let rows = v["rows"].as_array().cloned().unwrap_or_default();
            let n_rows = rows.len();
            let rows = rows.into_iter().map(|r| {
                let mut line = String::from("|");
                for c in r.as_array().into_iter().flatten() {
                    let _ = write!(line, " {} |", c.as_str().map(cell).unwrap_or_else(|| c.to_string()));
                }
                line + "\n"
            });
            let cut = push_rows(&mut t, rows, budget.saturating_sub(out.len() + 300));
            if cut > 0 {
                let _ = write!(t, "\n… {cut} of {n_rows} rows cut to keep this file under 1 MiB (report.json holds them).\n");
            }
            t += "\n";
            for note in v.get("notes").and_then(|n| n.as_array()).into_iter().flatten().filter_map(|n| n.as_str()) {
                let _ = write!(t, "{note}\n\n");
            }
            if placement == Placement::Detail {
                t += "</details>\n\n";
            }
            if out.len() + t.len() <= budget {
                out += &t;
            } else {
                let _ = write!(out, "(table `{key}` left out to keep this file under 1 MiB: report.json holds it)\n\n");
            }
        }
        if !raw.is_empty() && out.len() + raw.len() + 100 <= budget {
            let _ = write!(out, "<details><summary>Other sections of report.json</summary>\n\n{raw}\n</details>\n\n");
        }
        out
    }
}

/// Where a section goes in report.md.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// First, under the title: the table a reader pastes (`"lead": true`).
    Lead,
    /// In the summary, after the failures.
    Body,
    /// Folded below the summary (`"detail": true`, and sections that are not tables).
    Detail,
}

#[cfg(test)]
mod tests {
    use crate::{Case, Provenance, Report, Tolerance, Verdict, MARKDOWN_LIMIT};

    fn case(i: usize, verdict: Verdict, message: &str) -> Case {
        let metrics = crate::Metrics::new().with("max_abs", 1e-3);
        Case { id: format!("matmul(w=q4_0,k={i},n=7,m=1)"), device: "cpu".into(), verdict, metrics, tolerance: Tolerance { rule: "rms_err <= 1e-3*rms_ref + 1e-6".into(), bound: 2e-3 }, margin: 2e-3 - (i % 100) as f64 * 1e-5, message: Some(message.into()) }
    }

    /// However many cases, failures and table rows a report holds, report.md stays under the
    /// 1 MiB a job summary takes, says so where it cut, lists no unsupported case, and keeps
    /// its summary (verdict, counts, failures) whole.
    #[test]
    fn report_md_stays_under_the_job_summary_limit() {
        let long = "x".repeat(5_000);
        let mut cases: Vec<Case> = (0..60_000).map(|i| case(i, if i % 3 == 0 { Verdict::Unsupported } else { Verdict::Pass }, "")).collect();
        cases.extend((0..5_000).map(|i| case(i, Verdict::Fail, &long)));
        let mut r = Report::new("gate", Provenance::collect(1), cases);
        let rows: Vec<Vec<String>> = (0..50_000).map(|i| vec![i.to_string(), long[..100].to_string()]).collect();
        r.add_detail_table("big_detail", "A big detail table", &["i", "text"], rows.clone());
        r.add_table("big_body", "A big table", &["i", "text"], rows);
        let md = r.to_markdown();
        assert!(md.len() < MARKDOWN_LIMIT, "{} bytes", md.len());
        assert!(md.contains("**FAIL** (exit 1): **65000 executed, 40000 passed, 5000 failed, 20000 unsupported, 0 errors**"), "{}", &md[..500]);
        assert!(md.contains("… and 4950 more failing cases"), "only the first failures are listed");
        assert!(!md.contains("| Unsupported |"), "unsupported cases are counted, not listed");
        assert!(md.contains("cut to keep this file under 1 MiB"));
        assert_eq!(md.matches("<details>").count(), md.matches("</details>").count(), "every fold is closed");
        assert!(r.to_markdown_summary().len() < MARKDOWN_LIMIT);
    }

    /// The measured column is what the rule bounds (for an RMS rule, the RMS error, `bound -
    /// margin`), beside its ratio to the bound; never a max-abs figure beside an RMS bound.
    #[test]
    fn a_case_row_shows_what_its_rule_measures() {
        let mut c = case(7, Verdict::Fail, "over");
        c.margin = -2e-3;
        let md = Report::new("layer-diff", Provenance::collect(1), vec![c]).to_markdown();
        assert!(md.contains("| 2.000 | 4.000e-3 ≤ 2.000e-3 |"), "{md}");
        assert!(!md.contains("1.000e-3"), "the max-abs metric is not shown as the measurement: {md}");
    }
}
