//! What a GPU device keeps per sequence between calls (`KvCache`: each layer's keys and values,
//! or a state-space layer's convolution inputs and recurrent state), a batch's segments, and
//! the recording of taps from device buffers.

use super::{DevBuf, Gpu};
use oracle::spec::{BlockKind, ModelSpec};
use oracle::Tap;
use std::sync::Arc;

/// What one layer keeps between calls on the device, by the kind of its block.
pub(super) enum LayerState {
    /// An attention layer's keys and values, `[capacity, kv_dim]` each.
    Kv { k: DevBuf, v: DevBuf },
    /// A state-space layer's convolution inputs (`[capacity, conv_dim]`) and recurrent states:
    /// after every position (`[capacity, state_len]`) in a cache that keeps its history, else
    /// the latest only.
    Ssm { inputs: DevBuf, states: DevBuf },
    /// A latent-attention layer's normed latents (`[capacity, kv_lora_rank]`) and shared
    /// rotated keys (`[capacity, qk_rope]`).
    Latent { latent: DevBuf, kpe: DevBuf },
}

/// Every layer's state, the positions each can hold and the positions it holds.
pub(super) struct KvCache {
    pub(super) layers: Vec<LayerState>,
    capacity: usize,
    pub(super) len: usize,
    /// Whether recurrent states are kept for every position (so a prefix can be reused).
    pub(super) history: bool,
}

impl KvCache {
    pub(super) fn empty() -> KvCache {
        KvCache { layers: Vec::new(), capacity: 0, len: 0, history: false }
    }

    /// An empty cache that keeps every position's recurrent states, so that a later request can
    /// reuse any prefix of it.
    pub(super) fn serving() -> KvCache {
        KvCache { history: true, ..KvCache::empty() }
    }

    /// Grows the cache to hold `need` positions, keeping what it holds.
    pub(super) fn reserve(&mut self, g: &Arc<Gpu>, spec: &ModelSpec, need: usize) -> Result<(), String> {
        if need <= self.capacity {
            return Ok(());
        }
        let capacity = need.next_power_of_two().max(64);
        let held = self.len;
        // Each layer's new buffer of `rows` rows receives the first `kept` rows the old one holds
        // (none on first use).
        let resized = |old: Option<&DevBuf>, width: usize, rows: usize, kept: usize| -> Result<DevBuf, String> {
            let new = g.alloc(4 * rows * width)?;
            if let Some(old) = old.filter(|_| kept > 0) {
                g.copy(old.ptr, new.ptr, kept * width)?;
            }
            Ok(new)
        };
        let grow = |old: Option<&DevBuf>, width: usize| resized(old, width, capacity, held);
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (li, l) in spec.layers.iter().enumerate() {
            layers.push(match l.block {
                BlockKind::Attention(a) => {
                    let old = match self.layers.get(li) {
                        Some(LayerState::Kv { k, v }) => Some((k, v)),
                        _ => None,
                    };
                    LayerState::Kv {
                        k: grow(old.map(|o| o.0), a.kv_dim())?,
                        v: grow(old.map(|o| o.1), a.kv_dim())?,
                    }
                }
                BlockKind::Ssm(b) => {
                    let old = match self.layers.get(li) {
                        Some(LayerState::Ssm { inputs, states }) => Some((inputs, states)),
                        _ => None,
                    };
                    // The state after every position, or the latest one only.
                    let states = match self.history {
                        true => grow(old.map(|o| o.1), b.state_len())?,
                        false => resized(old.map(|o| o.1), b.state_len(), 1, held.min(1))?,
                    };
                    LayerState::Ssm { inputs: grow(old.map(|o| o.0), b.conv_dim())?, states }
                }
                BlockKind::Mla(b) => {
                    let old = match self.layers.get(li) {
                        Some(LayerState::Latent { latent, kpe }) => Some((latent, kpe)),
                        _ => None,
                    };
                    LayerState::Latent {
                        latent: grow(old.map(|o| o.0), b.kv_lora_rank)?,
                        kpe: grow(old.map(|o| o.1), b.qk_rope)?,
                    }
                }
            });
        }
        self.layers = layers;
        self.capacity = capacity;
        Ok(())
    }

    /// A new cache holding this one's first `n` positions (a prefix another request reuses),
    /// copied on the device.
    pub(super) fn prefix(&self, g: &Arc<Gpu>, spec: &ModelSpec, n: usize) -> Result<KvCache, String> {
        if n > self.len {
            return Err(format!("a prefix of {n} positions from a cache of {}", self.len));
        }
        let mut out = KvCache::serving();
        out.reserve(g, spec, n.max(1))?;
        for (li, (mine, theirs)) in self.layers.iter().zip(&out.layers).enumerate() {
            if n == 0 {
                break;
            }
            match (spec.layers[li].block, mine, theirs) {
                (BlockKind::Attention(a), LayerState::Kv { k, v }, LayerState::Kv { k: k2, v: v2 }) => {
                    g.copy(k.ptr, k2.ptr, n * a.kv_dim())?;
                    g.copy(v.ptr, v2.ptr, n * a.kv_dim())?;
                }
                (BlockKind::Ssm(b), LayerState::Ssm { inputs, states }, LayerState::Ssm { inputs: i2, states: s2 }) => {
                    if !self.history {
                        return Err(format!("layer {li}: a prefix of {n} positions from a cache that keeps only its latest recurrent state"));
                    }
                    g.copy(inputs.ptr, i2.ptr, n * b.conv_dim())?;
                    g.copy(states.ptr, s2.ptr, n * b.state_len())?;
                }
                (BlockKind::Mla(b), LayerState::Latent { latent, kpe }, LayerState::Latent { latent: l2, kpe: k2 }) => {
                    g.copy(latent.ptr, l2.ptr, n * b.kv_lora_rank)?;
                    g.copy(kpe.ptr, k2.ptr, n * b.qk_rope)?;
                }
                _ => return Err(format!("layer {li}: the cache holds another kind of state")),
            }
        }
        out.len = n;
        Ok(out)
    }
}

/// One sequence's part of a batch: its tokens from position `start`, attending to `caches[cache]`.
pub(super) struct Seg<'a> {
    pub cache: usize,
    pub start: usize,
    pub tokens: &'a [u32],
}

pub(super) fn record(taps: &mut dyn Tap, name: &str, buf: &DevBuf, start: usize, m: usize, width: usize) -> Result<(), String> {
    record_at(taps, name, buf, 0, start, m, width)
}

/// [`record`] of the `m * width` floats at `offset` (floats) in `buf` (a slice of the KV cache).
pub(super) fn record_at(taps: &mut dyn Tap, name: &str, buf: &DevBuf, offset: usize, start: usize, m: usize, width: usize) -> Result<(), String> {
    if taps.enabled() {
        taps.record(name, start, m, width, &buf.download_f32_at(offset, m * width)?);
    }
    Ok(())
}
