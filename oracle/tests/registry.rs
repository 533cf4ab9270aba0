//! The registry invariant: every op has cases, a rule, and a reference that runs every case;
//! case ids are unique; and the matmul reference agrees with a naive f64 loop written here.

use oracle::ops::SplitMix64;
use oracle::quant::decode;
use oracle::registry::{registry, Input, Op, Output, ToleranceRule};

#[test]
fn every_op_has_cases_a_rule_and_a_runnable_reference() {
    let mut ids = std::collections::HashSet::new();
    let mut total = 0;
    for e in registry() {
        let cases = (e.cases)(0);
        assert!(!cases.is_empty(), "{}: no cases", e.op);
        assert!(!e.rule.describe().is_empty(), "{}: no tolerance rule", e.op);
        for c in &cases {
            assert_eq!(c.op, e.op);
            assert!(c.id.starts_with(e.op.name()), "{}", c.id);
            assert!(ids.insert(c.id.clone()), "duplicate case id {}", c.id);
            let outs = (e.reference)(c).unwrap_or_else(|err| panic!("{}: {err}", c.id));
            assert!(!outs.is_empty());
            for o in outs {
                match o {
                    Output::F32(t) => {
                        assert_eq!(t.data.len(), t.shape.iter().product::<usize>(), "{}", c.id);
                        // The softmax case masks half a row with -inf; its outputs are still finite.
                        assert!(t.data.iter().all(|v| v.is_finite()), "{}: non-finite output", c.id);
                    }
                    Output::Ids(v) => assert!(!v.is_empty(), "{}", c.id),
                }
            }
            assert!((e.bytes)(c) > 0, "{}: zero bytes", c.id);
            if e.rule != ToleranceRule::Exact && e.op != Op::Embed {
                assert!((e.flops)(c) > 0, "{}: zero flops", c.id);
            }
        }
        total += cases.len();
    }
    // A floor that catches a generator silently losing its shape or seed loops.
    // The kernel gate promises at least 2,000 cases on cpu.
    assert!(total >= 2000, "only {total} cases");
}

#[test]
fn matmul_reference_equals_a_naive_f64_loop() {
    let e = registry().into_iter().find(|e| e.op == Op::Matmul).unwrap();
    let mut rng = SplitMix64(5);
    for c in (e.cases)(0).iter().filter(|_| rng.next_u64().is_multiple_of(8)) {
        let Some((_, Input::F32(x))) = c.inputs.iter().find(|(n, _)| *n == "x") else { panic!() };
        let Some((_, Input::Quant { ty, rows, cols, bytes })) = c.inputs.iter().find(|(n, _)| *n == "w") else { panic!() };
        let w = decode(*ty, bytes, rows * cols).unwrap();
        let (m, _, stride) = oracle::registry::view_dims(c, x);
        let Output::F32(y) = &(e.reference)(c).unwrap()[0] else { panic!() };
        for t in 0..m {
            for r in 0..*rows {
                let mut acc = 0.0f64;
                for i in 0..*cols {
                    acc += x.data[t * stride + i] as f64 * w[r * cols + i] as f64;
                }
                // Both accumulate exact products in f64; only the order differs.
                let got = y.data[t * rows + r] as f64;
                assert!((got - acc).abs() <= 1e-6 * acc.abs().max(1.0), "{}: [{t},{r}] {got} vs {acc}", c.id);
            }
        }
    }
}

#[test]
fn exact_ops_resolve_ties_to_the_lower_index() {
    let e = registry().into_iter().find(|e| e.op == Op::Argmax).unwrap();
    for c in (e.cases)(0) {
        let Output::Ids(ids) = &(e.reference)(&c).unwrap()[0] else { panic!() };
        let n = match &c.inputs[0].1 {
            Input::F32(t) => t.shape[1],
            _ => panic!(),
        };
        assert_eq!(ids[2] as usize, n / 3, "{}", c.id);
    }
}

/// A selection (a filter, a shard) builds exactly the cases the full list holds under those ids,
/// inputs and all: matmul builds only the kept ones, and shares a variant's weights between m.
#[test]
fn a_selection_builds_the_same_cases_as_the_full_list() {
    let inputs = |c: &oracle::registry::OpCase| format!("{:?}", c.inputs);
    for e in registry().iter().filter(|e| [Op::Matmul, Op::RmsNorm].contains(&e.op)) {
        let full = (e.cases)(7);
        for keep in [
            Box::new(|id: &str| id.contains("m=8") && id.contains("w=q4_k")) as Box<dyn Fn(&str) -> bool>,
            Box::new(|id: &str| id.contains("view=") || id.ends_with("1)")),
            Box::new(|id: &str| id.bytes().map(usize::from).sum::<usize>() % 5 == 2),
        ] {
            let chosen = e.cases_where(7, &keep);
            let want: Vec<_> = full.iter().filter(|c| keep(&c.id)).collect();
            assert!(!chosen.is_empty() || e.op != Op::Matmul, "{}: the selection holds cases", e.op);
            assert_eq!(chosen.iter().map(|c| &c.id).collect::<Vec<_>>(), want.iter().map(|c| &c.id).collect::<Vec<_>>(), "{}", e.op);
            assert!(chosen.iter().zip(&want).all(|(a, b)| inputs(a) == inputs(b) && a.params == b.params), "{}: the inputs differ", e.op);
        }
    }
}
