//! The declared arithmetic of a device, emulated on the oracle: what an honest engine of that
//! arithmetic computes, as the reference the fixed-token gate (`kld_vs_emulation`) and layer-diff
//! (each tap's `emulated` error) hold a device to.

/// The oracle re-run with a declared arithmetic's roundings where it declares them, so its logits
/// are what an honest engine of that arithmetic computes (up to the order of its sums): a tap
/// that substitutes, after each op, the value rounded as the engine would hold it —
/// activations entering a matrix product rounded to symmetric 8-bit blocks (llama.cpp's Q8_0:
/// scale max|x|/127 stored as f16) when `activation_q8_block` says so, cached keys and values
/// rounded to the cache's format, and every value to a 16-bit storage format.
#[derive(Debug)]
pub struct EmulatedArithmetic {
    q8_block: Option<usize>,
    kv: Option<devices::NumFormat>,
    storage: Option<devices::NumFormat>,
    pending: Option<Vec<f32>>,
    /// Each tap's value as the op computed it (before the rounding the next op sees), when
    /// [`EmulatedArithmetic::recording`] asked for it.
    pub recorded: Option<oracle::RecordingTap>,
}

/// The taps whose values enter a matrix product (the attention and FFN inputs, the attention
/// output before its projection, the final norm before the output matrix).
const MATMUL_INPUTS: [&str; 5] = [".attn_norm", ".attn_kqv", ".ffn_norm", ".ffn_act", "result_norm"];

/// One value rounded to a 16-bit format (`F16`, `BF16`); others unchanged.
fn round_to(f: devices::NumFormat, x: f32) -> f32 {
    match f {
        devices::NumFormat::F16 => half::f16::from_f32(x).to_f32(),
        devices::NumFormat::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `x` (rows of `width`) rounded to symmetric 8-bit blocks of `block` values along each row, as
/// llama.cpp's Q8_0 quantizes activations: d = max|x|/127, q = round(x/d), value q * f16(d).
pub fn round_q8_blocks(x: &mut [f32], width: usize, block: usize) {
    for row in x.chunks_mut(width.max(1)) {
        for b in row.chunks_mut(block.max(1)) {
            let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let d16 = half::f16::from_f32(d).to_f32();
            for v in b.iter_mut() {
                *v = (*v * id).round() * d16;
            }
        }
    }
}

impl EmulatedArithmetic {
    /// The emulation of `arith` (on a MoE model when `moe`), or why there is none: fixed-point
    /// arithmetic (its roundings are not the float ones emulated here), MoE models (their expert
    /// products have no taps to round at), or nothing declared to round (f32 storage, no
    /// quantized activations, no rounding cache: the worst-case bound is already sharp there).
    pub fn new(arith: &devices::Arithmetic, moe: bool) -> Result<EmulatedArithmetic, String> {
        use devices::NumFormat::{BF16, F16};
        if arith.fixed.is_some() {
            return Err("fixed-point arithmetic is not emulated".into());
        }
        if moe {
            return Err("MoE experts' products have no taps to round at".into());
        }
        let storage = matches!(arith.storage, F16 | BF16).then_some(arith.storage);
        let kv = arith.kv_cache.filter(|f| matches!(f, F16 | BF16));
        if arith.activation_q8_block.is_none() && kv.is_none() && storage.is_none() {
            return Err("nothing in the declared arithmetic rounds beyond f32".into());
        }
        Ok(EmulatedArithmetic { q8_block: arith.activation_q8_block, kv, storage, pending: None, recorded: None })
    }

    /// The same emulation, also recording every tap (layer-diff compares them with the oracle's).
    pub fn recording(self) -> EmulatedArithmetic {
        EmulatedArithmetic { recorded: Some(oracle::RecordingTap::default()), ..self }
    }
}

impl oracle::Tap for EmulatedArithmetic {
    fn record(&mut self, name: &str, start_pos: usize, n_tokens: usize, width: usize, data: &[f32]) {
        if let Some(r) = &mut self.recorded {
            r.record(name, start_pos, n_tokens, width, data);
        }
        let mut v = data.to_vec();
        let mut changed = false;
        if let Some(f) = self.storage {
            v.iter_mut().for_each(|x| *x = round_to(f, *x));
            changed = true;
        }
        if let Some(f) = self.kv.filter(|_| name.ends_with(".attn_k_rope") || name.ends_with(".attn_v")) {
            v.iter_mut().for_each(|x| *x = round_to(f, *x));
            changed = true;
        }
        if let Some(b) = self.q8_block.filter(|_| MATMUL_INPUTS.iter().any(|m| name.ends_with(m))) {
            round_q8_blocks(&mut v, width, b);
            changed = true;
        }
        self.pending = changed.then_some(v);
    }
    fn substitute(&mut self, _name: &str, _start_pos: usize, _n_tokens: usize, _width: usize) -> Option<Vec<f32>> {
        self.pending.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Q8 rounding equals llama.cpp's Q8_0 as the oracle's codec (checked against gguf-py)
    /// encodes and decodes it, row by row.
    #[test]
    fn q8_rounding_is_q8_0() {
        let x: Vec<f32> = (0..128).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013 + if i == 70 { 3.0 } else { 0.0 }).collect();
        let mut got = x.clone();
        round_q8_blocks(&mut got, 64, 32);
        let want = oracle::quant::decode(oracle::quant::GgmlType::Q8_0, &oracle::quant::encode(oracle::quant::GgmlType::Q8_0, &x).unwrap(), x.len()).unwrap();
        assert_eq!(got, want);
        assert_ne!(got, x, "it rounds");
    }

    /// The emulation rounds where the arithmetic says and nowhere else, and says why it does not
    /// apply to fixed-point, MoE or plain f32 arithmetic.
    #[test]
    fn the_emulated_arithmetic_rounds_where_declared() {
        use oracle::Tap;
        let q8 = devices::Arithmetic { activation_q8_block: Some(32), ..devices::Arithmetic::F32 };
        let mut emu = EmulatedArithmetic::new(&q8, false).unwrap();
        let x: Vec<f32> = (0..64).map(|i| 0.1 + i as f32 * 0.0123).collect();
        emu.record("blk.0.attn_norm", 0, 1, 64, &x);
        let sub = emu.substitute("blk.0.attn_norm", 0, 1, 64).expect("a matmul input is rounded");
        assert!(sub != x && sub.iter().zip(&x).all(|(a, b)| (a - b).abs() <= 0.9 / 127.0 * 0.5 + 1e-6));
        emu.record("blk.0.ffn_inp", 0, 1, 64, &x);
        assert!(emu.substitute("blk.0.ffn_inp", 0, 1, 64).is_none(), "the residual stream is not");
        let kv = devices::Arithmetic { kv_cache: Some(devices::NumFormat::F16), ..devices::Arithmetic::F32 };
        let mut emu = EmulatedArithmetic::new(&kv, false).unwrap();
        emu.record("blk.1.attn_v", 0, 1, 64, &x);
        assert_eq!(emu.substitute("blk.1.attn_v", 0, 1, 64).unwrap(), x.iter().map(|v| half::f16::from_f32(*v).to_f32()).collect::<Vec<_>>());
        emu.record("blk.1.attn_norm", 0, 1, 64, &x);
        assert!(emu.substitute("blk.1.attn_norm", 0, 1, 64).is_none());
        assert!(EmulatedArithmetic::new(&devices::Arithmetic::F32, false).unwrap_err().contains("nothing"));
        let point = devices::FixedPoint { act_frac: 16, weight_frac: 24, norm_frac: 20, table_frac: 16, exp_abs: 1e-4, int4_group: None };
        assert!(EmulatedArithmetic::new(&devices::Arithmetic { fixed: Some(point), ..q8 }, false).unwrap_err().contains("fixed-point"));
        assert!(EmulatedArithmetic::new(&q8, true).unwrap_err().contains("MoE"));
    }
}
