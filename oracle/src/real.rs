//! The storage scalar of the oracle. The interpreter and every op are generic over `Real`, so the
//! same code runs with f32 storage (the normal judge) and with f64 storage (`--precision f64`, which
//! measures the oracle's own rounding error). Reductions always accumulate in f64 in one fixed
//! order (see `dot`), so results are bit-identical for any thread count and any machine.

pub use crate::simd::{reduce_lanes, DOT_LANES};

/// A storage scalar: f32 or f64.
pub trait Real: Copy + Send + Sync + Default + PartialOrd + std::fmt::Debug + 'static {
    const NAME: &'static str;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn from_f32(v: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Dot product accumulated in f64 in the fixed lane order described at `DOT_LANES`.
    fn dot(a: &[Self], b: &[Self]) -> f64;
    /// `dot(x, w)` with `x` already widened to f64 (bit-identical to `dot`).
    fn dot_wide(x: &[f64], w: &[Self]) -> f64;
    /// Four `dot_wide` sharing one weight row.
    fn dot4_wide(xs: [&[f64]; 4], w: &[Self]) -> [f64; 4] {
        xs.map(|x| Self::dot_wide(x, w))
    }
    /// `f` (a row decoded to f32) as values of `Self`: `f` itself for f32, else widened into `v`.
    fn from_f32_row<'a>(f: &'a [f32], v: &'a mut Vec<Self>) -> &'a [Self] {
        v.clear();
        v.extend(f.iter().map(|&x| Self::from_f32(x)));
        v
    }
}

impl Real for f32 {
    const NAME: &'static str = "f32";
    #[inline]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline]
    fn dot(a: &[f32], b: &[f32]) -> f64 {
        crate::simd::dot_f32(a, b)
    }
    #[inline]
    fn dot_wide(x: &[f64], w: &[f32]) -> f64 {
        crate::simd::dot_f64_f32(x, w)
    }
    #[inline]
    fn dot4_wide(xs: [&[f64]; 4], w: &[f32]) -> [f64; 4] {
        crate::simd::dot4_f64_f32(xs, w)
    }
    #[inline]
    fn from_f32_row<'a>(f: &'a [f32], _: &'a mut Vec<f32>) -> &'a [f32] {
        f
    }
}

impl Real for f64 {
    const NAME: &'static str = "f64";
    #[inline]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn from_f32(v: f32) -> Self {
        v as f64
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[inline]
    fn dot(a: &[f64], b: &[f64]) -> f64 {
        crate::simd::dot_lanes_portable(a, b, |x| x)
    }
    #[inline]
    fn dot_wide(x: &[f64], w: &[f64]) -> f64 {
        crate::simd::dot_lanes_portable(x, w, |v| v)
    }
}

/// Sum of a sequence of f64 values in the same fixed lane order as `dot` (used for norms, means).
pub fn sum_f64_lanes(values: impl Iterator<Item = f64>) -> f64 {
    let mut lanes = [0.0f64; DOT_LANES];
    for (i, v) in values.enumerate() {
        lanes[i % DOT_LANES] += v;
    }
    reduce_lanes(lanes)
}
