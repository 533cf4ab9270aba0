//! The cpu device's KV cache: per layer, keys and values in the cache format the device declares
//! (f32, f16, or encoded rows of a block format), held in pages.
//!
//! A cache holds its rows in pages of `1 << shift` positions. The one-sequence cache a model
//! keeps is one page that grows (`KvCache::new`); the caches of the schedule executor
//! (`KvCache::paged`) hold [`PAGE_POSITIONS`]-position pages, reference-counted, so a reused
//! prefix shares its source's full pages instead of copying them (a page is copied only when one
//! of its holders writes into it: the partial page a prefix ends in). Attention reads rows where
//! they lie (`kernels::attention_paged`): which page a row sits in changes no value.

use super::kernels;
use oracle::quant::GgmlType;
use oracle::spec::{BlockKind, ModelSpec};
use std::sync::Arc;

/// Positions per page of the schedule executor's caches.
pub const PAGE_POSITIONS: usize = 16;

/// Every layer's state, in the formats the device declares, and the positions it holds.
#[derive(Clone)]
pub(crate) struct KvCache {
    layers: Vec<LayerState>,
    /// Positions held.
    len: usize,
}

/// A state-space layer's convolution history, state, position and kept history, borrowed.
pub(crate) type SsmParts<'a> = (&'a mut Vec<f32>, &'a mut Vec<f32>, &'a mut usize, Option<&'a mut SsmHistory>);

/// What one layer keeps between calls, by the kind of its block.
#[derive(Clone)]
enum LayerState {
    /// Keys and values, each in its own format: f32, f16 (`cpu:kv-f16`), which holds the same
    /// rounded numbers in half the memory, or any other cache format (`cpu:kv-q8_0`,
    /// `cpu:kv-q8_0-f16`, ...) as encoded rows, decoded as attention reads them.
    Kv { k: Side, v: Side },
    /// A state-space layer's last `d_conv - 1` convolution inputs and its recurrent state, as of
    /// position `at` (f32, as computed); a schedule executor's cache also keeps their history, so
    /// that a prefix of any length can be restored.
    Ssm { conv: Vec<f32>, state: Vec<f32>, at: usize, history: Option<SsmHistory> },
}

/// A state-space layer's convolution input and recurrent state after every position it has
/// computed (rows of `conv_dim` and of `state_len`): what restoring a prefix of `n` positions
/// needs (the last `d_conv - 1` inputs before `n`, the state after position `n - 1`), as an
/// engine that caches prefixes of a recurrent model keeps states at the positions it may reuse.
#[derive(Clone, Default)]
pub(crate) struct SsmHistory {
    pub(crate) inputs: Vec<f32>,
    pub(crate) states: Vec<f32>,
}

/// One side of a layer's cache (keys or values): its rows, page after page.
#[derive(Clone)]
struct Side {
    format: Option<crate::KvFormat>,
    pages: Vec<Arc<CacheRows>>,
    /// Rows per page: `1 << shift`.
    shift: u32,
}

/// One page of a side: `[rows, width]` in its format.
#[derive(Clone)]
enum CacheRows {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    Encoded(crate::KvFormat, Vec<u8>),
}

/// A side's pages as attention reads them: f32 (held so, or decoded from blocks) or f16, widened
/// by attention itself.
enum Held<'a> {
    F32(Vec<std::borrow::Cow<'a, [f32]>>),
    F16(Vec<&'a [half::f16]>),
}

impl CacheRows {
    fn new(format: Option<crate::KvFormat>) -> CacheRows {
        match format.map(|f| (f, f.ty())) {
            None | Some((_, GgmlType::F32)) => CacheRows::F32(Vec::new()),
            Some((_, GgmlType::F16)) => CacheRows::F16(Vec::new()),
            Some((f, _)) => CacheRows::Encoded(f, Vec::new()),
        }
    }
    /// Bytes (or values) of one row of `width` values.
    fn row_units(&self, width: usize) -> Result<usize, String> {
        match self {
            CacheRows::F32(_) | CacheRows::F16(_) => Ok(width),
            CacheRows::Encoded(f, _) => f.ty().bytes_for(width as u64).map(|b| b as usize).ok_or_else(|| format!("{f} KV cache: rows of {width} values are not whole blocks")),
        }
    }
    /// Rows of `width` values held.
    fn rows(&self, width: usize) -> usize {
        let units = self.row_units(width).unwrap_or(0).max(1);
        match self {
            CacheRows::F32(c) => c.len() / units,
            CacheRows::F16(c) => c.len() / units,
            CacheRows::Encoded(_, c) => c.len() / units,
        }
    }
    /// Keeps the first `n` rows of `width` values.
    fn truncate(&mut self, n: usize, width: usize) -> Result<(), String> {
        let keep = n.saturating_mul(self.row_units(width)?);
        match self {
            CacheRows::F32(c) => c.truncate(keep),
            CacheRows::F16(c) => c.truncate(keep),
            CacheRows::Encoded(_, c) => c.truncate(keep),
        }
        Ok(())
    }
    /// Appends `x` (rows of `width` values), rounded as this page's format holds them.
    fn append(&mut self, width: usize, x: &[f32]) -> Result<(), String> {
        match self {
            CacheRows::F32(c) => c.extend_from_slice(x),
            CacheRows::F16(c) => c.extend(x.iter().map(|v| half::f16::from_f32(*v))),
            CacheRows::Encoded(f, c) => {
                let ty = f.ty();
                ty.bytes_for(width as u64).ok_or_else(|| format!("{f} KV cache: rows of {width} values are not whole blocks"))?;
                c.extend(super::kvcodec::encode(ty, x).map_err(|e| format!("{f} KV cache: {e}"))?);
            }
        }
        Ok(())
    }
}

impl Side {
    fn new(format: Option<crate::KvFormat>, shift: u32) -> Side {
        Side { format, pages: Vec::new(), shift }
    }
    fn per_page(&self) -> usize {
        1usize << self.shift
    }
    /// Rows of `width` held (pages are full but the last).
    fn rows(&self, width: usize) -> usize {
        match self.pages.last() {
            None => 0,
            Some(last) => (self.pages.len() - 1) * self.per_page() + last.rows(width),
        }
    }
    /// The first `n` rows (a reused prefix): the full pages shared, the partial last one copied;
    /// None when it holds fewer.
    fn first_rows(&self, n: usize, width: usize) -> Option<Side> {
        if self.rows(width) < n {
            return None;
        }
        let (full, rest) = (n >> self.shift, n & (self.per_page() - 1));
        let mut pages: Vec<Arc<CacheRows>> = self.pages[..full].to_vec();
        if rest > 0 {
            let mut last = (*self.pages[full]).clone();
            last.truncate(rest, width).ok()?;
            pages.push(Arc::new(last));
        }
        Some(Side { format: self.format, pages, shift: self.shift })
    }
    /// Replaces the rows from `start` on with `x` (rows of `width` values), rounded as this
    /// side's format holds them. A page another cache shares is copied before it is written.
    fn write(&mut self, start: usize, width: usize, x: &[f32]) -> Result<(), String> {
        if width == 0 || x.len() % width != 0 || self.rows(width) < start {
            return Err(format!("KV cache: {} values written at row {start} of {} held, rows of {width}", x.len(), self.rows(width)));
        }
        let per_page = self.per_page();
        self.pages.truncate(start.div_ceil(per_page));
        let (mut rest, mut row) = (x, start);
        while !rest.is_empty() {
            let (page, at) = (row >> self.shift, row & (per_page - 1));
            if page == self.pages.len() {
                self.pages.push(Arc::new(CacheRows::new(self.format)));
            }
            let take = (per_page - at).min(rest.len() / width);
            let rows = Arc::make_mut(&mut self.pages[page]);
            rows.truncate(at, width)?;
            rows.append(width, &rest[..take * width])?;
            rest = &rest[take * width..];
            row += take;
        }
        if x.is_empty() && start % per_page != 0 {
            Arc::make_mut(&mut self.pages[start >> self.shift]).truncate(start % per_page, width)?;
        }
        Ok(())
    }
    /// The first `rows` rows of `width` values, page by page, as attention reads them.
    fn read(&self, rows: usize, width: usize) -> Result<Held<'_>, String> {
        let per_page = self.per_page();
        let pages = self.pages.iter().take(rows.div_ceil(per_page.max(1)));
        let mut f32s = Vec::new();
        let mut f16s = Vec::new();
        for (i, p) in pages.enumerate() {
            let n = (rows - i * per_page).min(per_page) * width;
            match &**p {
                CacheRows::F32(c) => f32s.push(std::borrow::Cow::Borrowed(c.get(..n).ok_or("KV cache: a page holds fewer rows than attended to")?)),
                CacheRows::F16(c) => f16s.push(c.get(..n).ok_or("KV cache: a page holds fewer rows than attended to")?),
                CacheRows::Encoded(f, c) => {
                    let bytes = f.ty().bytes_for(n as u64).filter(|b| *b as usize <= c.len()).ok_or_else(|| format!("{f} KV cache: {n} values are not whole blocks of what it holds"))?;
                    let mut out = vec![0.0f32; n];
                    super::kvcodec::decode(f.ty(), &c[..bytes as usize], &mut out);
                    f32s.push(std::borrow::Cow::Owned(out));
                }
            }
        }
        Ok(if f16s.is_empty() { Held::F32(f32s) } else { Held::F16(f16s) })
    }
    fn encoded(&self) -> Option<crate::KvFormat> {
        self.format.filter(|f| !matches!(f.ty(), GgmlType::F32 | GgmlType::F16))
    }
}

impl KvCache {
    /// The one-sequence cache: one page that grows.
    pub(crate) fn new(format: crate::KvTypes, spec: &ModelSpec) -> KvCache {
        Self::with_shift(format, spec, usize::BITS - 1)
    }
    /// A schedule executor's cache: pages of [`PAGE_POSITIONS`] positions.
    pub(crate) fn paged(format: crate::KvTypes, spec: &ModelSpec) -> KvCache {
        Self::with_shift(format, spec, PAGE_POSITIONS.trailing_zeros())
    }
    fn with_shift(format: crate::KvTypes, spec: &ModelSpec, shift: u32) -> KvCache {
        // Paged caches serve schedules, whose requests reuse prefixes: they keep the history.
        let paged = shift < usize::BITS - 1;
        let layers = spec.layer_states(
            |_| LayerState::Kv { k: Side::new(format.k, shift), v: Side::new(format.v, shift) },
            |b| LayerState::Ssm { conv: vec![0.0; (b.d_conv - 1) * b.conv_dim()], state: vec![0.0; b.state_len()], at: 0, history: paged.then(SsmHistory::default) },
            // A latent-attention layer caches its latent on the key side, its shared rotated key
            // on the value side.
            |_| LayerState::Kv { k: Side::new(format.k, shift), v: Side::new(format.v, shift) },
        );
        KvCache { layers, len: 0 }
    }
    /// An empty placeholder (no layers).
    pub(crate) fn none() -> KvCache {
        KvCache { layers: Vec::new(), len: 0 }
    }
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    /// A cache holding this one's first `n` positions (a prefix another request reuses), or None
    /// when it holds fewer.
    pub(crate) fn prefix(&self, n: usize, spec: &ModelSpec) -> Option<KvCache> {
        if n > self.len {
            return None;
        }
        let mut layers = Vec::with_capacity(self.layers.len());
        for (li, l) in self.layers.iter().enumerate() {
            layers.push(match (spec.layers.get(li)?.block, l) {
                (BlockKind::Attention(a), LayerState::Kv { k, v }) => LayerState::Kv { k: k.first_rows(n, a.kv_dim())?, v: v.first_rows(n, a.kv_dim())? },
                // Latents on the key side, shared rotated keys on the value side.
                (BlockKind::Mla(b), LayerState::Kv { k, v }) => LayerState::Kv { k: k.first_rows(n, b.kv_lora_rank)?, v: v.first_rows(n, b.qk_rope)? },
                // A recurrent state is as of one position: the whole of it is a prefix, and an
                // earlier position's is restored from the history where it is kept.
                (_, s @ LayerState::Ssm { at, .. }) if *at == n => s.clone(),
                (BlockKind::Ssm(b), LayerState::Ssm { at, history: Some(h), .. }) if n < *at => {
                    let (cd, sl, keep) = (b.conv_dim(), b.state_len(), b.d_conv - 1);
                    let mut conv = vec![0.0; keep * cd];
                    // The inputs of positions n - keep .. n, zeros before position 0.
                    for (r, p) in (n as isize - keep as isize..n as isize).enumerate().filter(|(_, p)| *p >= 0) {
                        conv[r * cd..(r + 1) * cd].copy_from_slice(h.inputs.get(p as usize * cd..(p as usize + 1) * cd)?);
                    }
                    let state = if n == 0 { vec![0.0; sl] } else { h.states.get((n - 1) * sl..n * sl)?.to_vec() };
                    let history = SsmHistory { inputs: h.inputs.get(..n * cd)?.to_vec(), states: h.states.get(..n * sl)?.to_vec() };
                    LayerState::Ssm { conv, state, at: n, history: Some(history) }
                }
                _ => return None,
            });
        }
        Some(KvCache { layers, len: n })
    }
    pub(crate) fn set_len(&mut self, n: usize) {
        self.len = n;
    }
    pub(crate) fn reset(&mut self) {
        for l in &mut self.layers {
            match l {
                LayerState::Kv { k, v } => {
                    k.pages.clear();
                    v.pages.clear();
                }
                LayerState::Ssm { conv, state, at, history } => {
                    conv.fill(0.0);
                    state.fill(0.0);
                    *at = 0;
                    if let Some(h) = history {
                        *h = SsmHistory::default();
                    }
                }
            }
        }
        self.len = 0;
    }
    /// Layer `li`'s convolution history, recurrent state, the position they are as of, and the
    /// history of both where this cache keeps it.
    pub(crate) fn ssm_state(&mut self, li: usize) -> Result<SsmParts<'_>, String> {
        match self.layers.get_mut(li) {
            Some(LayerState::Ssm { conv, state, at, history }) => Ok((conv, state, at, history.as_mut())),
            _ => Err(format!("layer {li} keeps no state-space state")),
        }
    }

    /// Every state-space layer's state and convolution history back to zeros, their position
    /// kept: a prefix whose recurrent state was not restored (a seeded serving bug's only).
    pub(crate) fn forget_ssm_states(&mut self) {
        for l in &mut self.layers {
            if let LayerState::Ssm { conv, state, .. } = l {
                conv.fill(0.0);
                state.fill(0.0);
            }
        }
    }

    /// Appends layer `li`'s keys and values for positions `start..` (rows of `width`, rounded as
    /// the cache's formats hold them) and runs attention over the cache. Keys in a block format
    /// meet the query as Q8_0 blocks of 32, as ggml multiplies them.
    /// Writes a latent-attention layer's latents (`[n, kv_lora_rank]`, on the key side) and
    /// shared rotated keys (`[n, qk_rope]`, on the value side) at `start..`, and returns the
    /// first `start + n` rows of each as f32.
    pub(crate) fn write_and_read_latent(&mut self, li: usize, start: usize, (latent, k_pe): (&[f32], &[f32]), (r, rope): (usize, usize)) -> Result<(Vec<f32>, Vec<f32>), String> {
        let Some(LayerState::Kv { k, v }) = self.layers.get_mut(li) else {
            return Err(format!("layer {li} keeps no latents"));
        };
        k.write(start, r, latent)?;
        v.write(start, rope, k_pe)?;
        let len = start + latent.len() / r.max(1);
        fn flat(h: Held<'_>) -> Vec<f32> {
            match h {
                Held::F32(p) => p.concat(),
                Held::F16(p) => p.iter().flat_map(|s| s.iter().map(|x| x.to_f32())).collect(),
            }
        }
        Ok((flat(k.read(len, r)?), flat(v.read(len, rope)?)))
    }

    pub(crate) fn write_and_attend(&mut self, li: usize, start: usize, width: usize, (q, k, v): (&[f32], &[f32], &[f32]), pos: &[usize], cfg: &kernels::AttnCfg) -> Result<Vec<f32>, String> {
        let Some(LayerState::Kv { k: keys, v: values }) = self.layers.get_mut(li) else {
            return Err(format!("layer {li} keeps no keys and values"));
        };
        keys.write(start, width, k)?;
        values.write(start, width, v)?;
        let mut q = std::borrow::Cow::Borrowed(q);
        // Keys in a block format meet the query as Q8_0 blocks (a bf16 cache leaves it as is).
        if let Some(f) = keys.encoded() {
            if f.block().is_some() {
                if !cfg.head_dim.is_multiple_of(32) {
                    return Err(format!("{f} KV cache: a query head of {} values is not whole blocks", cfg.head_dim));
                }
                super::kvcodec::round_trip(GgmlType::Q8_0, q.to_mut())?;
            }
        }
        let kv_len = start + pos.len();
        let shift = keys.shift;
        let (held_k, held_v) = (keys.read(kv_len, width)?, values.read(kv_len, width)?);
        fn refs<'a, T: std::ops::Deref<Target = [f32]>>(v: &'a [T]) -> Vec<&'a [f32]> {
            v.iter().map(|p| &**p).collect()
        }
        use kernels::Pages;
        match (&held_k, &held_v) {
            (Held::F32(k), Held::F32(v)) => kernels::attention_paged(&q, pos, Pages::paged(&refs(k), shift), Pages::paged(&refs(v), shift), kv_len, cfg),
            (Held::F32(k), Held::F16(v)) => kernels::attention_paged(&q, pos, Pages::paged(&refs(k), shift), Pages::paged(v, shift), kv_len, cfg),
            (Held::F16(k), Held::F32(v)) => kernels::attention_paged(&q, pos, Pages::paged(k, shift), Pages::paged(&refs(v), shift), kv_len, cfg),
            (Held::F16(k), Held::F16(v)) => kernels::attention_paged(&q, pos, Pages::paged(k, shift), Pages::paged(v, shift), kv_len, cfg),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn side(shift: u32, format: Option<crate::KvFormat>, rows: usize, width: usize) -> Side {
        let mut s = Side::new(format, shift);
        let x: Vec<f32> = (0..rows * width).map(|i| (i as f32 * 0.37).sin()).collect();
        // Written in uneven steps, as prefill chunks and decode steps write.
        let mut at = 0;
        for step in [5, 1, 17, 3, 40].iter().cycle() {
            if at >= rows {
                break;
            }
            let n = (*step).min(rows - at);
            s.write(at, width, &x[at * width..(at + n) * width]).unwrap();
            at += n;
        }
        s
    }

    fn flat(s: &Side, rows: usize, width: usize) -> Vec<u32> {
        match s.read(rows, width).unwrap() {
            Held::F32(p) => p.iter().flat_map(|p| p.iter().map(|v| v.to_bits())).collect(),
            Held::F16(p) => p.iter().flat_map(|p| p.iter().map(|v| v.to_bits() as u32)).collect(),
        }
    }

    #[test]
    fn pages_hold_the_rows_a_contiguous_cache_holds_and_prefixes_share_full_pages() {
        let width = 64;
        for format in [None, Some("f16"), Some("q8_0")] {
            let format = format.map(|f| crate::KvFormat::parse(f).unwrap());
            let whole = side(usize::BITS - 1, format, 70, width);
            let paged = side(4, format, 70, width);
            assert_eq!(paged.pages.len(), 5);
            assert_eq!(flat(&whole, 70, width), flat(&paged, 70, width), "{format:?}");
            // A prefix of 40 rows: two full pages shared, the third copied and cut.
            let mut p = paged.first_rows(40, width).unwrap();
            assert!(Arc::ptr_eq(&p.pages[0], &paged.pages[0]) && Arc::ptr_eq(&p.pages[1], &paged.pages[1]) && !Arc::ptr_eq(&p.pages[2], &paged.pages[2]));
            assert_eq!(flat(&p, 40, width), flat(&whole, 40, width));
            // Writing into the copy leaves the source's pages alone (copy on write).
            p.write(30, width, &vec![9.0; 3 * width]).unwrap();
            assert_eq!(flat(&paged, 70, width), flat(&whole, 70, width));
            assert_eq!(p.rows(width), 33);
            assert!(paged.first_rows(71, width).is_none());
            // Rewriting from a row inside a page drops what followed.
            let mut q = paged.clone();
            q.write(18, width, &[]).unwrap();
            assert_eq!((q.rows(width), q.pages.len()), (18, 2));
        }
    }
}
