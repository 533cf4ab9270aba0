//! `cargo xtask bench`: throughput of the oracle with a bandwidth probe in the same run.

use super::{check_device, load_engine};
use crate::Exit;
use oracle::Precision;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct BenchArgs {
    #[arg(long, default_value = "ref")]
    device: String,
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Prompt length in tokens (token ids 1..=N cycled through the vocabulary).
    #[arg(long, default_value_t = 32)]
    prompt_len: usize,
    /// Tokens generated per repetition.
    #[arg(long, default_value_t = 64)]
    gen_len: usize,
    /// Measured repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Write bench.json here.
    #[arg(long)]
    report_dir: Option<PathBuf>,
    #[arg(long, default_value = "f32")]
    precision: Precision,
}

pub fn main(a: BenchArgs) -> Result<u8, Exit> {
    check_device(&a.device)?;
    if a.prompt_len == 0 || a.gen_len < 2 || a.reps == 0 {
        return Err(Exit { code: 2, message: "--prompt-len >= 1, --gen-len >= 2 and --reps >= 1 are required".into() });
    }
    let (_, mut engine, _) = load_engine(&a.model, &a.device, a.precision)?;
    let n_vocab = engine.spec().n_vocab as u32;
    let prompt: Vec<u32> = (0..a.prompt_len as u32).map(|i| 1 + (i * 7919) % (n_vocab - 1)).collect();
    let pb = indicatif::ProgressBar::new(a.reps as u64);
    pb.set_style(indicatif::ProgressStyle::with_template("bench {pos}/{len} [{bar:30}] {elapsed}").expect("template"));
    let r = match &mut engine {
        super::Engine::Oracle(model) => suites::throughput::bench_ref(model, &prompt, a.gen_len, a.reps, |i| pb.set_position(i as u64))?,
        engine => {
            let greedy = oracle::ops::SamplerConfig { temperature: 0.0, top_k: 0, top_p: 1.0 };
            suites::throughput::bench_with(|p, n| engine.generate(p, n, &greedy, 0, None), 0, &prompt, a.gen_len, a.reps, |i| pb.set_position(i as u64))?
        }
    };
    pb.finish_and_clear();
    let med = suites::throughput::median;
    let path_note = if a.device == "ref" { format!(", oracle dot path {}", r.dot_path) } else { String::new() };
    println!("device {} model {} precision {:?}, {} threads{path_note}", a.device, a.model, a.precision, r.threads);
    println!("prefill ({} tokens): median {:.1} tok/s   samples {:?}", r.prompt_len, med(&r.prefill_tok_per_s), fmt(&r.prefill_tok_per_s));
    println!("decode  ({} tokens): median {:.2} tok/s   samples {:?}", r.gen_len, med(&r.decode_tok_per_s), fmt(&r.decode_tok_per_s));
    if r.effective_gbps.is_empty() {
        println!("(this device does not report the bytes it reads per token: no bandwidth figures)");
        return write_json(&a.report_dir, &r);
    }
    let copy: Vec<f64> = r.probes.iter().map(|p| p.copy_gbps).collect();
    let read: Vec<f64> = r.probes.iter().map(|p| p.read_gbps).collect();
    println!(
        "weights read per token {:.1} MB -> effective {:.2} GB/s (median)   samples {:?}",
        r.weight_bytes_per_token as f64 / 1e6,
        med(&r.effective_gbps),
        fmt(&r.effective_gbps)
    );
    println!("probe before each rep (512 MB, same threads): copy {:?} GB/s, read {:?} GB/s", fmt(&copy), fmt(&read));
    println!(
        "effective / probe, median of per-rep ratios: {:.0}% of STREAM-style copy, {:.0}% of read-only",
        100.0 * r.fraction_of_copy_probe,
        100.0 * r.fraction_of_read_probe
    );
    write_json(&a.report_dir, &r)
}

fn write_json(dir: &Option<PathBuf>, r: &suites::throughput::RefBench) -> Result<u8, Exit> {
    if let Some(dir) = dir {
        let path = dir.join("bench.json");
        std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, serde_json::to_string_pretty(r).unwrap_or_default() + "\n")).map_err(|e| super::io_exit(&path, e))?;
    }
    Ok(0)
}

fn fmt(v: &[f64]) -> Vec<String> {
    v.iter().map(|x| format!("{x:.2}")).collect()
}
