//! `cargo xtask fixed-token`: teacher-forced logit statistics, greedy-vs-golden and cache
//! consistency on a device (suites::fixedtoken), or `--write-golden` to regenerate a golden file.

use devices::DeviceSpec;
use super::layerdiff::default_prompt;
use super::{resolve_model, Engine};
use crate::Exit;
use oracle::generate::AnyModel;
use oracle::ops::SamplerConfig;
use oracle::{NoTap, Precision};
use reports::plot::{Chart, Series};
use reports::{Provenance, Report};
use reports::findings::{PositionFigures, TokenFindings};
use std::path::PathBuf;
use suites::fixedtoken::{self, DeviceRuns, Golden, RoutingTap};
use suites::layerdiff::{self, propagated_budget, Dims, RoutingFollower};

#[derive(clap::Args)]
pub struct FixedTokenArgs {
    #[arg(long, default_value = "cpu", value_parser = super::device_arg, help = concat!("Device under test: ", devices::device_names!(), "."))]
    pub device: DeviceSpec,
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory."))]
    pub model: String,
    /// Golden file (default: fixtures/golden/MODEL.json for fixture models; for other models
    /// the oracle's greedy continuation is computed in this run and the report says so).
    #[arg(long)]
    pub golden: Option<PathBuf>,
    /// Regenerate the golden file with the oracle (greedy) and exit; no device is run.
    #[arg(long)]
    pub write_golden: bool,
    /// Tokens of the golden continuation when one is generated (a prompt given, a model with no
    /// golden file, or --write-golden) [default: 24]; a golden file holds its own.
    #[arg(long)]
    pub n_generate: Option<usize>,
    /// Prompt text (encoded with the model's tokenizer): the golden is the oracle's greedy
    /// continuation of it, generated in this run (or written with --write-golden --golden FILE).
    #[arg(long, conflicts_with_all = ["prompt_ids", "prompt_file"])]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, as --prompt.
    #[arg(long, conflicts_with = "prompt_file")]
    pub prompt_ids: Option<String>,
    /// A file whose text is the prompt, as --prompt: for long-context checks (a document of
    /// thousands of tokens teacher-forced through the KV cache).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// The report.json of an earlier fixed-token run on the same model and golden (the last good
    /// commit, another engine): adds the gate `kld_vs_baseline`, mean KLD at most
    /// --baseline-factor times the baseline's, sharper than the worst-case bound of `kld_mean`.
    #[arg(long)]
    pub baseline: Option<PathBuf>,
    /// How much the mean KLD may grow over the baseline's (KLD grows as the square of the logit
    /// error: 1.5 allows about 22% more error).
    #[arg(long, default_value_t = 1.5, allow_negative_numbers = true, requires = "baseline")]
    pub baseline_factor: f64,
    /// How many times the mean KLD of the oracle run with the device's declared arithmetic
    /// emulated the device may reach (gate `kld_vs_emulation`). Honest engines, llama.cpp among
    /// them, measure 0.9-1.3x (docs/ACCURACY.md); where the emulation is all but exact (INT4
    /// weights) 1.5 catches an engine that rounds them worse than it declares.
    #[arg(long, default_value_t = fixedtoken::EMULATION_FACTOR, allow_negative_numbers = true)]
    pub emulation_factor: f64,
    /// Where report.json, report.md, junit.xml, cases.csv and the plot go (default target/touchstone/fixed-token-YYYYMMDD-HHMMSS/, the start time in UTC).
    #[arg(long)]
    pub report_dir: Option<PathBuf>,
    /// A label for the device in the console, report.json, report.md and JUnit (an engine's
    /// command line is long); report.json's `engine_labels` keeps the command it stands for.
    /// Without it an external engine goes by the name it gives itself (a dump manifest's
    /// `device`, the op protocol's `name`), with " (external)" where that reads as another device.
    #[arg(long)]
    pub name: Option<String>,
}

fn oracle_golden(oracle: &AnyModel, model: &str, sha256: String, prompt: Vec<u32>, n: usize) -> Result<Golden, Exit> {
    let stages = super::Stages::new(1, "fixed-token");
    stages.next(&format!("the oracle's greedy continuation of {} prompt tokens (the golden)", prompt.len()));
    let g = oracle.generate(&prompt, n, &SamplerConfig::GREEDY, 0, &[], &mut NoTap)?;
    Ok(Golden { model: model.to_string(), sha256, prompt_ids: prompt, continuation_ids: g.tokens, regenerate: format!("cargo xtask fixed-token --model {model} --write-golden --n-generate {n}") })
}

pub fn main(a: FixedTokenArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    super::check_label(a.name.as_deref())?;
    let t0 = std::time::Instant::now();
    let Some(mut report) = fixed_token(&a)? else { return Ok(0) };
    super::spread_time(&mut report.cases, t0.elapsed().as_secs_f64());
    super::label_devices(&mut report, &[a.device.name().to_string()], a.name.as_deref());
    print_summary(&report);
    let dir = super::write_report(&mut report, a.report_dir)?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}

/// Runs the gate the arguments describe (None after `--write-golden`).
pub fn fixed_token(a: &FixedTokenArgs) -> Result<Option<Report>, Exit> {
    super::check_factor("--baseline-factor", a.baseline_factor)?;
    super::check_factor("--emulation-factor", a.emulation_factor)?;
    let baseline: Option<Report> = match &a.baseline {
        Some(f) => {
            let text = std::fs::read_to_string(f).map_err(|e| super::io_exit(f, e))?;
            let not_a_report = |e: serde_json::Error| Exit::new(2, format!("--baseline {}: not a report.json: {e}", f.display()));
            let report: serde_json::Value = serde_json::from_str(&text).map_err(not_a_report)?;
            reports::check_schema_version(report["schema_version"].as_u64().unwrap_or(0)).map_err(|why| Exit::new(2, format!("--baseline {}: {why}", f.display())))?;
            Some(serde_json::from_value(report).map_err(not_a_report)?)
        }
        None => None,
    };
    let n_generate = a.n_generate.unwrap_or(24);
    if n_generate == 0 {
        return Err(Exit::new(2, "--n-generate must be at least 1: a golden with no continuation leaves the greedy gate nothing to compare"));
    }
    let opened = if a.write_golden { None } else { Some(super::open_device(&a.device)?) };
    let path = resolve_model(&a.model)?;
    let sha256 = ::fixtures::sha256_model(&path)?;
    let (oracle, tok) = super::load_oracle(&path, Precision::F32)?;
    let file_text = match &a.prompt_file {
        Some(f) => Some(std::fs::read_to_string(f).map_err(|e| super::io_exit(f, e))?),
        None => None,
    };
    let given = super::given_prompt(a.prompt.as_deref().or(file_text.as_deref()), a.prompt_ids.as_deref(), tok.as_ref(), &a.model, &path)?;
    if given.is_some() && a.golden.is_some() && !a.write_golden {
        return Err(Exit::new(2, "--golden FILE holds its own prompt; give a prompt (--prompt, --prompt-ids, --prompt-file) or a golden file, not both (or add --write-golden to write the prompt's golden to FILE)"));
    }
    // A given prompt has no golden file unless one is being written.
    let golden_file = if given.is_some() { a.golden.clone().filter(|_| a.write_golden) } else { a.golden.clone().or_else(|| ::fixtures::golden_path(&a.model)) };
    let prompt = match given {
        Some(ids) => ids,
        None => default_prompt(tok.as_ref(), oracle.spec().n_vocab)?,
    };
    super::check_ids(&prompt, oracle.spec().n_vocab)?;
    if golden_file.as_ref().is_none_or(|f| !f.exists()) || a.write_golden {
        // Generating the golden reads the prompt's logits; a run of it more (checked below).
        super::check_recordings_fit("fixed-token", oracle.spec(), false, prompt.len().saturating_add(n_generate), 10)?;
    }
    if a.write_golden {
        let file = golden_file.ok_or_else(|| Exit::new(2, format!("give --golden FILE to say where to write (model `{}` has no golden file of its own, or a prompt was given: a fixture's golden keeps its prompt)", a.model)))?;
        let g = oracle_golden(&oracle, &a.model, sha256, prompt, n_generate)?;
        if let Some(dir) = file.parent() {
            std::fs::create_dir_all(dir).map_err(|e| super::io_exit(dir, e))?;
        }
        let text = serde_json::to_string_pretty(&g).expect("golden serializes") + "\n";
        reports::write_atomic(&file, text.as_bytes()).map_err(|e| super::io_exit(&file, e))?;
        outln!("wrote {} ({} prompt + {} golden tokens)", file.display(), g.prompt_ids.len(), g.continuation_ids.len());
        return Ok(None);
    }
    let (golden, origin) = match golden_file.filter(|f| f.exists() || a.golden.is_some()) {
        Some(f) => {
            let text = std::fs::read_to_string(&f).map_err(|e| super::io_exit(&f, e))?;
            let g: Golden = serde_json::from_str(&text).map_err(|e| Exit::new(2, format!("{}: {e}", f.display())))?;
            if g.sha256 != sha256 {
                return Err(Exit::new(2, format!("{}: made for a model with sha256 {}, but {} has sha256 {sha256}; regenerate with `{}`", f.display(), g.sha256, path.display(), g.regenerate)));
            }
            if let Some(n) = a.n_generate {
                return Err(Exit::new(2, format!("--n-generate {n}: the golden file {} holds its own continuation ({} tokens); --n-generate sets the length of one generated in this run (give a prompt, or --write-golden)", f.display(), g.continuation_ids.len())));
            }
            if g.prompt_ids.is_empty() {
                return Err(Exit::new(2, format!("{}: the golden's prompt_ids are empty; regenerate with `{}`", f.display(), g.regenerate)));
            }
            super::check_ids(&g.sequence(), oracle.spec().n_vocab).map_err(|e| Exit::new(2, format!("{}: {}", f.display(), e.message)))?;
            (g, f.display().to_string())
        }
        None => (oracle_golden(&oracle, &a.model, sha256, prompt, n_generate)?, "generated by the oracle in this run (no golden file for this model and prompt)".to_string()),
    };
    if golden.continuation_ids.is_empty() {
        return Err(Exit::new(2, format!("{origin}: the golden has no continuation tokens, so the greedy gate would compare nothing; regenerate with `{}`", golden.regenerate)));
    }
    let base_kld = match (&baseline, &a.baseline) {
        (Some(base), Some(f)) => Some(fixedtoken::baseline(&golden, base).map_err(|e| Exit::new(2, format!("--baseline {}: {e}", f.display())))?),
        _ => None,
    };
    let seq = golden.sequence();
    let n_vocab = oracle.spec().n_vocab;
    // The oracle's logits, the device's (prefill, decode and append runs), the followed and the
    // emulated re-runs: every position's logits, in f32 (f64 while computed).
    super::check_recordings_fit("fixed-token", oracle.spec(), false, seq.len(), 10)?;
    eprintln!("fixed-token: {} on {} over {} positions ({} golden tokens) ...", a.device, a.model, seq.len(), golden.continuation_ids.len());
    let stages = super::Stages::new(3, &format!("fixed-token {} on {}", a.device, a.model));
    stages.next(&format!("the oracle over {} positions", seq.len()));
    let mut oracle_tap = fixedtoken::OracleTap::default();
    let oracle_logits = oracle.prefill_logits(&seq, &mut oracle_tap)?;
    let oracle_routing = oracle_tap.routing;
    let dims = Dims::of(oracle.spec(), seq.len());
    drop(oracle);

    let opened = match opened {
        Some(o) => o,
        None => super::open_device(&a.device)?,
    };
    let (_, mut engine, _) = super::load_engine_on(&a.model, opened, Precision::F32)?;
    stages.next(&format!("{}: teacher-forced, greedy, decode and append runs", a.device));
    let (device_logits, mut runs, device_routing) = device_runs(&mut engine, &golden)?;
    runs.routing_differs = fixedtoken::routing_differs(&oracle_routing, &device_routing, seq.len());
    // Asked after the run: an external engine's arithmetic comes from its dump's manifest.
    let arith = engine.arithmetic();
    arith.check().map_err(|e| Exit::new(2, format!("{}: declared arithmetic: {e}", a.device)))?;
    let declared_name = engine.declared_name();
    drop(engine);
    let (budget, head_terms, terms_grant) = logit_budget(&path, &oracle_tap.head, &arith, &dims)?;
    // A MoE device that routed some token otherwise: the oracle again (loaded anew, so the two
    // models were never held at once), routing as the device did where the choices differ only
    // at a near tie.
    let mut follows = Vec::new();
    if runs.routing_differs.contains(&true) {
        stages.next(&format!("the oracle routed as {} at near ties", a.device));
        let (oracle, _) = super::load_oracle(&path, Precision::F32)?;
        let (logits, followed) = followed_oracle(&oracle, &seq, &device_routing, &arith, &dims)?;
        runs.followed_oracle = Some(logits);
        follows = followed;
        for f in &follows {
            stages.note(&format!("routing: {f}"));
        }
    }
    let (mut cases, mut stats) = match device_logits {
        Some(logits) => fixedtoken::evaluate(&golden, &oracle_logits, &logits, n_vocab, &budget, &runs, a.device.name()),
        None => fixedtoken::evaluate_tokens_only(&golden, &oracle_logits, n_vocab, &budget, runs.greedy.as_deref().unwrap_or(&[]), a.device.name()),
    };
    if let Some(base) = &base_kld {
        cases.push(fixedtoken::against_baseline(&golden, &stats, base, a.baseline_factor, a.device.name()));
    }
    // The oracle once more (loaded anew), with the device's declared arithmetic emulated: what an
    // honest engine of that arithmetic gets on this sequence.
    let emulated = match suites::emulate::EmulatedArithmetic::new(&arith, &path) {
        Ok(emu) if stats.stats().is_some_and(|s| s.kld.mean.is_finite()) => {
            stages.next("the oracle with the declared arithmetic emulated");
            let oracle = match emu.load_model()? {
                Some(m) => m,
                None => super::load_oracle(&path, Precision::F32)?.0,
            };
            // Routed as the device did at near ties, and compared with the oracle that was.
            let mut run = suites::layerdiff::Following { emu, routing: RoutingFollower::propagated(&device_routing.0, &arith, &dims, "emulated") };
            let logits: Vec<f32> = oracle.prefill_logits(&seq, &mut run)?.iter().map(|v| *v as f32).collect();
            drop(oracle);
            let reference = runs.followed_oracle.as_deref().unwrap_or(&oracle_logits);
            let emu_stats = fixedtoken::token_stats(&fixedtoken::position_stats(reference, &logits, n_vocab, &budget));
            cases.push(fixedtoken::against_emulation(&golden, &stats, &emu_stats, a.emulation_factor, a.device.name()));
            EmulatedKld::Applied { kld: emu_stats.kld, same_top1: emu_stats.same_top1, factor: a.emulation_factor }
        }
        Ok(_) => EmulatedKld::NotApplicable { not_applicable: "token-only engine: no KLD".into() },
        Err(why) => EmulatedKld::NotApplicable { not_applicable: why },
    };
    let mut report = Report::new("fixed-token", Provenance::collect(rayon::current_num_threads()), cases);
    report.set_section("golden", &fixedtoken::GoldenUsed { source: origin, model: golden.model.clone(), sha256: golden.sha256.clone(), prompt_ids: golden.prompt_ids.clone(), continuation_ids: golden.continuation_ids.clone() });
    let rule = "layer-diff propagated budget of result_output (abs: with terms_grant for the head's cancelling terms)";
    report.set_section("logit_budget", &LogitBudget { rel: budget.rel, abs: budget.abs, rule, arithmetic: &arith, head_terms, terms_grant });
    if let TokenFindings::Logits(ts) = &mut stats {
        report.add_chart("kld_by_position", kld_chart(&ts.per_position, a.device.name(), &a.model));
        ts.routing_followed = follows.len();
    }
    report.set_section("routing_followed", &follows);
    report.set_section("token_stats", &stats);
    report.set_section("emulated_arithmetic", &emulated);
    if let Some(name) = declared_name {
        report.set_section(super::DECLARED_NAMES, &std::collections::BTreeMap::from([(a.device.name(), name)]));
    }
    Ok(Some(report))
}

/// The budget of a device's logits (the propagated budget of `result_output` for its declared
/// arithmetic), with the grant for the output head's cancelling terms already in `abs`: where
/// the head's terms cancel, the logits' rounding errors are larger than their size suggests
/// (as layer-diff grants). Returns the budget, the head's term scale and the grant. Used by
/// fixed-token and the serving rung.
pub(super) fn logit_budget(path: &std::path::Path, head: &layerdiff::ProductRows, arith: &devices::Arithmetic, dims: &Dims) -> Result<(suites::layerdiff::Budget, Option<layerdiff::TermScale>, f64), Exit> {
    let mut budget = propagated_budget(oracle::taps::TapKind::ResultOutput, None, arith, dims).ok_or_else(|| Exit::new(2, "no logit budget rule"))?;
    let head_terms = oracle::loader::open_weights(path).and_then(|(weights, _)| layerdiff::term_scales(head, weights.as_ref()))?.remove(&oracle::taps::TapName::model(oracle::taps::TapKind::ResultOutput).to_string());
    let terms_grant = head_terms.as_ref().and_then(|s| layerdiff::cancellation_grant(oracle::taps::TapKind::ResultOutput, s, arith, dims)).unwrap_or(0.0);
    budget.abs += terms_grant;
    Ok((budget, head_terms, terms_grant))
}

/// A MoE oracle's teacher-forced logits of `ids`, routed as the device did where the two chose
/// differently only at a near tie; with the choices it followed.
pub(super) fn followed_oracle(oracle: &AnyModel, ids: &[u32], device_routing: &RoutingTap, arith: &devices::Arithmetic, dims: &Dims) -> Result<(Vec<f64>, Vec<layerdiff::RoutingFollow>), Exit> {
    let mut tap = fixedtoken::FollowRouting { routing: RoutingFollower::propagated(&device_routing.0, arith, dims, "teacher-forced"), recorded: RoutingTap::default() };
    let logits = oracle.prefill_logits(ids, &mut tap)?;
    Ok((logits, tap.routing.follows))
}

/// The device's teacher-forced logits (None for a token-only engine), its other runs, and the MoE
/// expert choices of its teacher-forced run (compared with the oracle's by the caller).
fn device_runs(engine: &mut Engine, golden: &Golden) -> Result<(Option<Vec<f32>>, DeviceRuns, RoutingTap), Exit> {
    let mut routing = RoutingTap::default();
    let seq = golden.sequence();
    let (p0, n) = (golden.prompt_ids.len(), golden.continuation_ids.len());
    let dev_err = |e: devices::DeviceError| Exit::from(e);
    match engine {
        Engine::Oracle(m) => {
            let logits: Vec<f32> = m.prefill_logits(&seq, &mut routing)?.iter().map(|v| *v as f32).collect();
            let greedy = m.generate(&golden.prompt_ids, n, &SamplerConfig::GREEDY, 0, &[], &mut NoTap)?.tokens;
            // The oracle's own prefill/decode/append identity is the self-check suite's job.
            Ok((Some(logits), DeviceRuns { greedy: Some(greedy), cache_paths: None, routing_differs: Vec::new(), followed_oracle: None }, routing))
        }
        Engine::Device(m) => {
            m.reset();
            if m.one_shot() {
                // An external engine: teacher-forced logits when its dump has them; otherwise a
                // token-only engine answers with the ids it generated.
                let forced = m.forward(&seq, &mut routing);
                m.reset();
                return match forced {
                    Ok(logits) => Ok((Some(logits), DeviceRuns { greedy: None, cache_paths: None, routing_differs: Vec::new(), followed_oracle: None }, routing)),
                    Err(e) => match m.generate_ids(&golden.prompt_ids, n) {
                        Some(ids) => Ok((None, DeviceRuns { greedy: Some(ids.map_err(dev_err)?), cache_paths: None, routing_differs: Vec::new(), followed_oracle: None }, routing)),
                        None => Err(dev_err(e)),
                    },
                };
            }
            let logits = m.forward(&seq, &mut routing).map_err(dev_err)?;
            let greedy = super::generate_on_device(m.as_mut(), &golden.prompt_ids, n, &SamplerConfig::GREEDY, 0, &[])?.tokens;
            let v = m.spec().n_vocab;
            // Prefill of the prompt, then one decode step per golden token.
            m.reset();
            m.forward_last(&seq[..p0], &mut NoTap).map_err(dev_err)?;
            let mut decode = Vec::with_capacity(n * v);
            for t in &seq[p0..] {
                decode.extend(m.forward(std::slice::from_ref(t), &mut NoTap).map_err(dev_err)?);
            }
            // Prefill of the prompt, then the golden tokens appended in one batch.
            m.reset();
            m.forward_last(&seq[..p0], &mut NoTap).map_err(dev_err)?;
            let append = m.forward(&seq[p0..], &mut NoTap).map_err(dev_err)?;
            m.reset();
            Ok((Some(logits), DeviceRuns { greedy: Some(greedy), cache_paths: Some(vec![("decode".into(), p0, decode), ("append".into(), p0, append)]), routing_differs: Vec::new(), followed_oracle: None }, routing))
        }
    }
}

/// fixed-token's `emulated_arithmetic` section: the KLD of the oracle run with the declared
/// arithmetic emulated, or why there is none.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum EmulatedKld {
    Applied { kld: reports::findings::KldSummary, same_top1: reports::findings::SameTop1, factor: f64 },
    NotApplicable { not_applicable: String },
}

/// fixed-token's `logit_budget` section.
#[derive(serde::Serialize)]
struct LogitBudget<'a> {
    rel: f64,
    abs: f64,
    rule: &'a str,
    arithmetic: &'a devices::Arithmetic,
    head_terms: Option<suites::layerdiff::TermScale>,
    terms_grant: f64,
}

fn kld_chart(per_pos: &[PositionFigures], device: &str, model: &str) -> Chart {
    let pts = |of: fn(&PositionFigures) -> f64| -> Vec<(f64, f64)> { per_pos.iter().filter(|p| of(p).is_finite()).map(|p| (p.pos as f64, of(p).max(1e-12))).collect() };
    Chart {
        title: format!("{device} on {model}: KL divergence by position"),
        x_label: "position".into(),
        y_label: "KLD (nats)".into(),
        log_y: true,
        series: vec![
            Series { name: "KLD oracle -> device".into(), points: pts(|p| p.kld), colour: 0, dashed: false },
            Series { name: "bound 0.5*delta^2".into(), points: pts(|p| p.kld_bound), colour: 0, dashed: true },
        ],
        band: None,
        markers: Vec::new(),
        panels: false,
    }
}

fn print_summary(r: &Report) {
    if let Some(Ok(TokenFindings::Logits(ts))) = r.section::<TokenFindings>("token_stats") {
        let f = |x: f64| if x.is_finite() { format!("{x:.4e}") } else { "-".into() };
        let pct = |x: f64| if x.is_finite() { format!("{:.1}", 100.0 * x) } else { "-".into() };
        outln!(
            "KLD mean {} median {} p99 {} max {} (bound on mean {}); same top-1 {}% of positions (95% CI {}-{}%); near ties {}",
            f(ts.kld.mean),
            f(ts.kld.median),
            f(ts.kld.p99),
            f(ts.kld.max.unwrap_or(f64::NAN)),
            f(ts.kld_bound_mean),
            pct(ts.same_top1.rate),
            pct(ts.same_top1.ci95[0]),
            pct(ts.same_top1.ci95[1]),
            ts.near_ties,
        );
        outln!("mean |logit error| {} (max {}); same top-5 ids at {} of {} positions", f(ts.mean_abs_logit), f(ts.max_abs_logit), ts.same_top5, ts.positions);
    }
    for c in &r.cases {
        // A KLD-ratio gate that passed says by how much (a failed one's message does).
        let ratio = c.metrics.get("ratio").and_then(|v| v.as_f64()).map(|x| {
            let ci = c.metrics.get("ratio_ci95").and_then(|v| Some(format!(", 95% CI {:.3}-{:.3}x", v.get(0)?.as_f64()?, v.get(1)?.as_f64()?))).unwrap_or_default();
            let of = if c.id.contains("gate=kld_vs_baseline") { "the baseline's" } else { "the emulated arithmetic's" };
            format!(": mean KLD {x:.3}x {of}{ci} (bound {:.3e})", c.tolerance.bound)
        });
        outln!("  {:<12} {}{}", format!("{:?}", c.verdict), c.id, c.message.as_deref().map(|m| format!(": {m}")).or(ratio).unwrap_or_default());
    }
    let s = &r.summary;
    outln!("{} gates: {} passed, {} failed, {} unsupported, {} errors", s.executed, s.passed, s.failed, s.unsupported, s.errors);
}
