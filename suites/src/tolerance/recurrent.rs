//! The bounds of a recurrence over positions (`delta_rule`, `ssm_scan`): each step's own
//! roundings, carried forward by the recurrence. Mamba-2's step scales each state element by
//! `exp(dt A) <= 1` (A negative, dt positive): the recursion runs per element. A gated DeltaNet's step maps the state's row (one value dimension
//! over the key width) by `decay (I - beta k k^T)`, whose 2-norm is at most 1 (decay <= 1, beta
//! in (0, 1), k L2-normed): an error in the state is never amplified, so the state's error after
//! a step is at most the decayed error before it plus the step's own. The bound runs that
//! recursion on the 2-norm of every row, from the oracle's f64 states, first-order as the other
//! derived bounds.

use super::{gamma, Bounds};
use oracle::registry::OpCase;

/// `1 / sqrt(sum x^2 + eps) * x`, its norm, in f64.
fn l2(x: &[f32]) -> Vec<f64> {
    let r = 1.0 / (x.iter().map(|v| *v as f64 * *v as f64).sum::<f64>() + oracle::ops::delta::L2_EPS).sqrt();
    x.iter().map(|v| *v as f64 * r).collect()
}

fn norm(x: &[f64]) -> f64 {
    x.iter().map(|v| v * v).sum::<f64>().sqrt()
}

/// Per-element bounds of the outputs `y` (`[m, n_v_head * d_v]`) and the final state. Per step
/// and state row: the normed q and k off by `eps_n` (their sums of squares over `d_k` in the
/// accumulator, the square root and the product), the decay by its exponential's argument
/// (rounded, through softplus and exp: `ulps`), beta by its sigmoid, the recall `S k` by a dot
/// product over `d_k`, the update and the store by a rounding each; the output reads the row
/// through q, a dot product over `d_k`, and rounds once.
pub(super) fn delta_rule_bounds(case: &OpCase, u: f64, ua: f64, ulps: f64) -> Bounds {
    let none = |why: &str| Bounds { per_output: vec![None, None], rule: why.into(), stored_inputs_reference: None };
    let Ok((y, states)) = oracle::registry::delta_rule_f64(case) else { return none("delta_rule: the reference does not run this case") };
    let p = |n: &str| case.pu(n).unwrap_or(0);
    let (nk, nv, dk, dv) = (p("n_k_head"), p("n_v_head"), p("d_k"), p("d_v"));
    let f = |n: &str| case.f32(n).map(|t| t.data.as_slice()).unwrap_or(&[]);
    let (q, k, v, b, a, dt_bias, neg_a, s0) = (f("q"), f("k"), f("v"), f("b"), f("a"), f("dt_bias"), f("neg_a"), f("state"));
    let sl = nv * dv * dk;
    let m = if sl == 0 { 0 } else { states.len() / sl };
    if nk == 0 || nv % nk != 0 || q.len() != m * nk * dk || v.len() != m * nv * dv || s0.len() != sl {
        return none("delta_rule: inputs of another shape than its parameters");
    }
    let per_key = nv / nk;
    let eps_n = (dk + 4) as f64 * ua + (ulps + 2.0) * u;
    let g_dot = gamma(dk + 2, ua);
    let mut yb = vec![0.0f64; y.len()];
    let mut sb = vec![0.0f64; sl];
    for h in 0..nv {
        let g = h / per_key;
        for row in 0..dv {
            let at = h * dv * dk + row * dk;
            let mut e = 0.0f64;
            for t in 0..m {
                let prev: Vec<f64> = if t == 0 { s0[at..at + dk].iter().map(|x| *x as f64).collect() } else { states[(t - 1) * sl + at..][..dk].to_vec() };
                let new = &states[t * sl + at..][..dk];
                let kn = l2(&k[(t * nk + g) * dk..][..dk]);
                let qn: Vec<f64> = l2(&q[(t * nk + g) * dk..][..dk]).into_iter().map(|x| x / (dk as f64).sqrt()).collect();
                let i = t * nv + h;
                let sp = (a[i] as f64 + dt_bias[h] as f64).exp().ln_1p();
                let arg = neg_a[h] as f64 * sp;
                let decay = arg.exp();
                let beta = 1.0 / (1.0 + (-(b[i] as f64)).exp());
                let vp = v[(t * nv + h) * dv + row] as f64;
                let (np, nn) = (norm(&prev), norm(new));
                let recall: f64 = prev.iter().zip(&kn).map(|(s, k)| decay * s * k).sum();
                let corr = beta * (vp - recall);
                let local = (ulps + 4.0) * u * (1.0 + arg.abs()) * decay * np
                    + eps_n * beta * (2.0 * decay * np + vp.abs())
                    + (ulps + 3.0) * u * corr.abs()
                    + beta * g_dot * decay * np
                    + 3.0 * u * (nn + decay * np)
                    + u * corr.abs();
                e = decay * e + local;
                let yi = t * nv * dv + h * dv + row;
                let read: f64 = new.iter().zip(&qn).map(|(s, q)| (s * q).abs()).sum();
                yb[yi] = e * norm(&qn) + nn * eps_n * norm(&qn) + g_dot * read + u * y[yi].abs() + f32::MIN_POSITIVE as f64;
            }
            let last = if m == 0 { &[][..] } else { &states[(m - 1) * sl + at..][..dk] };
            for (j, s) in last.iter().enumerate() {
                sb[at + j] = e + u * s.abs() + f32::MIN_POSITIVE as f64;
            }
        }
    }
    Bounds {
        per_output: vec![Some(yb), Some(sb)],
        rule: format!("per state row: e_t = decay*e_(t-1) + (ulps+4)u(1+|arg|)decay|S| + eps_n*beta*(2 decay|S|+|v|) + (ulps+4)u|corr| + beta*gamma(d_k+2)*decay|S| + 3u(|S'|+decay|S|); y: e|q| + eps_n|S'||q| + gamma(d_k+2)*sum|S'q| + u|y|, eps_n=(d_k+4)ua+(ulps+2)u, d_k={dk}"),
        stored_inputs_reference: None,
    }
}

/// Per-element bounds of Mamba-2's scan outputs (`[m, n_head * head_dim]`) and final state. Per
/// step and state element: the time step off by its softplus (`ulps`, the bias's add), the decay
/// by its argument's error times the argument plus its exponential, the input term `dt x B` by
/// dt's error and two products, the add and the store by a rounding each; the output reads the
/// head's row through C, a dot product over `d_state`, plus `D x`, and rounds once.
pub(super) fn ssm_scan_bounds(case: &OpCase, u: f64, ua: f64, ulps: f64) -> Bounds {
    let none = |why: &str| Bounds { per_output: vec![None, None], rule: why.into(), stored_inputs_reference: None };
    let Ok((y, states)) = oracle::registry::ssm_scan_f64(case) else { return none("ssm_scan: the reference does not run this case") };
    let p = |n: &str| case.pu(n).unwrap_or(0);
    let (nh, ng, hd, ds) = (p("n_head"), p("n_group"), p("head_dim"), p("d_state"));
    let f = |n: &str| case.f32(n).map(|t| t.data.as_slice()).unwrap_or(&[]);
    let (x, b, c, dt, dt_bias, neg_a, d, s0) = (f("x"), f("b"), f("c"), f("dt"), f("dt_bias"), f("neg_a"), f("d"), f("state"));
    let sl = nh * hd * ds;
    let m = if sl == 0 { 0 } else { states.len() / sl };
    if ng == 0 || nh % ng != 0 || x.len() != m * nh * hd || b.len() != m * ng * ds || s0.len() != sl {
        return none("ssm_scan: inputs of another shape than its parameters");
    }
    let per_group = nh / ng;
    let d_dt = (ulps + 3.0) * u;
    let g_dot = gamma(ds + 2, ua);
    let mut yb = vec![0.0f64; y.len()];
    let mut sb = vec![0.0f64; sl];
    for h in 0..nh {
        let g = h / per_group;
        for row in 0..hd {
            let at = h * hd * ds + row * ds;
            let mut e = vec![0.0f64; ds];
            for t in 0..m {
                let step = (dt[t * nh + h] as f64 + dt_bias[h] as f64).exp().ln_1p();
                let arg = step * neg_a[h] as f64;
                let decay = arg.exp();
                let d_decay = arg.abs() * (d_dt + u) + (ulps + 1.0) * u;
                let xp = x[(t * nh + h) * hd + row] as f64;
                let (bg, cg) = (&b[(t * ng + g) * ds..][..ds], &c[(t * ng + g) * ds..][..ds]);
                let mut read = 0.0f64;
                let mut carried = 0.0f64;
                for n in 0..ds {
                    let prev = if t == 0 { s0[at + n] as f64 } else { states[(t - 1) * sl + at + n] };
                    let new = states[t * sl + at + n];
                    let term = step * xp * bg[n] as f64;
                    e[n] = decay * e[n] + d_decay * decay * prev.abs() + (d_dt + 2.0 * u) * term.abs() + 2.0 * u * new.abs();
                    read += (new * cg[n] as f64).abs();
                    carried += e[n] * (cg[n] as f64).abs();
                }
                let yi = t * nh * hd + h * hd + row;
                yb[yi] = carried + g_dot * (read + (d[h] as f64 * xp).abs()) + u * y[yi].abs() + f32::MIN_POSITIVE as f64;
            }
            for n in 0..ds {
                let last = if m == 0 { 0.0 } else { states[(m - 1) * sl + at + n] };
                sb[at + n] = e[n] + u * last.abs() + f32::MIN_POSITIVE as f64;
            }
        }
    }
    Bounds {
        per_output: vec![Some(yb), Some(sb)],
        rule: format!("per state element: e_t = decay*e_(t-1) + (|arg|(d_dt+u)+(ulps+1)u)*decay|S| + (d_dt+2u)|dt x B| + 2u|S'|, d_dt=(ulps+3)u; y: sum e|C| + gamma(d_state+2)*(sum|S'C| + |D x|) + u|y|, d_state={ds}"),
        stored_inputs_reference: None,
    }
}
