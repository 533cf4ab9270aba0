//! Gate sensitivity: each bug class real engines ship, injected into a test-only faulty device,
//! must turn its cases red under the derived tolerances, while the correct cpu device passes the
//! very same cases. This is what shows the tolerances are tight enough to matter.

use devices::cpu::CpuDevice;
use devices::faulty::{Fault, FaultyDevice};
use oracle::registry::{Input, OpCase};
use reports::Verdict;
use suites::kernels::{run_case, select_cases, KernelOptions};

/// The cases a fault can show up in (a GQA mapping bug is invisible with MHA or MQA; a min bug
/// only exists in formats with a min; a row-stride bug needs at least two distinct rows).
fn affected(fault: Fault, c: &OpCase) -> bool {
    let p = |n: &str| c.pu(n).unwrap_or(0);
    let wty = c.inputs.iter().find_map(|(n, i)| if *n == "w" { if let Input::Quant { ty, .. } = i { Some(*ty) } else { None } } else { None });
    use oracle::quant::GgmlType::*;
    match fault {
        Fault::GqaMappingWrong => p("n_head_kv") > 1 && p("n_head_kv") < p("n_head"),
        Fault::QuantMinIgnored => matches!(wty, Some(Q4_1 | Q5_1 | Q4_K | Q5_K)),
        Fault::QuantScaleWrong => matches!(wty, Some(Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K | Q6_K)),
        // Position 0 with a single key cannot show an off-by-one.
        Fault::CausalOffByOne | Fault::KvWrongPosition => true,
        Fault::ViewStrideIgnored => c.id.contains("view="),
        _ => true,
    }
}

#[test]
fn every_injected_bug_class_is_caught_and_the_correct_device_passes() {
    let all = select_cases(&KernelOptions::default());
    let mut summary = Vec::new();
    for fault in Fault::ALL {
        let cases: Vec<&OpCase> = all.iter().filter(|c| fault.ops().contains(&c.op) && affected(fault, c)).collect();
        assert!(!cases.is_empty(), "{fault:?}: no cases");
        let faulty = FaultyDevice(fault);
        let (mut red, mut total) = (0, 0);
        for c in &cases {
            let good = run_case(&CpuDevice::default(), c, false);
            assert_eq!(good.verdict, Verdict::Pass, "correct cpu fails {}: {:?}", c.id, good.message);
            let bad = run_case(&faulty, c, false);
            total += 1;
            if bad.verdict == Verdict::Fail {
                red += 1;
            }
        }
        summary.push(format!("{fault:?}: {red}/{total} cases red"));
        // Every bug must be caught in the large majority of the cases it can appear in.
        assert!(red as f64 >= 0.9 * total as f64, "{fault:?}: only {red} of {total} affected cases failed");
    }
    eprintln!("{}", summary.join("\n"));
}
