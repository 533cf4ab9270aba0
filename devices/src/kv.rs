//! KV cache formats a device may declare (`cpu:kv-*`, llama.cpp's cache types) and the
//! Walsh-Hadamard rotation a rotating block-quantized cache applies.

use crate::NumFormat;

/// The format a KV cache holds its keys and values in (`Arithmetic::kv_cache`, the `cpu:kv-*`
/// devices): the GGML types llama.cpp's `--cache-type-k/-v` take that this tool decodes — a float
/// format, or each cached row quantized to blocks of 32 (so a head of a multiple of 32 values is
/// whole blocks). Written as the type's name (`"f16"`, `"q8_0"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct KvFormat(oracle::quant::GgmlType);

impl KvFormat {
    /// The formats a cache may be declared in.
    const TYPES: [oracle::quant::GgmlType; 9] = {
        use oracle::quant::GgmlType::*;
        [F32, F16, BF16, Q8_0, Q5_1, Q5_0, Q4_1, Q4_0, IQ4_NL]
    };
    /// F32: a cache that holds what an f32 engine computes.
    pub const F32: KvFormat = KvFormat(oracle::quant::GgmlType::F32);
    /// Q8_0: the format a block-quantized cache's keys take the query in.
    pub const Q8_0: KvFormat = KvFormat(oracle::quant::GgmlType::Q8_0);

    /// The formats a cache may be declared in, as written (`f32, f16, ...`).
    pub fn names() -> String {
        KvFormat::TYPES.map(|t| t.name()).join(", ")
    }

    /// The format of this name, or None when a cache cannot be declared in it.
    pub fn parse(name: &str) -> Option<KvFormat> {
        oracle::quant::GgmlType::from_name(name).filter(|t| KvFormat::TYPES.contains(t)).map(KvFormat)
    }
    pub fn ty(self) -> oracle::quant::GgmlType {
        self.0
    }
    pub fn name(self) -> &'static str {
        self.0.name()
    }
    /// The float format of a float cache; None for a block-quantized one.
    pub fn float(self) -> Option<NumFormat> {
        use oracle::quant::GgmlType::{BF16, F16, F32};
        match self.0 {
            F32 => Some(NumFormat::F32),
            F16 => Some(NumFormat::F16),
            BF16 => Some(NumFormat::BF16),
            _ => None,
        }
    }
    /// Values per block of a block-quantized cache (its rows must hold whole blocks per head).
    pub fn block(self) -> Option<usize> {
        self.float().is_none().then(|| self.0.block_size())
    }
    /// The relative size of one cached value's rounding, as the budgets take a unit roundoff:
    /// a float format's unit roundoff; for a block format, the RMS rounding error of a block
    /// (half its step, about, the step a fraction of the block's largest value: 1/127 for
    /// Q8_0, 1/8 for Q4_0 and 1/16 for Q5_0, whose scales are max/-8 and max/-16, at most
    /// 2/15 and 2/31 of it for Q4_1 and Q5_1, whose steps span max - min, and 28/127 for
    /// IQ4_NL's uneven levels) over the block's RMS value (at least max/sqrt(B)).
    pub fn rel_rounding(self) -> f64 {
        use oracle::quant::GgmlType::*;
        let step = match self.0 {
            Q8_0 => 1.0 / 127.0,
            Q5_1 => 2.0 / 31.0,
            Q5_0 => 1.0 / 16.0,
            Q4_1 => 2.0 / 15.0,
            Q4_0 => 1.0 / 8.0,
            // Its levels span -127..113 steps of max/127: half the widest gap is 12 steps, the
            // clamped end 14.
            IQ4_NL => 28.0 / 127.0,
            _ => return self.float().map_or(0.0, NumFormat::unit_roundoff),
        };
        (self.0.block_size() as f64).sqrt() * step / 2.0
    }
    /// `rows` (each `width` values, a whole number of blocks) as the cache gives them back:
    /// encoded to the format and decoded, as ggml stores a row and reads it, with the oracle's
    /// codec (this is the judge's emulation of a cache; the `cpu` device has its own,
    /// `cpu::kvcodec`). None when `width` is not a whole number of blocks.
    pub fn round_rows(self, rows: &mut [f32], width: usize) -> Option<()> {
        if width == 0 || !width.is_multiple_of(self.0.block_size()) || !rows.len().is_multiple_of(width) {
            return None;
        }
        let bytes = oracle::quant::encode(self.0, rows).ok()?;
        oracle::quant::decode_into(self.0, &bytes, rows).ok()
    }
}

/// The formats a KV cache holds its keys and values in, each None where it holds them as
/// computed (llama.cpp's `--cache-type-k` and `--cache-type-v`). Written `q8_0` when both are
/// one format, `q8_0-f16` (keys, values) when they differ: the `cpu:kv-*` devices' suffix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvTypes {
    pub k: Option<KvFormat>,
    pub v: Option<KvFormat>,
}

impl KvTypes {
    /// Keys and values in one format.
    pub fn both(f: KvFormat) -> KvTypes {
        KvTypes { k: Some(f), v: Some(f) }
    }
    /// `TYPE` (keys and values) or `K-V`; None when either is not a cache format.
    pub fn parse(s: &str) -> Option<KvTypes> {
        match s.split_once('-') {
            None => KvFormat::parse(s).map(KvTypes::both),
            Some((k, v)) => Some(KvTypes { k: Some(KvFormat::parse(k)?), v: Some(KvFormat::parse(v)?) }),
        }
    }
    /// Neither keys nor values rounded by the cache (unset, or f32).
    pub fn is_none(&self) -> bool {
        [self.k, self.v].iter().all(|f| f.is_none_or(|f| f == KvFormat::F32))
    }
    /// The formats set: the keys', then the values' where it differs.
    pub fn formats(&self) -> impl Iterator<Item = KvFormat> {
        let v = self.v.filter(|v| Some(*v) != self.k);
        self.k.into_iter().chain(v)
    }
}

impl std::fmt::Display for KvTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (k, v) = (self.k.unwrap_or(KvFormat::F32), self.v.unwrap_or(KvFormat::F32));
        if k == v {
            write!(f, "{k}")
        } else {
            write!(f, "{k}-{v}")
        }
    }
}

/// The widths of the Walsh-Hadamard rotations a rotating block-quantized cache applies to a
/// head of `head_dim` values (`Arithmetic::kv_cache_rotation`): (keys and query, values); None
/// when such heads are not rotated (not a multiple of 64 wide).
pub fn kv_rotation_widths(head_dim: usize) -> Option<(usize, usize)> {
    if head_dim == 0 || !head_dim.is_multiple_of(64) {
        return None;
    }
    Some((1 << head_dim.trailing_zeros(), 64))
}

/// Rotates each run of `n` values of `x` (a power of two) by the orthonormal Walsh-Hadamard
/// matrix of that size in Sylvester order (H[i][j] = (-1)^popcount(i & j) / sqrt(n), its own
/// inverse), in f64, rounded back to f32 once.
pub fn hadamard_rotate(x: &mut [f32], n: usize) {
    if n < 2 || !n.is_power_of_two() {
        return;
    }
    let scale = 1.0 / (n as f64).sqrt();
    let mut buf = vec![0f64; n];
    for chunk in x.chunks_exact_mut(n) {
        buf.iter_mut().zip(chunk.iter()).for_each(|(b, v)| *b = *v as f64);
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (buf[j], buf[j + h]);
                    buf[j] = a + b;
                    buf[j + h] = a - b;
                }
            }
            h *= 2;
        }
        chunk.iter_mut().zip(buf.iter()).for_each(|(v, b)| *v = (b * scale) as f32);
    }
}

impl TryFrom<String> for KvFormat {
    type Error = String;
    fn try_from(s: String) -> Result<KvFormat, String> {
        KvFormat::parse(&s).ok_or_else(|| format!("kv_cache \"{s}\" is not a cache format this tool reads ({})", KvFormat::names()))
    }
}

impl From<KvFormat> for String {
    fn from(f: KvFormat) -> String {
        f.name().to_string()
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
