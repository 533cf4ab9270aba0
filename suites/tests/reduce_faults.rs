//! `reduce` over the kernel suite's faulty devices: each fault lives in every call of its op,
//! and the device's whole model is composed of its own ops (`devices::op_model`), so a fault that
//! layer-diff shows at a tap must come back from `reduce` as a one-op case the faulty device
//! still fails alone, and the correct device has nothing to reduce.
//!
//! `cargo test -p suites --test reduce_faults -- --nocapture` prints the table of
//! docs/ACCURACY.md ("From a red tap to a one-op case").

use devices::cpu::CpuDevice;
use devices::faulty::{Fault, FaultyDevice};
use devices::Device;
use reports::Verdict;
use suites::layerdiff::{self, Mode};

#[test]
fn every_fault_layer_diff_shows_reduces_to_a_failing_one_op_case() {
    let ids: [u32; 12] = [17, 101, 44, 3, 250, 99, 7, 61, 200, 11, 5, 130];
    let (mut shown, mut reduced) = (0, 0);
    println!("| model | fault | first divergence | reduced case | input values | seconds |\n|---|---|---|---|---|---|");
    for fixture in ["tiny-llama", "tiny-qwen3"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(format!("{fixture}.gguf"));
        std::fs::write(&path, fixtures::synthetic::build(fixture).unwrap()).unwrap();
        let (oracle_model, _) = oracle::generate::AnyModel::load(&path, oracle::Precision::F32).unwrap();
        let mut oracle_taps = oracle::RecordingTap::default();
        oracle_model.prefill_logits(&ids, &mut oracle_taps).unwrap();
        let (src, spec) = oracle::loader::open_weights(&path).unwrap();
        let first_of = |device: &dyn Device| {
            let mut model = device.load_model(&path, &devices::ModelOptions::default()).unwrap();
            let mut taps = oracle::RecordingTap::default();
            model.forward(&ids, &mut taps).unwrap();
            let out = layerdiff::run(&oracle_model, &path, &ids, &taps, &model.arithmetic(), Mode::Isolated, suites::emulate::EMULATION_FACTOR, fixture, &device.name()).unwrap();
            (layerdiff::first_divergence_finding(&out.taps), taps)
        };
        // The correct device, through the same composition, has nothing to reduce.
        let (first, _) = first_of(&devices::op_model::Composed(std::sync::Arc::new(CpuDevice::default())));
        assert!(first.is_none(), "{fixture}: the correct device's composed model diverges: {first:?}");
        for fault in Fault::ALL {
            let device = FaultyDevice(fault);
            let t0 = std::time::Instant::now();
            let (first, device_taps) = first_of(&device);
            let Some(first) = first else { continue };
            shown += 1;
            let tap = oracle::taps::TapName::parse(&first.tap).unwrap();
            let found = suites::reduce::reduce(&device, tap, &spec, src.as_ref(), &oracle_taps, &device_taps);
            let secs = t0.elapsed().as_secs_f64();
            let row = match found {
                Ok(suites::reduce::Reduction { steps, reduced: Some((case, judged, _)) }) => {
                    assert_eq!(judged.verdict, Verdict::Fail, "{fixture} {fault:?}: {}", case.id);
                    // The case fails again on the faulty device and passes on the correct one.
                    assert_eq!(suites::kernels::run_case(&device, &case, false).verdict, Verdict::Fail, "{fixture} {fault:?}: {}", case.id);
                    assert_eq!(suites::kernels::run_case(&CpuDevice::default(), &case, false).verdict, Verdict::Pass, "{fixture} {fault:?}: {}", case.id);
                    reduced += 1;
                    let (from, to) = (steps.first().map_or(0, |s| s.values), steps.last().map_or(0, |s| s.values));
                    format!("`{}` | {from} → {to}", case.id.split("(from").next().unwrap_or(""))
                }
                Ok(_) => "passes alone | —".to_string(),
                Err(why) => format!("no case: {why} | —"),
            };
            println!("| {fixture} | {fault:?} | `{}` | {row} | {secs:.1} |", first.tap);
        }
    }
    println!("{reduced} of {shown} faults shown by layer-diff reduced to a failing one-op case");
    assert!(shown >= 10, "only {shown} faults showed on the models");
    assert!(reduced * 10 >= shown * 9, "{reduced} of {shown} reduced");
}
