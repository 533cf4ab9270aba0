//! Model files -> (ModelSpec, named f32 tensors). GGUF files are read by our own reader;
//! safetensors directories (`config.json` + `*.safetensors`) by the `safetensors` crate, with
//! Hugging Face tensor names mapped to the GGUF names the interpreter uses.

use crate::error::{OracleError, Result};
use crate::gguf::GgufFile;
use crate::quant::GgmlType;
use crate::spec::ModelSpec;
use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub use crate::tensor::{LoadedTensor, RawTensor, TensorSource};

mod gpt_oss;
mod model_file;
pub use model_file::{check_layers_backed, chat_template, open_model, open_tokenizer, open_weights, tokenizer_gap, ModelFile};
use gpt_oss::{blocks_of_scales, gpt_oss_experts, mxfp4_rows, OssPart};
pub use gpt_oss::gpt_oss_hf_to_gguf_name;

impl TensorSource for GgufFile {
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>> {
        let Some(info) = self.tensor(name) else { return Ok(None) };
        let data = self.tensor_f32(info).map_err(|e| OracleError::Gguf {
            file: self.path.clone(),
            field: format!("tensor `{name}`"),
            offset: info.file_offset,
            reason: e.to_string(),
        })?;
        Ok(Some(LoadedTensor {
            dims: info.dims.iter().map(|&d| d as usize).collect(),
            data,
        }))
    }

    fn label(&self) -> String {
        self.path.clone()
    }

    fn n_elements(&self) -> Result<u64> {
        Ok(self.tensors.iter().fold(0u64, |n, t| n.saturating_add(t.n_elements())))
    }

    fn n_bytes(&self) -> Result<u64> {
        Ok(self.tensors.iter().fold(0u64, |n, t| n.saturating_add(t.n_bytes)))
    }

    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        let Some(info) = self.tensor(name) else { return Ok(None) };
        Ok(Some(RawTensor { dims: info.dims.iter().map(|&d| d as usize).collect(), ty: info.ty, bytes: Cow::Borrowed(self.weight_bytes(info)?) }))
    }
}

/// A safetensors model directory.
pub struct SafetensorsDir {
    pub dir: PathBuf,
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// GGUF name -> its parts: one, or (a MoE layer's stacked expert tensor) one per expert, in
    /// expert order.
    index: HashMap<String, Vec<Part>>,
    /// Gemma's and Qwen3-Next's checkpoints store each RMSNorm's weight less one (the model
    /// multiplies by `1 + w`, computed in f32): handed out as `1 + w` in f32, as GGUF converters
    /// store them. (Not a gated DeltaNet's output norm, `ssm_norm`, which multiplies by `w`.)
    norm_plus_one: bool,
    /// A Mamba-2 checkpoint's dimensions: its `A_log`, convolution kernels and gated norms are
    /// handed out in their GGUF form.
    ssm: Option<crate::spec::SsmBlock>,
}

/// A stored tensor that is (part of) a GGUF tensor, located once when the directory is opened
/// (a checkpoint's header is parsed once, not again for every tensor or expert read).
#[derive(Clone, Debug)]
struct Part {
    file: usize,
    hf: String,
    dtype: safetensors::Dtype,
    /// Torch order.
    shape: Vec<usize>,
    /// Its bytes within the file's map.
    data: std::ops::Range<usize>,
    /// Of a fused `gate_up_proj` `[n_expert, 2 * rows, cols]`: the gate (0) or up (1) half of
    /// every expert's rows. None: the whole tensor.
    half: Option<usize>,
    /// Of a 2-D tensor: these rows (torch order), in this order (Qwen3-Next's q/k/v and z, each
    /// key head's rows of them stored together). None: every row.
    rows: Option<Vec<usize>>,
    /// One expert's matrix of a stacked `[cols, rows, n_expert]` tensor (a stack of one expert
    /// is still 3-D).
    expert: bool,
    /// GPT-OSS's expert tensors, rearranged to the GGUF tensor's layout when read.
    oss: Option<OssPart>,
    /// The `_scales` tensor of GPT-OSS's MXFP4 expert blocks.
    scales: Option<Box<Part>>,
}

/// Whole-model tensors: (Hugging Face name, GGUF name).
const MODEL_NAMES: [(&str, &str); 3] = [("model.embed_tokens.weight", "token_embd.weight"), ("model.norm.weight", "output_norm.weight"), ("lm_head.weight", "output.weight")];

/// Per-layer tensors: (Hugging Face name after `model.layers.N.`, GGUF name after `blk.N.`).
const LAYER_NAMES: [(&str, &str); 15] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.o_proj.bias", "attn_output.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// Gemma 3's norms (`Gemma3ForCausalLM`): one before and one after each of attention and the
/// FFN; its other per-layer weights are named as [`LAYER_NAMES`] names them.
const GEMMA_NORM_NAMES: [(&str, &str); 4] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
];

/// Maps a Gemma 3 checkpoint's tensor name to its GGUF name.
pub fn gemma_hf_to_gguf_name(hf: &str) -> Option<String> {
    let others = LAYER_NAMES.into_iter().filter(|(h, _)| !h.ends_with("layernorm.weight"));
    rename(hf, MODEL_NAMES.into_iter(), GEMMA_NORM_NAMES.into_iter().chain(others), "model.layers.", "blk.")
}

/// Maps a GGUF name to a Gemma 3 checkpoint's (the inverse of [`gemma_hf_to_gguf_name`]).
pub fn gemma_gguf_to_hf_name(gguf: &str) -> Option<String> {
    let others = LAYER_NAMES.into_iter().filter(|(h, _)| !h.ends_with("layernorm.weight"));
    rename(gguf, MODEL_NAMES.into_iter().map(|(h, g)| (g, h)), GEMMA_NORM_NAMES.into_iter().chain(others).map(|(h, g)| (g, h)), "blk.", "model.layers.")
}

/// Phi-3's fused tensors: Q, K and V in one, gate and up in one (GGUF stores the latter as
/// `ffn_up`, so a dense model's `mlp.up_proj` stays the name [`gguf_to_hf_name`] gives for it).
const FUSED_LAYER_NAMES: [(&str, &str); 2] = [("self_attn.qkv_proj.weight", "attn_qkv.weight"), ("mlp.gate_up_proj.weight", "ffn_up.weight")];

/// Per-layer tensors of MoE checkpoints (Qwen2-MoE / Qwen3-MoE, then Mixtral): the router and
/// the shared expert. Both routers map to one GGUF name; the Qwen form comes first, so it is the
/// one [`gguf_to_hf_name`] gives.
/// Latent attention's per-layer tensors (`DeepseekV3ForCausalLM`), as llama.cpp's converter
/// names them (it splits `kv_b_proj` further; the loaders read it whole or split).
const MLA_LAYER_NAMES: [(&str, &str); 10] = [
    ("mlp.gate.e_score_correction_bias", "exp_probs_b.bias"),
    ("mlp.shared_experts.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn_up_shexp.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn_down_shexp.weight"),
    ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"),
    ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    ("self_attn.kv_b_proj.weight", "attn_kv_b.weight"),
];

const MOE_LAYER_NAMES: [(&str, &str); 6] = [
    ("mlp.gate.weight", "ffn_gate_inp.weight"),
    ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
    ("block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
];

/// One expert's matrices, `model.layers.N.{prefix}E.{tail}`: (prefix, tail, the GGUF name of
/// the stacked `[cols, rows, n_expert]` tensor it is part E of). Mixtral's w1/w3/w2 are
/// gate/up/down.
const EXPERT_NAMES: [(&str, &str, &str); 6] = [
    ("mlp.experts.", "gate_proj.weight", "ffn_gate_exps.weight"),
    ("mlp.experts.", "up_proj.weight", "ffn_up_exps.weight"),
    ("mlp.experts.", "down_proj.weight", "ffn_down_exps.weight"),
    ("block_sparse_moe.experts.", "w1.weight", "ffn_gate_exps.weight"),
    ("block_sparse_moe.experts.", "w3.weight", "ffn_up_exps.weight"),
    ("block_sparse_moe.experts.", "w2.weight", "ffn_down_exps.weight"),
];

/// Transformers 5 saves a layer's experts fused: `mlp.experts.gate_up_proj` `[n_expert, 2 *
/// ffn, hidden]` (each expert's gate rows, then its up rows) and `mlp.experts.down_proj`
/// `[n_expert, hidden, ffn]`. The GGUF tensors each is, with the half of gate_up it holds.
pub fn hf_fused_experts(hf: &str) -> Option<Vec<(String, Option<usize>)>> {
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let n = |t: &str| format!("blk.{layer}.{t}");
    match rest {
        "mlp.experts.gate_up_proj" => Some(vec![(n("ffn_gate_exps.weight"), Some(0)), (n("ffn_up_exps.weight"), Some(1))]),
        "mlp.experts.down_proj" => Some(vec![(n("ffn_down_exps.weight"), None)]),
        _ => None,
    }
}

/// A Hugging Face expert tensor's place: (GGUF name of the stacked tensor, expert index).
pub fn hf_expert_part(hf: &str) -> Option<(String, usize)> {
    let (layer, rest) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    EXPERT_NAMES.into_iter().find_map(|(prefix, tail, gguf)| {
        let (e, t) = rest.strip_prefix(prefix)?.split_once('.')?;
        (t == tail).then_some(())?;
        Some((format!("blk.{layer}.{gguf}"), e.parse().ok()?))
    })
}

/// Renames `name` through `(from, to)` pairs of whole names and of per-layer tails under
/// `from_layer` / `to_layer` prefixes; None when it is not one of them.
fn rename(name: &str, whole: impl Iterator<Item = (&'static str, &'static str)>, tails: impl Iterator<Item = (&'static str, &'static str)>, from_layer: &str, to_layer: &str) -> Option<String> {
    if let Some((_, to)) = whole.into_iter().find(|(from, _)| *from == name) {
        return Some(to.to_string());
    }
    let (layer, tail) = name.strip_prefix(from_layer)?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (_, to) = tails.into_iter().find(|(from, _)| *from == tail)?;
    Some(format!("{to_layer}{layer}.{to}"))
}

/// Mamba-2's whole-model tensors (`Mamba2ForCausalLM`, under `backbone.`).
const MAMBA_MODEL_NAMES: [(&str, &str); 3] = [("backbone.embeddings.weight", "token_embd.weight"), ("backbone.norm_f.weight", "output_norm.weight"), ("lm_head.weight", "output.weight")];

/// Mamba-2's per-layer tensors (after `backbone.layers.N.`). `A_log` is handed out as GGUF's
/// `ssm_a`, `-exp(A_log)`; the convolution's `[conv_dim, 1, d_conv]` kernel as `[d_conv,
/// conv_dim]` (GGML order) and the gated norm's scales as `[d_inner / n_group, n_group]`, as
/// llama.cpp's converter stores them.
const MAMBA_LAYER_NAMES: [(&str, &str); 9] = [
    ("norm.weight", "attn_norm.weight"),
    ("mixer.in_proj.weight", "ssm_in.weight"),
    ("mixer.conv1d.weight", "ssm_conv1d.weight"),
    ("mixer.conv1d.bias", "ssm_conv1d.bias"),
    ("mixer.dt_bias", "ssm_dt.bias"),
    ("mixer.A_log", "ssm_a"),
    ("mixer.D", "ssm_d"),
    ("mixer.norm.weight", "ssm_norm.weight"),
    ("mixer.out_proj.weight", "ssm_out.weight"),
];

/// Maps a Mamba-2 checkpoint's tensor name to its GGUF name.
pub fn mamba_hf_to_gguf_name(hf: &str) -> Option<String> {
    rename(hf, MAMBA_MODEL_NAMES.into_iter(), MAMBA_LAYER_NAMES.into_iter(), "backbone.layers.", "blk.")
}

/// Granite 4.0-H's per-layer tensors (`GraniteMoeHybridForCausalLM`, dense: after
/// `model.layers.N.`): each GGUF tensor and the half of the stored one it is (the shared MLP's
/// `input_linear` holds the gate's rows, then the up projection's).
const GRANITE_HYBRID_LAYER_NAMES: [(&str, &str, Option<usize>); 17] = [
    ("input_layernorm.weight", "attn_norm.weight", None),
    ("post_attention_layernorm.weight", "ffn_norm.weight", None),
    ("self_attn.q_proj.weight", "attn_q.weight", None),
    ("self_attn.k_proj.weight", "attn_k.weight", None),
    ("self_attn.v_proj.weight", "attn_v.weight", None),
    ("self_attn.o_proj.weight", "attn_output.weight", None),
    ("mamba.in_proj.weight", "ssm_in.weight", None),
    ("mamba.conv1d.weight", "ssm_conv1d.weight", None),
    ("mamba.conv1d.bias", "ssm_conv1d.bias", None),
    ("mamba.dt_bias", "ssm_dt.bias", None),
    ("mamba.A_log", "ssm_a", None),
    ("mamba.D", "ssm_d", None),
    ("mamba.norm.weight", "ssm_norm.weight", None),
    ("mamba.out_proj.weight", "ssm_out.weight", None),
    ("shared_mlp.input_linear.weight", "ffn_gate.weight", Some(0)),
    ("shared_mlp.input_linear.weight", "ffn_up.weight", Some(1)),
    ("shared_mlp.output_linear.weight", "ffn_down.weight", None),
];

/// A Granite 4.0-H checkpoint's tensor as GGUF tensors, each with the half of it it holds.
pub fn granite_hybrid_hf_to_gguf(hf: &str) -> Option<Vec<(String, Option<usize>)>> {
    if let Some((_, g)) = MODEL_NAMES.into_iter().find(|(h, _)| *h == hf) {
        return Some(vec![(g.to_string(), None)]);
    }
    let (layer, tail) = hf.strip_prefix("model.layers.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let parts: Vec<(String, Option<usize>)> = GRANITE_HYBRID_LAYER_NAMES.iter().filter(|(h, _, _)| *h == tail).map(|(_, g, half)| (format!("blk.{layer}.{g}"), *half)).collect();
    (!parts.is_empty()).then_some(parts)
}

/// Maps a Hugging Face tensor name to its GGUF name (None: not a weight this loader reads).
pub fn hf_to_gguf_name(hf: &str) -> Option<String> {
    rename(hf, MODEL_NAMES.into_iter(), LAYER_NAMES.into_iter().chain(MOE_LAYER_NAMES).chain(FUSED_LAYER_NAMES).chain(MLA_LAYER_NAMES), "model.layers.", "blk.")
}

/// Maps a GGUF tensor name to its Hugging Face name (the inverse of [`hf_to_gguf_name`]).
pub fn gguf_to_hf_name(gguf: &str) -> Option<String> {
    rename(gguf, MODEL_NAMES.into_iter().map(|(h, g)| (g, h)), LAYER_NAMES.into_iter().chain(MOE_LAYER_NAMES).chain(FUSED_LAYER_NAMES).chain(MLA_LAYER_NAMES).map(|(h, g)| (g, h)), "blk.", "model.layers.")
}

impl SafetensorsDir {
    pub fn open(dir: &Path) -> Result<(SafetensorsDir, ModelSpec)> {
        let cfg_path = dir.join("config.json");
        if !cfg_path.is_file() {
            return Err(OracleError::Safetensors {
                file: dir.display().to_string(),
                reason: "a directory is read as a safetensors model, which needs config.json and *.safetensors files; this one has no config.json".into(),
            });
        }
        let cfg_text = crate::files::read_to_string(&cfg_path)?;
        let cfg: serde_json::Value = serde_json::from_str(&cfg_text).map_err(|e| OracleError::Safetensors {
            file: cfg_path.display().to_string(),
            reason: format!("not valid JSON: {e}"),
        })?;
        let spec = ModelSpec::from_hf_config(&cfg, &cfg_path.display().to_string())?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| OracleError::io(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(OracleError::Safetensors { file: dir.display().to_string(), reason: "no *.safetensors files".into() });
        }
        let mut maps = Vec::new();
        let mut index: HashMap<String, Vec<Part>> = HashMap::new();
        // Stacked GGUF name -> expert index -> its tensor.
        let mut experts: HashMap<String, std::collections::BTreeMap<usize, Part>> = HashMap::new();
        let mut unknown = Vec::new();
        // Which file each tensor came from: a tensor in two shards would otherwise be taken from
        // whichever sorts last.
        let mut seen: HashMap<String, PathBuf> = HashMap::new();
        let oss = spec.arch == crate::spec::Arch::GptOss;
        // GPT-OSS's MXFP4 expert scales, by the name of their blocks.
        let mut mx_scales: HashMap<String, Part> = HashMap::new();
        for (fi, path) in files.into_iter().enumerate() {
            let f = crate::files::open(&path)?;
            // SAFETY: read-only map of a file we do not modify.
            let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| OracleError::io(&path, e))?;
            let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| OracleError::Safetensors {
                file: path.display().to_string(),
                // The crate's size errors name no tensor: find the one.
                reason: invalid_tensor_entry(&map).map_or_else(|| e.to_string(), |which| format!("{e}: {which}")),
            })?;
            for (name, view) in st.tensors() {
                let name = name.as_str();
                if let Some(first) = seen.insert(name.to_string(), path.clone()) {
                    return Err(OracleError::Safetensors {
                        file: dir.display().to_string(),
                        reason: format!("tensor `{name}` is in both {} and {}: which one is meant is not defined", first.display(), path.display()),
                    });
                }
                let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
                let data = start..start + view.data().len();
                let part = |half, expert| Part { file: fi, hf: name.to_string(), dtype: view.dtype(), shape: view.shape().to_vec(), data: data.clone(), half, rows: None, expert, oss: None, scales: None };
                let granite = spec.arch == crate::spec::Arch::GraniteHybrid;
                let delta = spec.ssm.filter(|b| b.kind == crate::spec::SsmKind::GatedDelta);
                let gguf = if granite {
                    None
                } else if let Some(b) = delta {
                    match delta_hf_to_gguf(name, &b) {
                        Some(parts) => {
                            for (g, rows) in parts {
                                index.insert(g, vec![Part { rows, ..part(None, false) }]);
                            }
                            continue;
                        }
                        // Its FFN norm where llama.cpp's converter stores it (`stored_ffn_norm`).
                        None => hf_to_gguf_name(name).map(|g| match g.strip_suffix("ffn_norm.weight") {
                            Some(layer) => format!("{layer}{}", spec.stored_ffn_norm()),
                            None => g,
                        }),
                    }
                } else if spec.ssm.is_some() {
                    mamba_hf_to_gguf_name(name)
                } else if spec.post_norms {
                    gemma_hf_to_gguf_name(name)
                } else if oss {
                    gpt_oss_hf_to_gguf_name(name)
                } else {
                    hf_to_gguf_name(name)
                };
                if let Some(g) = gguf {
                    index.insert(g, vec![part(None, false)]);
                } else if let Some(parts) = granite_hybrid_hf_to_gguf(name).filter(|_| granite) {
                    for (g, half) in parts {
                        index.insert(g, vec![part(half, false)]);
                    }
                } else if let Some(blocks) = blocks_of_scales(name).filter(|_| oss) {
                    mx_scales.insert(blocks, part(None, false));
                } else if let Some(parts) = gpt_oss_experts(name).filter(|_| oss) {
                    for (g, how) in parts {
                        index.insert(g, vec![Part { oss: Some(how), ..part(None, false) }]);
                    }
                } else if let Some((g, e)) = hf_expert_part(name) {
                    experts.entry(g).or_default().insert(e, part(None, true));
                } else if let Some(fused) = hf_fused_experts(name) {
                    for (g, half) in fused {
                        index.insert(g, vec![part(half, false)]);
                    }
                } else if !name.ends_with(".rotary_emb.inv_freq") {
                    // (Old checkpoints store RoPE's inverse frequencies, which the config defines.)
                    unknown.push(format!("{} in {}", name, path.display()));
                }
            }
            maps.push((path, map));
        }
        // Each MXFP4 blocks tensor takes its scales; scales without blocks are unknown.
        for p in index.values_mut().flatten().filter(|p| p.oss.is_some_and(OssPart::is_blocks)) {
            let scales = mx_scales.get(&p.hf).ok_or_else(|| OracleError::Safetensors {
                file: dir.display().to_string(),
                reason: format!("`{}` holds MXFP4 blocks, but its scales (`{}`) are not in the files", p.hf, p.hf.replace("_blocks", "_scales")),
            })?;
            p.scales = Some(Box::new(scales.clone()));
        }
        let used: std::collections::HashSet<&str> = index.values().flatten().filter_map(|p| p.scales.as_ref().map(|_| p.hf.as_str())).collect();
        unknown.extend(mx_scales.iter().filter(|(b, _)| !used.contains(b.as_str())).map(|(_, s)| format!("{} in {}", s.hf, maps[s.file].0.display())));
        // Every stacked tensor needs experts 0..n_expert, no more and no fewer.
        let n_expert = spec.moe.as_ref().map_or(0, |m| m.n_expert);
        let mut stacked: Vec<_> = experts.into_iter().collect();
        stacked.sort_by(|a, b| a.0.cmp(&b.0));
        for (g, parts) in stacked {
            if let Some(fused) = index.get(&g).and_then(|p| p.first()) {
                let some = parts.values().next().map_or("", |p| p.hf.as_str());
                return Err(OracleError::Safetensors {
                    file: dir.display().to_string(),
                    reason: format!("`{g}` is stored twice, fused as `{}` and per expert as `{some}`", fused.hf),
                });
            }
            if let Some(e) = (0..n_expert).find(|e| !parts.contains_key(e)) {
                let some = parts.values().next().map_or("", |p| p.hf.as_str());
                return Err(OracleError::Safetensors {
                    file: dir.display().to_string(),
                    reason: format!("`{some}` is one of {n_expert} experts (config.json), but expert {e} of `{g}` is missing"),
                });
            }
            if let Some((e, Part { hf, .. })) = parts.iter().find(|(e, _)| **e >= n_expert) {
                return Err(OracleError::Safetensors {
                    file: dir.display().to_string(),
                    reason: format!("`{hf}` is expert {e}, but config.json says the model has {n_expert} experts"),
                });
            }
            index.insert(g, parts.into_values().collect());
        }
        // A weight the interpreter would not read is refused, never skipped: the model would
        // run without it and the judge would be wrong without saying so.
        unknown.sort();
        if let Some(first) = unknown.first() {
            return Err(OracleError::Safetensors {
                file: dir.display().to_string(),
                reason: format!("{} tensor(s) this loader does not know (a {} model has no such weight), e.g. `{first}`", unknown.len(), spec.arch),
            });
        }
        // The config says which optional weights exist; the files must agree.
        let agree = [
            ("blk.0.attn_q.bias", spec.qkv_bias, "Q/K/V biases (`attention_bias`, or qwen2)"),
            ("blk.0.attn_output.bias", spec.out_bias, "output-projection bias (`attention_bias` on llama, mistral, qwen3)"),
            ("blk.0.attn_q_norm.weight", spec.qk_norm, "QK-norm weights (qwen3)"),
        ];
        for (tensor, expected, what) in agree {
            if let Some(p) = index.get(tensor).filter(|_| !expected).and_then(|p| p.first()) {
                return Err(OracleError::Safetensors { file: cfg_path.display().to_string(), reason: format!("config.json describes no {what}, but the files hold `{}`", p.hf) });
            }
        }
        // Layers beyond num_hidden_layers, or weights this spec does not read. With tied
        // embeddings transformers ignores a stored lm_head (it ties it to the embedding), and so
        // does this loader.
        let present = || index.keys().map(String::as_str).filter(|n| !(spec.tied_output && *n == "output.weight"));
        spec.check_no_unread(present(), "num_hidden_layers").map_err(|reason| {
            // The example the message gives (the first unread name), as the files name it.
            let first = present().filter(|n| !spec.reads_tensor(n)).min();
            let stored = first.and_then(|g| index.get(g)?.first()).map(|p| format!(" (`{}` in the files)", p.hf)).unwrap_or_default();
            OracleError::Safetensors { file: dir.display().to_string(), reason: format!("{reason}{stored}") }
        })?;
        Ok((SafetensorsDir { dir: dir.to_path_buf(), maps, index, norm_plus_one: spec.post_norms || spec.arch.row().qwen_next, ssm: spec.ssm }, spec))
    }

    /// (values, bytes) of the stored tensors the index reads, each counted once (a fused
    /// gate_up tensor is two GGUF tensors' part).
    fn totals(&self) -> Result<(u64, u64)> {
        let mut seen = std::collections::HashSet::new();
        let (mut n, mut b) = (0u64, 0u64);
        for p in self.index.values().flatten().filter(|p| seen.insert((p.file, p.hf.as_str()))) {
            let stored = p.shape.iter().fold(1u64, |acc, d| acc.saturating_mul(*d as u64));
            // MXFP4 blocks: two values a byte, and a scale byte a block of 32.
            n = n.saturating_add(if p.scales.is_some() { stored.saturating_mul(2) } else { stored });
            b = b.saturating_add(p.data.len() as u64).saturating_add(p.scales.as_ref().map_or(0, |s| s.data.len() as u64));
        }
        Ok((n, b))
    }
}

impl SafetensorsDir {
    /// One stored tensor (a part of a GGUF tensor): GGML dims, GGML type, bytes, file.
    fn part(&self, p: &Part) -> Result<(Vec<usize>, GgmlType, &[u8], &Path)> {
        let (path, map) = &self.maps[p.file];
        let ty = match p.dtype {
            safetensors::Dtype::F32 => GgmlType::F32,
            safetensors::Dtype::F16 => GgmlType::F16,
            safetensors::Dtype::BF16 => GgmlType::BF16,
            other => return Err(OracleError::Safetensors { file: path.display().to_string(), reason: format!("tensor `{}` has dtype {other:?}; f32, f16 and bf16 are read", p.hf) }),
        };
        // Torch order [out, in] -> GGML order [in, out].
        let dims: Vec<usize> = p.shape.iter().rev().copied().collect();
        Ok((dims, ty, &map[p.data.clone()], path))
    }

    /// GPT-OSS MXFP4 expert blocks `p` with their `scales`, as a GGUF MXFP4 tensor.
    fn mxfp4_experts(&self, p: &Part, how: OssPart, scales: &Part) -> Result<RawTensor<'_>> {
        let (path, map) = &self.maps[p.file];
        let file = path.display().to_string();
        let bad = |reason: String| OracleError::Safetensors { file: file.clone(), reason };
        for t in [p, scales] {
            if t.dtype != safetensors::Dtype::U8 {
                return Err(bad(format!("MXFP4 tensor `{}` has dtype {:?}, not U8", t.hf, t.dtype)));
            }
        }
        let (dims, bytes) = mxfp4_rows(how, &p.shape, &map[p.data.clone()], &scales.shape, &self.maps[scales.file].1[scales.data.clone()]).ok_or_else(|| {
            bad(format!("MXFP4 experts `{}` {:?} and `{}` {:?} are not [n_expert, rows, blocks, 16] and [n_expert, rows, blocks]", p.hf, p.shape, scales.hf, scales.shape))
        })?;
        crate::quant::finite_weight(&file, &p.hf, GgmlType::MXFP4, &bytes, dims[0])?;
        Ok(RawTensor { dims, ty: GgmlType::MXFP4, bytes: Cow::Owned(bytes) })
    }

    /// GGUF tensor `name` as stored: its one part (or that part's half of a fused gate_up
    /// tensor), or its experts joined in expert order (each of the same dims and type) under GGML
    /// dims `[cols, rows, n_expert]`.
    fn stored(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        let tail = name.split_once('.').map_or("", |(_, r)| r.split_once('.').map_or("", |(_, t)| t));
        if let Some(b) = self.ssm.filter(|_| tail.starts_with("ssm_")) {
            let Some(t) = self.stored_as_is(name)? else { return Ok(None) };
            let f32_bytes = |v: Vec<f32>| -> Cow<'_, [u8]> { Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect()) };
            return Ok(Some(match tail {
                // -exp(A_log), formed in f64 and rounded once.
                "ssm_a" => {
                    let w = t.decode()?;
                    RawTensor { dims: t.dims, ty: GgmlType::F32, bytes: f32_bytes(w.data.iter().map(|a| -(*a as f64).exp() as f32).collect()) }
                }
                "ssm_conv1d.weight" if t.dims.len() == 3 && t.dims[1] == 1 => RawTensor { dims: vec![t.dims[0], t.dims[2]], ..t },
                "ssm_norm.weight" if t.dims == [b.d_inner] && b.kind == crate::spec::SsmKind::Mamba2 => RawTensor { dims: vec![b.d_inner / b.n_group.max(1), b.n_group], ..t },
                _ => t,
            }));
        }
        if self.norm_plus_one && name.ends_with("norm.weight") && tail != "ssm_norm.weight" {
            let Some(t) = self.stored_as_is(name)? else { return Ok(None) };
            let w = t.decode()?;
            let bytes: Vec<u8> = w.data.iter().flat_map(|v| (1.0 + v).to_le_bytes()).collect();
            return Ok(Some(RawTensor { dims: t.dims, ty: GgmlType::F32, bytes: Cow::Owned(bytes) }));
        }
        self.stored_as_is(name)
    }

    fn stored_as_is(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        let Some(parts) = self.index.get(name) else { return Ok(None) };
        let mut joined: Option<(Vec<usize>, GgmlType, Vec<u8>)> = None;
        for p in parts {
            if let (Some(how), Some(scales)) = (p.oss, &p.scales) {
                return self.mxfp4_experts(p, how, scales).map(Some);
            }
            let (dims, ty, bytes, path) = self.part(p)?;
            let bytes = crate::quant::finite_weight(&path.display().to_string(), &p.hf, ty, bytes, dims.first().copied().unwrap_or(1))?;
            if let Some(how) = p.oss {
                let x = RawTensor { dims: dims.clone(), ty, bytes: Cow::Borrowed(bytes) }.decode()?.data;
                let (shape, y) = how.apply(&p.shape, &x).ok_or_else(|| OracleError::Safetensors {
                    file: path.display().to_string(),
                    reason: format!("GPT-OSS expert tensor `{}` has shape {:?}, not the [n_expert, ...] layout of its kind", p.hf, p.shape),
                })?;
                let bytes: Vec<u8> = y.iter().flat_map(|v| v.to_le_bytes()).collect();
                return Ok(Some(RawTensor { dims: shape.into_iter().rev().collect(), ty: GgmlType::F32, bytes: Cow::Owned(bytes) }));
            }
            let (dims, bytes) = match p.half {
                None => (dims, Cow::Borrowed(bytes)),
                Some(h) => half_of_each_expert(dims, ty, bytes, h).ok_or_else(|| OracleError::Safetensors {
                    file: path.display().to_string(),
                    reason: format!("fused expert tensor `{}` is not [n_expert, 2 * ffn, hidden] with whole rows", p.hf),
                })?,
            };
            let (dims, bytes) = match &p.rows {
                None => (dims, bytes),
                Some(rows) => pick_rows(&dims, ty, &bytes, rows).ok_or_else(|| OracleError::Safetensors {
                    file: path.display().to_string(),
                    reason: format!("tensor `{}` {:?} is not a matrix of the rows its config describes", p.hf, p.shape),
                })?,
            };
            if parts.len() == 1 && !p.expert {
                return Ok(Some(RawTensor { dims, ty, bytes }));
            }
            match &mut joined {
                None => joined = Some((dims, ty, bytes.into_owned())),
                Some((d0, t0, all)) => {
                    if dims != *d0 || ty != *t0 {
                        return Err(OracleError::Safetensors {
                            file: path.display().to_string(),
                            reason: format!("expert tensor `{}` is {} {dims:?} (GGML order), but expert 0 of it is {} {d0:?}", p.hf, ty.name(), t0.name()),
                        });
                    }
                    all.extend_from_slice(&bytes);
                }
            }
        }
        Ok(joined.map(|(mut dims, ty, bytes)| {
            dims.push(parts.len());
            RawTensor { dims, ty, bytes: Cow::Owned(bytes) }
        }))
    }
}

/// The first tensor entry (in the order of its data) of a safetensors header whose shape and
/// dtype do not fit its `data_offsets`, described for an error message; None when the header
/// does not parse or every entry fits (the safetensors crate's own message then stands).
fn invalid_tensor_entry(file: &[u8]) -> Option<String> {
    let len = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(file.get(8..8usize.checked_add(len)?)?).ok()?;
    let mut entries: Vec<(&String, &serde_json::Value)> = header.iter().filter(|(name, _)| *name != "__metadata__").collect();
    entries.sort_by_key(|(_, t)| t["data_offsets"][0].as_u64());
    entries.into_iter().find_map(|(name, t)| {
        let dtype: safetensors::Dtype = serde_json::from_value(t["dtype"].clone()).ok()?;
        let shape: Vec<usize> = serde_json::from_value(t["shape"].clone()).ok()?;
        let offsets: [usize; 2] = serde_json::from_value(t["data_offsets"].clone()).ok()?;
        let held = offsets[1].checked_sub(offsets[0]);
        let needed = shape.iter().try_fold(1usize, |n, d| n.checked_mul(*d)).and_then(|n| n.checked_mul(dtype.bitsize())).map(|bits| bits.div_ceil(8));
        let held_text = held.map_or_else(|| format!("data_offsets {offsets:?} run backwards"), |h| format!("its data_offsets {offsets:?} hold {h}"));
        match needed {
            None => Some(format!("tensor `{name}`: shape {shape:?} of {dtype:?} overflows")),
            Some(n) if Some(n) != held => Some(format!("tensor `{name}`: shape {shape:?} of {dtype:?} needs {n} bytes, {held_text}")),
            Some(_) => None,
        }
    })
}

/// Rows `rows` of a matrix of GGML dims `[cols, n_rows]`, in that order: dims `[cols,
/// rows.len()]` and its bytes. None when the tensor is not 2-D or a row is beyond it.
fn pick_rows(dims: &[usize], ty: GgmlType, bytes: &[u8], rows: &[usize]) -> Option<(Vec<usize>, Cow<'static, [u8]>)> {
    let [cols, n_rows] = dims[..] else { return None };
    let row_bytes = ty.bytes_for(cols as u64)? as usize;
    if bytes.len() != n_rows.checked_mul(row_bytes)? || rows.iter().any(|r| *r >= n_rows) {
        return None;
    }
    let out: Vec<u8> = rows.iter().flat_map(|r| &bytes[r * row_bytes..(r + 1) * row_bytes]).copied().collect();
    Some((vec![cols, rows.len()], Cow::Owned(out)))
}

/// A Qwen3-Next gated DeltaNet tensor (after `model.layers.N.linear_attn.`) as GGUF tensors, as
/// llama.cpp's converter writes them, each with the rows of the stored tensor it takes (None:
/// all). `in_proj_qkvz` stores, per key head, its q, k, v and z rows together: it becomes
/// `attn_qkv` (every head's q, then every head's k, then v) and `attn_gate` (z). None for a name
/// that is not one of them.
pub fn delta_hf_to_gguf(hf: &str, b: &crate::spec::SsmBlock) -> Option<Vec<(String, Option<Vec<usize>>)>> {
    let (layer, tail) = hf.strip_prefix("model.layers.")?.split_once(".linear_attn.")?;
    let layer: usize = layer.parse().ok()?;
    let n = |g: &str| format!("blk.{layer}.{g}");
    let whole = |g: &str| Some(vec![(n(g), None)]);
    match tail {
        "in_proj_qkvz.weight" => {
            let (dk, ng) = (b.d_state, b.n_group);
            let dv = b.d_inner / ng.max(1);
            let block = 2 * dk + 2 * dv;
            let rows = |from: usize, width: usize| -> Vec<usize> { (0..ng).flat_map(|g| g * block + from..g * block + from + width).collect() };
            let qkv: Vec<usize> = [rows(0, dk), rows(dk, dk), rows(2 * dk, dv)].concat();
            Some(vec![(n("attn_qkv.weight"), Some(qkv)), (n("attn_gate.weight"), Some(rows(2 * dk + dv, dv)))])
        }
        "in_proj_ba.weight" => whole("ssm_ba.weight"),
        "conv1d.weight" => whole("ssm_conv1d.weight"),
        "dt_bias" => whole("ssm_dt.bias"),
        "A_log" => whole("ssm_a"),
        "norm.weight" => whole("ssm_norm.weight"),
        "out_proj.weight" => whole("ssm_out.weight"),
        _ => None,
    }
}

/// Half `h` (0: the first `rows`, 1: the next) of every expert's `2 * rows` rows of a fused
/// tensor, GGML dims `[cols, 2 * rows, n_expert]`: dims `[cols, rows, n_expert]` and its bytes.
/// None when the tensor is not 3-D with an even row count.
fn half_of_each_expert(dims: Vec<usize>, ty: GgmlType, bytes: &[u8], h: usize) -> Option<(Vec<usize>, Cow<'static, [u8]>)> {
    // A 2-D tensor is one expert's (a dense FFN's gate and up, fused).
    let (cols, rows2, n_expert) = match dims[..] {
        [c, r, e] => (c, r, e),
        [c, r] => (c, r, 1),
        _ => return None,
    };
    if rows2 % 2 != 0 {
        return None;
    }
    let row_bytes = ty.bytes_for(cols as u64)? as usize;
    let half = rows2 / 2 * row_bytes;
    if bytes.len() != n_expert * 2 * half {
        return None;
    }
    let out: Vec<u8> = bytes.chunks_exact(2 * half).flat_map(|e| &e[h * half..(h + 1) * half]).copied().collect();
    let dims = if dims.len() == 2 { vec![cols, rows2 / 2] } else { vec![cols, rows2 / 2, n_expert] };
    Some((dims, Cow::Owned(out)))
}

impl TensorSource for SafetensorsDir {
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>> {
        self.stored(name)?.map(|t| t.decode()).transpose()
    }

    fn label(&self) -> String {
        self.dir.display().to_string()
    }

    fn n_elements(&self) -> Result<u64> {
        Ok(self.totals()?.0)
    }

    fn n_bytes(&self) -> Result<u64> {
        Ok(self.totals()?.1)
    }

    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        self.stored(name)
    }
}

/// A model's tensors with Phi-3's fused ones split (`ModelSpec::fused`): `blk.N.attn_q`, `attn_k`
/// and `attn_v` are row ranges of the stored `attn_qkv` (Q, K, V), `ffn_gate` and `ffn_up` the
/// first and second half of the stored `ffn_up` (gate first, as llama.cpp and Transformers split
/// it). Whole rows are whole blocks, so a slice of a quantized tensor is a quantized tensor.
/// And each layer's FFN norm read from where the file stores it ([`ModelSpec::stored_ffn_norm`]:
/// GPT-OSS's `post_attention_norm`). Every other name passes through.
pub struct Unfused {
    inner: Box<dyn TensorSource>,
    fused: bool,
    q_rows: usize,
    kv_rows: usize,
    ff_rows: usize,
    /// The stored name (after `blk.N.`) of `ffn_norm.weight`.
    ffn_norm: &'static str,
}

impl Unfused {
    pub fn new(inner: Box<dyn TensorSource>, spec: &ModelSpec) -> Unfused {
        // Fused tensors are read for models with one head count (`ModelSpec::validate`).
        let (q_rows, kv_rows, ff_rows) = (
            spec.n_head * spec.head_dim,
            spec.n_head_kv * spec.head_dim,
            spec.n_ff,
        );
        Unfused {
            inner,
            fused: spec.fused,
            q_rows,
            kv_rows,
            ff_rows,
            ffn_norm: spec.stored_ffn_norm(),
        }
    }

    /// Whether `spec`'s files store a tensor under another name or shape than the interpreter reads.
    fn needed(spec: &ModelSpec) -> bool {
        spec.fused || spec.stored_ffn_norm() != "ffn_norm.weight"
    }

    /// The stored name of a whole tensor the loaders hand out as `name`.
    fn stored_name<'n>(&self, name: &'n str) -> Cow<'n, str> {
        match name.strip_prefix("blk.").and_then(|r| r.strip_suffix(".ffn_norm.weight")) {
            Some(layer) if self.ffn_norm != "ffn_norm.weight" => Cow::Owned(format!("blk.{layer}.{}", self.ffn_norm)),
            _ => Cow::Borrowed(name),
        }
    }

    /// (stored tensor, first row, rows, rows the stored tensor must have) of a split name.
    fn part_of(&self, name: &str) -> Option<(String, usize, usize, usize)> {
        if !self.fused {
            return None;
        }
        let (layer, tail) = name.strip_prefix("blk.")?.split_once('.')?;
        let (q, kv, ff) = (self.q_rows, self.kv_rows, self.ff_rows);
        let (stored, first, rows, total) = match tail {
            "attn_q.weight" => ("attn_qkv.weight", 0, q, q + 2 * kv),
            "attn_k.weight" => ("attn_qkv.weight", q, kv, q + 2 * kv),
            "attn_v.weight" => ("attn_qkv.weight", q + kv, kv, q + 2 * kv),
            "ffn_gate.weight" => ("ffn_up.weight", 0, ff, 2 * ff),
            "ffn_up.weight" => ("ffn_up.weight", ff, ff, 2 * ff),
            _ => return None,
        };
        Some((format!("blk.{layer}.{stored}"), first, rows, total))
    }
}

impl TensorSource for Unfused {
    fn load(&self, name: &str) -> Result<Option<LoadedTensor>> {
        if self.part_of(name).is_none() {
            return self.inner.load(&self.stored_name(name));
        }
        self.raw(name)?.map(|t| t.decode()).transpose()
    }

    fn label(&self) -> String {
        self.inner.label()
    }

    fn n_elements(&self) -> Result<u64> {
        self.inner.n_elements()
    }

    fn n_bytes(&self) -> Result<u64> {
        self.inner.n_bytes()
    }

    fn raw(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        let Some((stored, first, rows, total)) = self.part_of(name) else { return self.inner.raw(&self.stored_name(name)) };
        let Some(t) = self.inner.raw(&stored)? else { return Ok(None) };
        let (cols, block) = (t.dims.first().copied().unwrap_or(0), t.ty.block_size());
        if t.dims.len() != 2 || t.dims[1] != total || !cols.is_multiple_of(block) {
            return Err(OracleError::Spec(format!(
                "{}: tensor `{stored}` has dims {:?}, expected [n_embd, {total}] rows of whole {} blocks to split into `{name}`",
                self.label(),
                t.dims,
                t.ty.name()
            )));
        }
        let row_bytes = cols / block * t.ty.type_size();
        let range = first * row_bytes..(first + rows) * row_bytes;
        let bytes = match t.bytes {
            Cow::Borrowed(b) => Cow::Borrowed(&b[range]),
            Cow::Owned(b) => Cow::Owned(b[range].to_vec()),
        };
        Ok(Some(RawTensor { dims: vec![cols, rows], ty: t.ty, bytes }))
    }
}

/// `src` (a GGUF file or a checkpoint) as the interpreter and the devices read it: Phi-3's
/// fused tensors split, GPT-OSS's FFN norm under `ffn_norm.weight`.
fn unfused(src: Box<dyn TensorSource>, spec: &ModelSpec) -> Box<dyn TensorSource> {
    if Unfused::needed(spec) {
        Box::new(Unfused::new(src, spec))
    } else {
        src
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_map_both_ways() {
        for hf in ["model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.o_proj.bias", "model.layers.17.mlp.down_proj.weight"] {
            let g = hf_to_gguf_name(hf).unwrap();
            assert_eq!(gguf_to_hf_name(&g).as_deref(), Some(hf), "{g}");
        }
        assert_eq!(hf_to_gguf_name("model.layers.3.self_attn.q_norm.weight").as_deref(), Some("blk.3.attn_q_norm.weight"));
        for unknown in ["model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.x.mlp.up_proj.weight", "model.layers.0.mlp.experts.0.up_proj.weight", "blk.0.attn_q.weight"] {
            assert_eq!(hf_to_gguf_name(unknown), None, "{unknown}");
        }
        assert_eq!(gguf_to_hf_name("blk.0.ffn_gate_exps.weight"), None);
        // MoE: routers of both families, the shared expert, and experts as parts of stacked tensors.
        assert_eq!(hf_to_gguf_name("model.layers.2.mlp.gate.weight").as_deref(), Some("blk.2.ffn_gate_inp.weight"));
        assert_eq!(hf_to_gguf_name("model.layers.2.block_sparse_moe.gate.weight").as_deref(), Some("blk.2.ffn_gate_inp.weight"));
        assert_eq!(gguf_to_hf_name("blk.2.ffn_gate_inp_shexp.weight").as_deref(), Some("model.layers.2.mlp.shared_expert_gate.weight"));
        assert_eq!(hf_expert_part("model.layers.4.mlp.experts.17.down_proj.weight"), Some(("blk.4.ffn_down_exps.weight".into(), 17)));
        assert_eq!(hf_expert_part("model.layers.0.block_sparse_moe.experts.3.w3.weight"), Some(("blk.0.ffn_up_exps.weight".into(), 3)));
        for not_expert in ["model.layers.0.mlp.experts.x.up_proj.weight", "model.layers.0.mlp.experts.1.w1.weight", "model.layers.0.mlp.up_proj.weight"] {
            assert_eq!(hf_expert_part(not_expert), None, "{not_expert}");
        }
        assert_eq!(
            hf_fused_experts("model.layers.1.mlp.experts.gate_up_proj"),
            Some(vec![("blk.1.ffn_gate_exps.weight".into(), Some(0)), ("blk.1.ffn_up_exps.weight".into(), Some(1))])
        );
        assert_eq!(hf_fused_experts("model.layers.1.mlp.experts.down_proj"), Some(vec![("blk.1.ffn_down_exps.weight".into(), None)]));
        assert_eq!(hf_fused_experts("model.layers.1.mlp.experts.up_proj"), None);
    }

    #[test]
    fn a_raw_tensor_splits_into_parts_of_whole_blocks_or_says_why() {
        // Q8_0 blocks are 34 bytes: 4 blocks split into 2 or 4 parts, not 3, 8 or 0.
        let t = RawTensor { dims: vec![32, 4, 1], ty: GgmlType::Q8_0, bytes: Cow::Owned((0..136).map(|i| i as u8).collect()) };
        let two: Vec<&[u8]> = t.parts(2).unwrap().collect();
        assert_eq!((two.len(), two[1][0]), (2, 68));
        assert_eq!(t.parts(4).unwrap().count(), 4);
        for bad in [3, 8, 0] {
            let e = t.parts(bad).expect_err("refused");
            assert!(e.contains("136 bytes") && e.contains(&format!("{bad} parts")), "{e}");
        }
    }

    #[test]
    fn a_fused_gate_up_tensor_splits_into_each_experts_gate_and_up_rows() {
        // Two experts, 2 gate + 2 up rows each, rows of 3 F32 values; value = 100 e + 10 row + col.
        let v: Vec<f32> = (0..2).flat_map(|e| (0..4).flat_map(move |r| (0..3).map(move |c| (100 * e + 10 * r + c) as f32))).collect();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let f32s = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<f32>>();
        let (dims, gate) = half_of_each_expert(vec![3, 4, 2], GgmlType::F32, &bytes, 0).unwrap();
        assert_eq!(dims, [3, 2, 2]);
        assert_eq!(f32s(&gate), [0., 1., 2., 10., 11., 12., 100., 101., 102., 110., 111., 112.]);
        let (_, up) = half_of_each_expert(vec![3, 4, 2], GgmlType::F32, &bytes, 1).unwrap();
        assert_eq!(f32s(&up), [20., 21., 22., 30., 31., 32., 120., 121., 122., 130., 131., 132.]);
        assert!(half_of_each_expert(vec![3, 3, 2], GgmlType::F32, &bytes[..72], 0).is_none(), "odd row count");
        // A 2-D tensor is one dense FFN's gate and up (Granite 4.0-H's shared MLP).
        let (dims, up) = half_of_each_expert(vec![3, 4], GgmlType::F32, &bytes[..48], 1).unwrap();
        assert_eq!((dims, f32s(&up)), (vec![3, 2], vec![20., 21., 22., 30., 31., 32.]));
        assert!(half_of_each_expert(vec![3, 3], GgmlType::F32, &bytes[..36], 0).is_none(), "odd row count, 2-D");
        assert!(half_of_each_expert(vec![3, 2, 2, 1], GgmlType::F32, &bytes, 0).is_none(), "4-D");
    }

    #[test]
    fn experts_stored_both_fused_and_one_by_one_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = r#"{"model_type": "qwen3_moe", "hidden_size": 4, "num_attention_heads": 1, "head_dim": 4, "num_hidden_layers": 1,
            "vocab_size": 2, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 2}"#;
        std::fs::write(dir.path().join("config.json"), cfg).unwrap();
        let fused = vec![0u8; 2 * 4 * 4 * 4];
        let one = vec![0u8; 2 * 4 * 4];
        let views = [
            ("model.layers.0.mlp.experts.gate_up_proj", safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 4, 4], &fused).unwrap()),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 4], &one).unwrap()),
        ];
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
        let e = SafetensorsDir::open(dir.path()).err().expect("refused").to_string();
        assert!(e.contains("`blk.0.ffn_gate_exps.weight` is stored twice, fused as `model.layers.0.mlp.experts.gate_up_proj` and per expert as `model.layers.0.mlp.experts.0.gate_proj.weight`"), "{e}");
    }

    /// A header entry whose shape does not fit its bytes: the safetensors crate's message names
    /// no tensor; the loader's names it, its shape and what its offsets hold.
    #[test]
    fn a_tensor_whose_shape_does_not_fit_its_bytes_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), r#"{"model_type": "llama", "hidden_size": 4, "intermediate_size": 2, "num_attention_heads": 1, "num_hidden_layers": 1, "vocab_size": 2}"#).unwrap();
        let write = |header: &str, data_len: usize| {
            let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(header.as_bytes());
            bytes.resize(bytes.len() + data_len, 0);
            std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
            SafetensorsDir::open(dir.path()).err().expect("refused").to_string()
        };
        let ok = r#"{"model.norm.weight":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"lm_head.weight":{"dtype":"F32","shape":[2,4],"data_offsets":[16,48]}}"#;
        assert_eq!(invalid_tensor_entry(&std::fs::read(dir.path().join("config.json")).unwrap()), None, "not a safetensors file: no entry to name");
        let e = write(&ok.replace("[2,4]", "[4,4]"), 48);
        assert!(e.contains("tensor `lm_head.weight`: shape [4, 4] of F32 needs 64 bytes, its data_offsets [16, 48] hold 32"), "{e}");
        let e = write(&ok.replace("[2,4]", "[4611686018427387904,4]"), 48);
        assert!(e.contains("tensor `lm_head.weight`: shape [4611686018427387904, 4] of F32 overflows"), "{e}");
        let e = write(&ok.replace(r#""F32","shape":[4]"#, r#""F16","shape":[4]"#), 48);
        assert!(e.contains("tensor `model.norm.weight`: shape [4] of F16 needs 8 bytes, its data_offsets [0, 16] hold 16"), "{e}");
        // One tensor in two shards: refused, naming both files (else the last one sorted won).
        let mut bytes = (ok.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(ok.as_bytes());
        bytes.resize(bytes.len() + 48, 0);
        std::fs::write(dir.path().join("model.safetensors"), &bytes).unwrap();
        std::fs::write(dir.path().join("model-2.safetensors"), &bytes).unwrap();
        let e = SafetensorsDir::open(dir.path()).err().expect("refused").to_string();
        assert!(e.contains("is in both") && e.contains("model-2.safetensors") && e.contains("model.safetensors"), "{e}");
    }
}
