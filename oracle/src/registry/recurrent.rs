//! The recurrent layers' ops: a gated DeltaNet's delta rule (`delta_rule`) and Mamba-2's
//! selective scan (`ssm_scan`) over a run of positions, from a given state. An engine may compute
//! them in any form (one position at a time, or in chunks as prefill kernels do); the reference
//! is the recurrent form, in f64.

use super::{case, normals, out, seed_of, t, Op, OpCase, Output};
use crate::error::Result;
use crate::ops::{self, SplitMix64};
use crate::spec::{SsmBlock, SsmKind};

/// (key heads, value heads, key width, value width, positions): one head; value heads sharing
/// key heads; Qwen3-Next's head width (128); odd widths; 70 positions (past a 64-position chunk).
const DELTA_SHAPES: [(usize, usize, usize, usize, usize); 5] = [(1, 1, 4, 4, 1), (2, 4, 16, 16, 9), (2, 4, 16, 16, 70), (1, 2, 128, 128, 5), (3, 6, 13, 7, 33)];

/// Seeds per shape: even seeds start from a zero state, odd ones from a state of normals.
const DELTA_SEEDS: u64 = 4;

/// Row `t` of each of `parts` (each `(rows, width)`), joined, for every `t < m`: an op's separate
/// inputs as the rows `ops::ssm_scan`/`ops::delta_scan` read.
fn join_rows(m: usize, parts: &[(&[f64], usize)]) -> Vec<f64> {
    (0..m).flat_map(|t| parts.iter().flat_map(move |(rows, w)| rows[t * w..(t + 1) * w].iter().copied())).collect()
}

/// The block the case describes (its inputs' layout).
fn block(c: &OpCase) -> Result<SsmBlock> {
    let (nk, nv, dk, dv) = (c.pu("n_k_head")?, c.pu("n_v_head")?, c.pu("d_k")?, c.pu("d_v")?);
    Ok(SsmBlock { d_inner: nv * dv, d_state: dk, n_group: nk, n_head: nv, d_conv: 1, kind: SsmKind::GatedDelta })
}

pub(super) fn delta_rule_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for (nk, nv, dk, dv, m) in DELTA_SHAPES {
        for i in 0..DELTA_SEEDS {
            let seed = seed_of(base, i) ^ (nk * 1000 + nv * 100 + dk * 10 + dv + m * 7) as u64;
            let mut r = SplitMix64(seed ^ 0xDE17A);
            let q = normals(&mut r, m * nk * dk, 1.0);
            let k = normals(&mut r, m * nk * dk, 1.0);
            let val = normals(&mut r, m * nv * dv, 1.0);
            let b = normals(&mut r, m * nv, 1.5);
            let a = normals(&mut r, m * nv, 1.0);
            let dt_bias: Vec<f32> = normals(&mut r, nv, 0.5).into_iter().map(|x| x - 2.0).collect();
            // A = -exp(A_log), A_log uniform over [0, 2.77): decays from exp(-softplus) on.
            let neg_a: Vec<f32> = (0..nv).map(|_| -((r.next_f64() * 2.77).exp() as f32)).collect();
            let state = if i % 2 == 0 { vec![0.0; nv * dv * dk] } else { normals(&mut r, nv * dv * dk, 0.5) };
            v.push(case(
                Op::DeltaRule,
                format!("delta_rule(k_heads={nk},v_heads={nv},d_k={dk},d_v={dv},m={m},state={},seed={seed})", if i % 2 == 0 { "zero" } else { "given" }),
                seed,
                vec![
                    ("q", t(&[m, nk * dk], q)),
                    ("k", t(&[m, nk * dk], k)),
                    ("v", t(&[m, nv * dv], val)),
                    ("b", t(&[m, nv], b)),
                    ("a", t(&[m, nv], a)),
                    ("dt_bias", t(&[nv], dt_bias)),
                    ("neg_a", t(&[nv], neg_a)),
                    ("state", t(&[nv, dv, dk], state)),
                ],
                &[("n_k_head", nk as f64), ("n_v_head", nv as f64), ("d_k", dk as f64), ("d_v", dv as f64)],
            ));
        }
    }
    v
}

/// The delta rule in f64 from the case's inputs (`ops::delta_scan`): the outputs `[m, n_v_head *
/// d_v]` and the state after each position, `[m, n_v_head * d_v * d_k]`.
pub fn delta_rule_f64(c: &OpCase) -> Result<(Vec<f64>, Vec<f64>)> {
    let blk = block(c)?;
    let f = |n: &str| -> Result<Vec<f64>> { Ok(c.f32(n)?.data.iter().map(|x| *x as f64).collect()) };
    let (q, k, v) = (f("q")?, f("k")?, f("v")?);
    let m = c.f32("q")?.shape.first().copied().unwrap_or(0);
    let (kd, vd) = (blk.n_group * blk.d_state, blk.d_inner);
    let qkv = join_rows(m, &[(&q, kd), (&k, kd), (&v, vd)]);
    let mut state = f("state")?;
    let (b, a, dt_bias, neg_a) = (f("b")?, f("a")?, f("dt_bias")?, f("neg_a")?);
    let inputs = ops::DeltaInputs { qkv: &qkv, b: &b, a: &a, dt_bias: &dt_bias, neg_a: &neg_a };
    ops::delta_scan(&mut state, &inputs, m, &blk, true)
}

pub(super) fn delta_rule_ref(c: &OpCase) -> Result<Vec<Output>> {
    outputs(c, "q", delta_rule_f64(c)?)
}

/// About eight operations per state value a position (decay, update, read-out; the delta rule's
/// recall and correction).
pub(super) fn recurrence_flops(c: &OpCase) -> u64 {
    let m = c.inputs.first().and_then(|(n, _)| c.f32(n).ok()).map(|q| q.shape[0] as u64).unwrap_or(0);
    let n = c.f32("state").map(|s| s.data.len() as u64).unwrap_or(0);
    8 * m * n
}

/// (heads, groups, head width, state width, positions): one head; heads sharing groups; Mamba-2
/// 130M's head (64) and state (128); odd widths; 70 positions.
const SCAN_SHAPES: [(usize, usize, usize, usize, usize); 5] = [(1, 1, 4, 4, 1), (8, 2, 16, 16, 9), (8, 2, 16, 16, 70), (2, 1, 64, 128, 5), (6, 3, 7, 13, 33)];

fn scan_block(c: &OpCase) -> Result<SsmBlock> {
    let (nh, ng, hd, ds) = (c.pu("n_head")?, c.pu("n_group")?, c.pu("head_dim")?, c.pu("d_state")?);
    Ok(SsmBlock { d_inner: nh * hd, d_state: ds, n_group: ng, n_head: nh, d_conv: 1, kind: SsmKind::Mamba2 })
}

pub(super) fn ssm_scan_cases(base: u64) -> Vec<OpCase> {
    let mut v = Vec::new();
    for (nh, ng, hd, ds, m) in SCAN_SHAPES {
        for i in 0..DELTA_SEEDS {
            let seed = seed_of(base, i) ^ (nh * 1000 + ng * 100 + hd * 10 + ds + m * 7) as u64;
            let mut r = SplitMix64(seed ^ 0x55CA);
            let x = normals(&mut r, m * nh * hd, 1.0);
            let b = normals(&mut r, m * ng * ds, 1.0);
            let c = normals(&mut r, m * ng * ds, 1.0);
            let dt = normals(&mut r, m * nh, 1.0);
            let dt_bias: Vec<f32> = normals(&mut r, nh, 0.5).into_iter().map(|x| x - 2.0).collect();
            let neg_a: Vec<f32> = (0..nh).map(|_| -((r.next_f64() * 2.77).exp() as f32)).collect();
            let d: Vec<f32> = normals(&mut r, nh, 0.1).into_iter().map(|x| x + 1.0).collect();
            let state = if i % 2 == 0 { vec![0.0; nh * hd * ds] } else { normals(&mut r, nh * hd * ds, 0.5) };
            v.push(case(
                Op::SsmScan,
                format!("ssm_scan(heads={nh},groups={ng},head_dim={hd},d_state={ds},m={m},state={},seed={seed})", if i % 2 == 0 { "zero" } else { "given" }),
                seed,
                vec![
                    ("x", t(&[m, nh * hd], x)),
                    ("b", t(&[m, ng * ds], b)),
                    ("c", t(&[m, ng * ds], c)),
                    ("dt", t(&[m, nh], dt)),
                    ("dt_bias", t(&[nh], dt_bias)),
                    ("neg_a", t(&[nh], neg_a)),
                    ("d", t(&[nh], d)),
                    ("state", t(&[nh, hd, ds], state)),
                ],
                &[("n_head", nh as f64), ("n_group", ng as f64), ("head_dim", hd as f64), ("d_state", ds as f64)],
            ));
        }
    }
    v
}

/// Mamba-2's scan in f64 from the case's inputs (`ops::ssm_scan`): the outputs `[m, n_head *
/// head_dim]` and the state after each position, `[m, n_head * head_dim * d_state]`.
pub fn ssm_scan_f64(c: &OpCase) -> Result<(Vec<f64>, Vec<f64>)> {
    let blk = scan_block(c)?;
    let f = |n: &str| -> Result<Vec<f64>> { Ok(c.f32(n)?.data.iter().map(|x| *x as f64).collect()) };
    let (x, b, cc) = (f("x")?, f("b")?, f("c")?);
    let m = c.f32("x")?.shape.first().copied().unwrap_or(0);
    let (xd, bd) = (blk.d_inner, blk.n_group * blk.d_state);
    let xbc = join_rows(m, &[(&x, xd), (&b, bd), (&cc, bd)]);
    let mut state = f("state")?;
    let (dt, dt_bias, a, d) = (f("dt")?, f("dt_bias")?, f("neg_a")?, f("d")?);
    ops::ssm_scan(&mut state, &ops::ScanInputs { xbc: &xbc, dt: &dt, dt_bias: &dt_bias, a: &a, d: &d }, m, &blk, true)
}

/// The outputs and the last state, rounded to f32, of a scan's f64 result.
fn outputs(c: &OpCase, first: &str, (y, states): (Vec<f64>, Vec<f64>)) -> Result<Vec<Output>> {
    let s = c.f32("state")?;
    let last = states.len().saturating_sub(s.data.len());
    let m = c.f32(first)?.shape.first().copied().unwrap_or(0);
    let y32: Vec<f32> = y.iter().map(|x| *x as f32).collect();
    Ok(vec![out(&[m, y32.len() / m.max(1)], y32), out(&s.shape, states[last..].iter().map(|x| *x as f32).collect())])
}

pub(super) fn ssm_scan_ref(c: &OpCase) -> Result<Vec<Output>> {
    outputs(c, "x", ssm_scan_f64(c)?)
}
