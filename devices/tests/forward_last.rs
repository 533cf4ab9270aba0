//! `forward_last` (what generation and the bench run) against `forward`: on every device that runs
//! models on this machine, the last token's logits hold the bits `forward` gives that row, the
//! cache is left the same (the next step gives the same bits), and the output head ran on that
//! one row (its `result_output` tap holds one row, at the last position). gpu-emu is skipped,
//! saying so, without a C++ compiler unless `TOUCHSTONE_REQUIRE_GPU_EMU=1`.

use devices::{DeviceModel, ModelOptions};
use oracle::{NoTap, Tap};

const TOKENS: [u32; 9] = [5, 200, 17, 3, 99, 250, 1, 42, 7];

/// The (start, rows) of each `result_output` tap recorded.
#[derive(Default)]
struct HeadRows(Vec<(usize, usize)>);

impl Tap for HeadRows {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, _width: usize, _data: &[f32]) {
        if name == "result_output" {
            self.0.push((start_pos, n_tokens));
        }
    }
}

fn load(device: &str, name: &str) -> Option<Box<dyn DeviceModel>> {
    let dev = match devices::open(device) {
        Ok(d) => d,
        Err(e) => {
            assert!(!(device.starts_with("gpu-emu") && std::env::var("TOUCHSTONE_REQUIRE_GPU_EMU").as_deref() == Ok("1")), "{e}");
            eprintln!("SKIPPED {device}: {e}");
            return None;
        }
    };
    let path = fixtures::resolve(name, true).unwrap();
    match dev.load_model(&path, &ModelOptions::default()) {
        Ok(m) => Some(m),
        // The integer device has no MoE kernels (its own test checks the error).
        Err(e) if device.starts_with("fixed") && e.to_string().contains("MoE") => None,
        Err(e) => panic!("{device} {name}: {e}"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn forward_last_is_the_last_row_of_forward_and_runs_the_head_once() {
    let mut checked = 0;
    for device in ["cpu", "cpu:kv-f16", "fixed", "fixed-int4", "gpu-emu"] {
        for name in fixtures::SYNTHETIC {
            let (Some(mut a), Some(mut b)) = (load(device, name), load(device, name)) else { continue };
            let n = a.spec().n_vocab;
            let all = a.forward(&TOKENS, &mut NoTap).unwrap();
            let mut head = HeadRows::default();
            let last = b.forward_last(&TOKENS, &mut head).unwrap();
            assert_eq!(last.len(), n, "{device} {name}");
            assert_eq!(bits(&last), bits(&all[all.len() - n..]), "{device} {name}: the last row differs from forward's");
            assert_eq!(head.0, vec![(TOKENS.len() - 1, 1)], "{device} {name}: the output head should run on the last row alone");
            assert_eq!(a.cached(), b.cached(), "{device} {name}");
            // The cache it filled is forward's: the next step gives the same bits.
            let next_a = a.forward(&[11], &mut NoTap).unwrap();
            let next_b = b.forward_last(&[11], &mut NoTap).unwrap();
            assert_eq!(bits(&next_a), bits(&next_b), "{device} {name}: the step after differs");
            checked += 1;
        }
    }
    eprintln!("{checked} device x model pairs checked");
    // cpu and cpu:kv-f16 on every synthetic model, fixed on the dense ones, at the least.
    assert!(checked >= 2 * fixtures::SYNTHETIC.len() + 2, "only {checked} pairs ran");
}
