//! `cargo xtask serving`: one request judged under batching, neighbours, prefix reuse, chunked
//! prefill, decode and slot recycling on a device that serves schedules (suites::serving).

use super::{resolve_model, Engine};
use crate::Exit;
use devices::DeviceSpec;
use oracle::Precision;
use reports::{Provenance, Report};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use suites::layerdiff::Dims;
use suites::fixedtoken::RoutingTap;
use suites::serving;

#[derive(clap::Args)]
pub struct ServingArgs {
    #[arg(long, default_value = "cpu", value_parser = super::device_arg, help = concat!("Device under test: ", devices::device_names!(), "."))]
    pub device: DeviceSpec,
    #[arg(long, help = concat!("Model: ", fixtures::model_names!(), ", or a path to a .gguf file, a flat file (`export`) or a safetensors directory."))]
    pub model: String,
    /// The request judged, as comma-separated token ids (default: the model's golden sequence,
    /// else the default prompt); --prompt-len of them are its prompt, the rest decoded.
    #[arg(long)]
    pub prompt_ids: Option<String>,
    /// How many of the request's tokens are its prompt (default: the golden's prompt, else two
    /// thirds of the ids).
    #[arg(long)]
    pub prompt_len: Option<usize>,
    /// Seed of the neighbours' token ids and of the random schedules.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Random schedules to add (axis `random`): up to six requests each, drawn from the judged
    /// request, one sharing its prompt and two others, at random arrivals, chunk sizes, slots
    /// (recycled as they free) and reused prefixes; the last to arrive judged against its own
    /// run alone, every request against the oracle.
    #[arg(long, default_value_t = 0)]
    pub random: usize,
    /// Where report.json, report.md, junit.xml and cases.csv go (default target/touchstone/serving-YYYYMMDD-HHMMSS/).
    #[arg(long)]
    pub report_dir: Option<PathBuf>,
    /// A label for the device in the console and the reports.
    #[arg(long)]
    pub name: Option<String>,
}

pub fn main(a: ServingArgs) -> Result<u8, Exit> {
    super::check_report_dir(a.report_dir.as_deref())?;
    super::check_label(a.name.as_deref())?;
    let t0 = std::time::Instant::now();
    let (mut report, axes) = serving(&a)?;
    super::spread_time(&mut report.cases, t0.elapsed().as_secs_f64());
    super::label_devices(&mut report, &[a.device.name().to_string()], a.name.as_deref());
    for c in report.cases.iter().filter(|c| c.verdict != reports::Verdict::Pass) {
        outln!("  {:<12} {}{}", format!("{:?}", c.verdict), c.id, c.message.as_deref().map(|m| format!(": {m}")).unwrap_or_default());
    }
    for row in &axes {
        outln!("  {:<14} {:>3} schedules; against its counterpart: {} (closest {}); against the oracle: {} (closest {})", row[0], row[1], row[2], row[3], row[4], row[5]);
    }
    let s = &report.summary;
    outln!("{} cases (each schedule against its counterpart and against the oracle): {} passed, {} failed, {} unsupported, {} errors", s.executed, s.passed, s.failed, s.unsupported, s.errors);
    let dir = super::write_report(&mut report, a.report_dir)?;
    outln!("report: {}", dir.join("report.json").display());
    Ok(report.exit_code())
}

/// The request judged: its ids and how many are its prompt.
fn target(a: &ServingArgs, path: &std::path::Path, tok: Option<&oracle::tokenizer::Tokenizer>, n_vocab: usize) -> Result<(Vec<u32>, usize), Exit> {
    let (ids, p0) = match &a.prompt_ids {
        Some(s) => {
            let ids = super::parse_ids("--prompt-ids", s)?;
            let p0 = ids.len() * 2 / 3;
            (ids, p0)
        }
        None => match ::fixtures::golden_path(&a.model).filter(|f| f.exists()) {
            Some(f) => {
                let text = std::fs::read_to_string(&f).map_err(|e| super::io_exit(&f, e))?;
                let g: suites::fixedtoken::Golden = serde_json::from_str(&text).map_err(|e| Exit::new(2, format!("{}: {e}", f.display())))?;
                (g.sequence(), g.prompt_ids.len())
            }
            None => {
                let ids = super::layerdiff::default_prompt(tok, n_vocab)?;
                let p0 = ids.len() * 2 / 3;
                (ids, p0)
            }
        },
    };
    let p0 = a.prompt_len.unwrap_or(p0);
    if ids.len() < 2 || p0 == 0 || p0 >= ids.len() {
        return Err(Exit::new(2, format!("{}: a request of {} tokens with a prompt of {p0}: at least one prompt token and one decoded token are needed", path.display(), ids.len())));
    }
    super::check_ids(&ids, n_vocab)?;
    Ok((ids, p0))
}

/// Runs the serving suite the arguments describe: its report, and its per-axis rows
/// (`serving::AXIS_COLUMNS`).
pub fn serving(a: &ServingArgs) -> Result<(Report, Vec<Vec<String>>), Exit> {
    let opened = super::open_device(&a.device)?;
    let path = resolve_model(&a.model)?;
    let (oracle, tok) = super::load_oracle(&path, Precision::F32)?;
    let spec = oracle.spec().clone();
    let (seq, p0) = target(a, &path, tok.as_ref(), spec.n_vocab)?;
    let window = spec.layers.iter().find_map(|l| match l.block {
        oracle::spec::BlockKind::Attention(at) => at.window,
        oracle::spec::BlockKind::Ssm(_) | oracle::spec::BlockKind::Mla(_) => None,
    });
    let mut cases = serving::cases(&seq, p0, spec.n_vocab, window, a.seed);
    if a.random > 0 {
        if a.random > 100_000 {
            return Err(Exit::new(2, format!("--random {}: at most 100000 schedules", a.random)));
        }
        // The judged request, one sharing its prompt, and two of other content.
        let mut shared = seq[..p0].to_vec();
        shared.extend(seq[p0..].iter().rev());
        let other = |k: u32| -> Vec<u32> { seq.iter().map(|t| (t.wrapping_mul(31).wrapping_add(k * 7919)) % spec.n_vocab as u32).collect() };
        let pool = vec![seq.clone(), shared, other(1), other(2)[..seq.len() / 2 + 1].to_vec()];
        cases.extend(serving::random_cases(&pool, a.random, a.seed));
    }
    // The oracle on every distinct request alone, before the device is loaded (the two models
    // are never held at once).
    let mut distinct: Vec<Vec<u32>> = Vec::new();
    for c in &cases {
        let counterpart = match &c.counterpart {
            serving::Counterpart::Other { schedule, .. } => schedule.requests.as_slice(),
            serving::Counterpart::Alone => &[],
        };
        for r in c.schedule.requests.iter().chain(counterpart) {
            if !distinct.contains(&r.tokens) {
                distinct.push(r.tokens.clone());
            }
        }
    }
    let longest = distinct.iter().map(Vec::len).max().unwrap_or(0);
    super::check_recordings_fit("serving", &spec, false, longest, 2 * distinct.len() as u64)?;
    eprintln!("serving: {} on {} ({} schedules, {} distinct requests, the judged one {} tokens) ...", a.device, a.model, cases.len(), distinct.len(), seq.len());
    let stages = super::Stages::new(2, &format!("serving {} on {}", a.device, a.model));
    stages.next(&format!("the oracle on {} requests alone", distinct.len()));
    let mut head = suites::fixedtoken::OracleTap::default();
    let mut oracle_runs: BTreeMap<Vec<u32>, (Arc<Vec<f64>>, RoutingTap)> = BTreeMap::new();
    for ids in &distinct {
        let mut routing = RoutingTap::default();
        let logits = if *ids == seq {
            let l = oracle.prefill_logits(ids, &mut head)?;
            routing = std::mem::take(&mut head.routing);
            l
        } else {
            oracle.prefill_logits(ids, &mut routing)?
        };
        oracle_runs.insert(ids.clone(), (Arc::new(logits), routing));
    }
    drop(oracle);
    let (_, engine, _) = super::load_engine_on(&a.model, opened, Precision::F32)?;
    stages.next(&format!("{}: {} schedules", a.device, cases.len()));
    let Engine::Device(mut m) = engine else {
        let case = serving::unsupported(&a.model, a.device.name(), "the oracle runs one request at a time; the serving rung judges devices");
        return Ok((Report::new("serving", Provenance::collect(rayon::current_num_threads()), vec![case]), Vec::new()));
    };
    // MoE: the device's own run of each request, for the experts it chose.
    let mut device_routing: BTreeMap<Vec<u32>, RoutingTap> = BTreeMap::new();
    if spec.moe.is_some() {
        for ids in &distinct {
            let mut routing = RoutingTap::default();
            m.reset();
            m.forward(ids, &mut routing).map_err(Exit::from)?;
            device_routing.insert(ids.clone(), routing);
        }
        m.reset();
    }
    let answers = {
        let mut serve = |s: &oracle::schedule::Schedule| m.serve(s).map(|r| r.map_err(|e| e.to_string()));
        serving::serve_all(&cases, &mut serve, spec.n_vocab)
    };
    // Asked after the answers: an external engine declares them with its answer.
    let invariant = m.batch_invariant();
    let arith = m.arithmetic();
    arith.check().map_err(|e| Exit::new(2, format!("{}: declared arithmetic: {e}", a.device)))?;
    let dims = Dims::of(&spec, longest);
    let (budget, _, _) = super::fixedtoken::logit_budget(&path, &head.head, &arith, &dims)?;
    let Some(answers) = answers else {
        let case = serving::unsupported(&a.model, a.device.name(), "this engine does not serve schedules (docs/SERVING_PROTOCOL.md)");
        return Ok((Report::new("serving", Provenance::collect(rayon::current_num_threads()), vec![case]), Vec::new()));
    };
    // Where a request got other bits than its counterpart under a bit-for-bit rule: the first tap
    // that differs, on a device that records taps while it serves.
    let mut first_taps: BTreeMap<String, (String, usize)> = BTreeMap::new();
    for (c, answer) in cases.iter().zip(&answers) {
        if !serving::differs_bitwise(c, answer, spec.n_vocab, invariant) {
            continue;
        }
        let mut served = oracle::RecordingTap::default();
        let Some(ran) = m.serve_tapped(&c.schedule, &c.target, &mut served) else { break };
        let mut reference = oracle::RecordingTap::default();
        let reran = ran.map(|_| ()).and_then(|_| match &c.counterpart {
            serving::Counterpart::Alone => {
                let tokens = &c.schedule.request(&c.target).expect("the target is in its schedule").tokens;
                m.reset();
                let r = m.forward(tokens, &mut reference).map(|_| ());
                m.reset();
                r
            }
            serving::Counterpart::Other { schedule, id } => m.serve_tapped(schedule, id, &mut reference).unwrap_or(Ok(Default::default())).map(|_| ()),
        });
        if let Err(e) = reran {
            eprintln!("note: {}: the taps of `{}` could not be recorded: {e}", c.id(&a.model), c.target);
            continue;
        }
        if served.order.is_empty() {
            // The engine wrote no taps while it served.
            continue;
        }
        let first = c.schedule.request(&c.target).map_or(0, |r| r.first_computed());
        if let Some(found) = serving::first_differing_tap(&served, &reference, first) {
            first_taps.insert(c.id(&a.model), found);
        }
    }
    drop(m);
    // Where a device routed a request otherwise than the oracle only at near ties, the oracle
    // again (loaded anew: the two models are never held at once), routing as the device did.
    let mut judged_by: BTreeMap<Vec<u32>, serving::OracleRun> = BTreeMap::new();
    let mut follow: Option<oracle::generate::AnyModel> = None;
    for (ids, (mut logits, oracle_routing)) in oracle_runs {
        let mut routing_differs = vec![false; ids.len()];
        if let Some(device) = device_routing.get(&ids) {
            routing_differs = suites::fixedtoken::routing_differs(&oracle_routing, device, ids.len());
            if routing_differs.contains(&true) {
                if follow.is_none() {
                    stages.note("the oracle again, routed as the device did at near ties");
                    follow = Some(super::load_oracle(&path, Precision::F32)?.0);
                }
                let oracle = follow.as_ref().expect("loaded above");
                logits = Arc::new(super::fixedtoken::followed_oracle(oracle, &ids, device, &arith, &dims)?.0);
            }
        }
        judged_by.insert(ids, serving::OracleRun { logits, routing_differs });
    }
    let oracle_of = |ids: &[u32]| judged_by.get(ids).cloned();
    let mut cases = serving::judge(&cases, &answers, &oracle_of, spec.n_vocab, &budget, invariant, &a.model, a.device.name());
    for case in cases.iter_mut().filter(|c| c.verdict == reports::Verdict::Fail) {
        if let Some((tap, pos)) = first_taps.get(&case.id) {
            case.metrics.set("first_tap", tap);
            case.metrics.set("first_tap_position", pos);
            if let Some(m) = &mut case.message {
                m.push_str(&format!("; first tap that differs: {tap} at position {pos}"));
            }
        }
    }
    let rows = serving::axis_rows(&cases);
    let mut report = Report::new("serving", Provenance::collect(rayon::current_num_threads()), cases);
    let kind = if invariant { "declared batch-invariant: shape axes held bit for bit" } else { "not declared batch-invariant: shape axes within twice the logit budget" };
    report.add_table("serving_axes", &format!("{} on {}, per axis ({kind})", a.device, a.model), &serving::AXIS_COLUMNS, rows.clone());
    report.set_section("model", &a.model);
    report.set_section("request_ids", &seq);
    report.set_section("prompt_len", &p0);
    report.set_section("batch_invariant", &invariant);
    report.set_section("arithmetic", &arith);
    Ok((report, rows))
}
