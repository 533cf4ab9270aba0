//! Kernel cases written to a directory and read back: a repro that travels with a bug report.
//!
//! The directory is an op-protocol batch (docs/OP_PROTOCOL.md) — `cases.json` and
//! `inputs.safetensors`, so an engine runs it as it runs any batch — plus `expected.safetensors`,
//! the oracle's outputs under the names `cases.json` gives them (for the engine's author; a rerun
//! judges against the oracle's own run, never against this file). Read back, every case is
//! checked against the registry's form of its op (the same inputs, of the same kinds, and the
//! same parameters) and every tensor against its declared dtype and shape, before anything runs.

use crate::ops_protocol::{write_batch, write_safetensors, OutputSpec, OwnedTensor, PROTOCOL, VERSION};
use oracle::quant::GgmlType;
use oracle::registry::{registry, Input, Op, OpCase, Output, Tensor};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::OnceLock;

/// The largest `cases.json` read, and the most cases one directory holds.
const JSON_LIMIT: u64 = 64 << 20;
const MAX_CASES: usize = 100_000;

/// Writes `cases` with the oracle's outputs `expected` (one list per case) to `dir` (created).
pub fn write_cases(dir: &Path, cases: &[OpCase], expected: &[Vec<Output>]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let batch: Vec<(&OpCase, Vec<OutputSpec>)> = cases.iter().zip(expected).map(|(c, o)| (c, o.iter().map(OutputSpec::of).collect())).collect();
    write_batch(dir, &batch)?;
    let mut owned: Vec<OwnedTensor> = Vec::new();
    for (i, outs) in expected.iter().enumerate() {
        for (j, o) in outs.iter().enumerate() {
            let (dtype, shape, bytes) = match o {
                Output::F32(t) => (safetensors::Dtype::F32, t.shape.clone(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect()),
                Output::Ids(v) => (safetensors::Dtype::U32, vec![v.len()], v.iter().flat_map(|v| v.to_le_bytes()).collect()),
            };
            owned.push((format!("{i}.out{j}"), dtype, shape, bytes));
        }
    }
    write_safetensors(&dir.join("expected.safetensors"), &owned)
}

#[derive(serde::Deserialize)]
struct CasesFile {
    protocol: String,
    version: u32,
    cases: Vec<CaseEntry>,
}

#[derive(serde::Deserialize)]
struct CaseEntry {
    id: String,
    op: Op,
    seed: u64,
    #[serde(default)]
    params: BTreeMap<String, f64>,
    inputs: Vec<InputEntry>,
}

#[derive(serde::Deserialize)]
struct InputEntry {
    name: String,
    tensor: String,
    dtype: String,
    shape: Vec<usize>,
    #[serde(default)]
    ggml_type: Option<String>,
}

/// The registry's names (inputs and parameters) as `'static` strings, as `OpCase` holds them.
fn known_names() -> &'static BTreeSet<&'static str> {
    static NAMES: OnceLock<BTreeSet<&'static str>> = OnceLock::new();
    NAMES.get_or_init(|| forms().values().flat_map(|f| f.inputs.iter().map(|(n, _)| *n).chain(f.params.iter().copied())).collect())
}

/// An op's form in the registry: its inputs (name and kind) and parameter names, as its first
/// case has them.
struct Form {
    inputs: Vec<(&'static str, &'static str)>,
    params: BTreeSet<&'static str>,
}

fn kind(i: &Input) -> &'static str {
    match i {
        Input::F32(_) => "f32",
        Input::Ids(_) => "u32",
        Input::Quant { .. } => "ggml",
    }
}

fn forms() -> &'static BTreeMap<Op, Form> {
    static FORMS: OnceLock<BTreeMap<Op, Form>> = OnceLock::new();
    FORMS.get_or_init(|| {
        registry()
            .into_iter()
            .filter_map(|e| {
                let c = (e.cases)(0).into_iter().next()?;
                Some((e.op, Form { inputs: c.inputs.iter().map(|(n, i)| (*n, kind(i))).collect(), params: c.params.keys().copied().collect() }))
            })
            .collect()
    })
}

/// Reads the cases of a directory [`write_cases`] wrote (or any op-protocol batch): each checked
/// against its op's form and its tensors against their declarations, errors naming the file, the
/// case and the field.
pub fn read_cases(dir: &Path) -> Result<Vec<OpCase>, String> {
    let cpath = dir.join("cases.json");
    let len = std::fs::metadata(&cpath).map_err(|e| format!("{}: {e}", cpath.display()))?.len();
    if len > JSON_LIMIT {
        return Err(format!("{}: {len} bytes (at most {JSON_LIMIT})", cpath.display()));
    }
    let text = std::fs::read(&cpath).map_err(|e| format!("{}: {e}", cpath.display()))?;
    let file: CasesFile = serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", cpath.display()))?;
    if file.protocol != PROTOCOL || file.version != VERSION {
        return Err(format!("{}: protocol {:?} version {} (this reads {PROTOCOL} version {VERSION})", cpath.display(), file.protocol, file.version));
    }
    if file.cases.is_empty() || file.cases.len() > MAX_CASES {
        return Err(format!("{}: {} cases (1 to {MAX_CASES})", cpath.display(), file.cases.len()));
    }
    let ipath = dir.join("inputs.safetensors");
    let bytes = std::fs::read(&ipath).map_err(|e| format!("{}: {e}", ipath.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| format!("{}: {e}", ipath.display()))?;
    let mut ids = BTreeSet::new();
    file.cases.iter().map(|c| {
        let at = |what: String| format!("{}: case `{}`: {what}", cpath.display(), c.id);
        if !ids.insert(c.id.as_str()) {
            return Err(at("a second case of this id".into()));
        }
        read_case(c, &st).map_err(at)
    }).collect()
}

fn read_case(c: &CaseEntry, st: &safetensors::SafeTensors) -> Result<OpCase, String> {
    let form = forms().get(&c.op).ok_or_else(|| format!("op `{}` has no case in the registry", c.op))?;
    let names = known_names();
    let intern = |n: &str| names.get(n).copied();
    let given: Vec<(&str, &str)> = c.inputs.iter().map(|i| (i.name.as_str(), i.dtype.as_str())).collect();
    if given.len() != form.inputs.len() || given.iter().zip(&form.inputs).any(|(g, f)| g.0 != f.0 || g.1 != f.1) {
        let show = |v: &[(&str, &str)]| v.iter().map(|(n, k)| format!("{n} ({k})")).collect::<Vec<_>>().join(", ");
        return Err(format!("inputs {}; `{}` takes {}", show(&given), c.op, show(&form.inputs)));
    }
    let params: BTreeSet<&str> = c.params.keys().map(String::as_str).collect();
    if params != form.params.iter().copied().collect() {
        return Err(format!("parameters {params:?}; `{}` takes {:?}", c.op, form.params));
    }
    if let Some((k, v)) = c.params.iter().find(|(_, v)| !v.is_finite()) {
        return Err(format!("parameter `{k}` is {v}"));
    }
    let mut inputs = Vec::with_capacity(c.inputs.len());
    for i in &c.inputs {
        let name = intern(&i.name).ok_or_else(|| format!("input `{}`", i.name))?;
        let t = st.tensor(&i.tensor).map_err(|_| format!("input `{}`: no tensor `{}` in inputs.safetensors", i.name, i.tensor))?;
        let n = i.shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d)).ok_or_else(|| format!("input `{}`: shape {:?} overflows", i.name, i.shape))?;
        let input = match i.dtype.as_str() {
            "f32" if t.dtype() == safetensors::Dtype::F32 && t.shape() == i.shape.as_slice() => {
                Input::F32(Tensor { shape: i.shape.clone(), data: t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect() })
            }
            "u32" if t.dtype() == safetensors::Dtype::U32 && t.shape() == i.shape.as_slice() && i.shape.len() == 1 => {
                Input::Ids(t.data().chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
            }
            "ggml" if t.dtype() == safetensors::Dtype::U8 && i.shape.len() == 2 => {
                let ty = i.ggml_type.as_deref().and_then(GgmlType::from_name).ok_or_else(|| format!("input `{}`: ggml_type {:?} is not a GGML type", i.name, i.ggml_type))?;
                let want = ty.bytes_for(n as u64).filter(|b| i.shape[1].is_multiple_of(ty.block_size()) && *b == t.data().len() as u64);
                if want.is_none() {
                    return Err(format!("input `{}`: {} bytes for [{}, {}] of {}", i.name, t.data().len(), i.shape[0], i.shape[1], ty.name()));
                }
                Input::Quant { ty, rows: i.shape[0], cols: i.shape[1], bytes: t.data().to_vec() }
            }
            _ => return Err(format!("input `{}`: declared {} {:?}, stored {:?} {:?}", i.name, i.dtype, i.shape, t.dtype(), t.shape())),
        };
        inputs.push((name, input));
    }
    let params = c.params.iter().map(|(k, v)| Ok((intern(k).ok_or_else(|| format!("parameter `{k}`"))?, *v))).collect::<Result<_, String>>()?;
    Ok(OpCase { op: c.op, id: c.id.clone(), seed: c.seed, inputs, params })
}
