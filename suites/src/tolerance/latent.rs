//! The bound of latent attention (`mla_attention`), for any order of its sums: the absorbed form
//! (queries into the latent's space, the weighted latents out through the value rows) and the
//! materialized one (keys and values expanded first) evaluate the same double sums in other
//! groupings. A score is `scale (sum_c q_c sum_r W_cr l_r + q_rope . k_pe)`: each of its
//! `nope * r` terms passes through at most `nope + r + 3` roundings in any grouping (the
//! products, the two levels of sums, a stored intermediate: `q W` or `W l`), so its error is at
//! most `(gamma(nope + r + 3) + 2u) scale sum |q_c W_cr l_r|`, plus the rotated dot's. An output
//! is `sum_j p_j sum_r V_ir l_jr`: each term through at most `L + r + 3` roundings (the weighted
//! latents summed over the `L` keys, or the values expanded, then the other sum), plus the
//! weights' error from the scores' as for attention (docs/ACCURACY.md).

use super::{gamma, Bounds};
use oracle::registry::OpCase;

pub(super) fn mla_attention_bounds(case: &OpCase, yy: &[f64], u: f64, ua: f64, ulps: f64) -> Bounds {
    let rule = "score err (gamma(nope+r+3)+2u)*scale*sum|q W l| + gamma(rope+2)*scale*sum|q_r k_pe|; output sum_j p_j*(|v_j|*eta_j + (gamma(L+r+3)+2u)*sum_r|V l_j|) + u|y|";
    let none = |why: String| Bounds { per_output: vec![None], rule: why, stored_inputs_reference: None };
    let Ok(b) = oracle::registry::mla_block(case) else { return none("mla_attention: the case's dimensions are missing".into()) };
    let (Ok(q), Ok(lat), Ok(kpe), Ok(kvb), Ok(pos), Ok(scale)) = (case.f32("q"), case.f32("latent"), case.f32("k_pe"), case.f32("kv_b"), case.ids("pos"), case.p("scale")) else {
        return none("mla_attention: an input is missing".into());
    };
    let (nh, nope, rr, r, vd) = (b.n_head, b.qk_nope, b.qk_rope, b.kv_lora_rank, b.v_head_dim);
    let hd = nope + rr;
    let kv_len = lat.shape.first().copied().unwrap_or(0);
    if q.data.len() != pos.len() * nh * hd || lat.data.len() != kv_len * r || kpe.data.len() != kv_len * rr || kvb.data.len() != nh * (nope + vd) * r || yy.len() != pos.len() * nh * vd || pos.iter().any(|&p| p as usize >= kv_len) {
        return none("mla_attention: the inputs' shapes do not fit the case's dimensions".into());
    }
    let f = |x: f32| x as f64;
    let mut bound = vec![0.0; yy.len()];
    for (t, &p) in pos.iter().enumerate() {
        let keys = p as usize + 1;
        for h in 0..nh {
            let qh = &q.data[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            let rows = &kvb.data[h * (nope + vd) * r..(h + 1) * (nope + vd) * r];
            let (wk, wv) = rows.split_at(nope * r);
            // |q W| per latent dimension, then each key's score, its error and the absolute sums.
            let (mut qw, mut qw_abs) = (vec![0.0f64; r], vec![0.0f64; r]);
            for c in 0..nope {
                for j in 0..r {
                    qw[j] += f(qh[c]) * f(wk[c * r + j]);
                    qw_abs[j] += (f(qh[c]) * f(wk[c * r + j])).abs();
                }
            }
            let (mut s, mut s_err) = (Vec::with_capacity(keys), Vec::with_capacity(keys));
            for j in 0..keys {
                let l = &lat.data[j * r..(j + 1) * r];
                let k = &kpe.data[j * rr..(j + 1) * rr];
                let lat_dot: f64 = qw.iter().zip(l).map(|(a, b)| a * f(*b)).sum();
                let lat_abs: f64 = qw_abs.iter().zip(l).map(|(a, b)| a * f(*b).abs()).sum();
                let rot_dot: f64 = qh[nope..].iter().zip(k).map(|(a, b)| f(*a) * f(*b)).sum();
                let rot_abs: f64 = qh[nope..].iter().zip(k).map(|(a, b)| (f(*a) * f(*b)).abs()).sum();
                s.push(scale * (lat_dot + rot_dot));
                s_err.push(scale.abs() * ((gamma(nope + r + 3, ua) + 2.0 * u) * lat_abs + gamma(rr + 2, ua) * rot_abs));
            }
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
            let z: f64 = e.iter().sum();
            let max_err = s_err.iter().copied().fold(0.0, f64::max);
            for i in 0..vd {
                let row = &wv[i * r..(i + 1) * r];
                let mut acc = 0.0;
                for j in 0..keys {
                    let l = &lat.data[j * r..(j + 1) * r];
                    let v: f64 = row.iter().zip(l).map(|(a, b)| f(*a) * f(*b)).sum();
                    let v_abs: f64 = row.iter().zip(l).map(|(a, b)| (f(*a) * f(*b)).abs()).sum();
                    let eta = 2.0 * max_err + u * (s[j] - max).abs() + gamma(keys + 4, ua) + ulps * u;
                    acc += e[j] / z * (v.abs() * eta + (gamma(keys + r + 3, ua) + 2.0 * u) * v_abs);
                }
                let o = (t * nh + h) * vd + i;
                bound[o] = acc + u * yy[o].abs() + f32::MIN_POSITIVE as f64;
            }
        }
    }
    Bounds { per_output: vec![Some(bound)], rule: rule.into(), stored_inputs_reference: None }
}
