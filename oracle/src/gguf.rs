//! A small, bounds-checked GGUF (v2/v3) reader and a writer.
//!
//! The reader treats every file as hostile: each length, count, dimension and offset is checked
//! against the bytes that remain before anything is allocated or sliced, and every failure names
//! the field and the byte offset where it was found. It never panics on input.
//!
//! Layout (all little-endian): magic `GGUF`, version u32, tensor_count u64, kv_count u64,
//! kv_count x (key: string, type: u32, value), tensor_count x (name: string, n_dims: u32,
//! dims: u64 x n_dims, type: u32, offset: u64), padding to `general.alignment` (default 32),
//! then the tensor data; each tensor's offset is relative to the data start and aligned.

use crate::error::{OracleError, Result};
use crate::quant::GgmlType;
use std::collections::BTreeMap;
use std::path::Path;

pub const GGUF_MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Largest tensor rank GGML has.
pub const MAX_DIMS: usize = 4;
/// Longest metadata key or tensor name we accept (GGUF itself says 65535).
pub const MAX_NAME_LEN: u64 = 65_535;
/// Deepest nesting of arrays inside arrays.
const MAX_ARRAY_DEPTH: usize = 4;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => 0,
            Value::I8(_) => 1,
            Value::U16(_) => 2,
            Value::I16(_) => 3,
            Value::U32(_) => 4,
            Value::I32(_) => 5,
            Value::F32(_) => 6,
            Value::Bool(_) => 7,
            Value::String(_) => 8,
            Value::Array(_) => 9,
            Value::U64(_) => 10,
            Value::I64(_) => 11,
            Value::F64(_) => 12,
        }
    }

    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }

    /// The value as a float, if it is any number.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            Value::I8(v) => Some(v as f64),
            Value::I16(v) => Some(v as f64),
            Value::I32(v) => Some(v as f64),
            Value::I64(v) => Some(v as f64),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's description from the header.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// GGML order: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub file_offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file whose tensor data stays memory-mapped.
pub struct GgufFile {
    pub path: String,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_offset: u64,
    bytes: Bytes,
}

pub(crate) enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

struct Cursor<'a> {
    file: &'a str,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, field: &str, offset: usize, reason: impl Into<String>) -> OracleError {
        OracleError::Gguf {
            file: self.file.to_string(),
            field: field.to_string(),
            offset: offset as u64,
            reason: reason.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.err(
                field,
                self.pos,
                format!("truncated: needs {} bytes, only {} remain", n, self.remaining()),
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, f: &str) -> Result<u8> {
        Ok(self.take(1, f)?[0])
    }
    fn u16(&mut self, f: &str) -> Result<u16> {
        let b = self.take(2, f)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self, f: &str) -> Result<u32> {
        let b = self.take(4, f)?;
        Ok(u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, f: &str) -> Result<u64> {
        let b = self.take(8, f)?;
        Ok(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    }

    fn string(&mut self, field: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(field)?;
        if len > MAX_NAME_LEN.max(1 << 24) || len as usize > self.remaining() {
            return Err(self.err(
                field,
                at,
                format!("string length {} exceeds the {} bytes that remain", len, self.remaining()),
            ));
        }
        let b = self.take(len as usize, field)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err(field, at + 8, "string is not valid UTF-8"))
    }

    fn value(&mut self, ty: u32, field: &str, depth: usize) -> Result<Value> {
        let at = self.pos;
        Ok(match ty {
            0 => Value::U8(self.u8(field)?),
            1 => Value::I8(self.u8(field)? as i8),
            2 => Value::U16(self.u16(field)?),
            3 => Value::I16(self.u16(field)? as i16),
            4 => Value::U32(self.u32(field)?),
            5 => Value::I32(self.u32(field)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(field)?)),
            7 => match self.u8(field)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(field, at, format!("bool byte is {b}, expected 0 or 1"))),
            },
            8 => Value::String(self.string(field)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(field, at, "arrays nested too deeply"));
                }
                let item_ty = self.u32(field)?;
                let n_at = self.pos;
                let n = self.u64(field)?;
                let min_item = match item_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10 | 11 | 12 => 8,
                    9 => 12,
                    t => return Err(self.err(field, at, format!("unknown array item type {t}"))),
                };
                // Refuse counts the remaining bytes cannot hold before allocating anything.
                if n.checked_mul(min_item).is_none_or(|need| need > self.remaining() as u64) {
                    return Err(self.err(
                        field,
                        n_at,
                        format!("array of {n} items of type {item_ty} cannot fit in the {} bytes that remain", self.remaining()),
                    ));
                }
                let mut items = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    items.push(self.value(item_ty, field, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(field)?),
            11 => Value::I64(self.u64(field)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(field)?)),
            t => return Err(self.err(field, at, format!("unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and memory-maps a GGUF file, validating the whole header.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let file = crate::files::open(path)?;
        // SAFETY: the map is read-only; a file truncated under us by another process is the one
        // case memory maps cannot defend against, as for every mmap-based loader.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| OracleError::io(path, e))?;
        Self::parse(path.display().to_string(), Bytes::Mapped(map))
    }

    /// Parses a GGUF image held in memory (used by tests and by the fuzz corpus).
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(name.to_string(), Bytes::Owned(bytes))
    }

    fn parse(path: String, bytes: Bytes) -> Result<GgufFile> {
        let (version, metadata, tensors, alignment, data_offset) = {
            let mut c = Cursor {
                file: &path,
                bytes: bytes.as_slice(),
                pos: 0,
            };
            let magic = c.take(4, "magic")?;
            if magic != GGUF_MAGIC {
                return Err(c.err("magic", 0, format!("expected \"GGUF\", found {:?}", magic)));
            }
            let version = c.u32("version")?;
            if version != 2 && version != 3 {
                return Err(c.err("version", 4, format!("unsupported GGUF version {version} (2 and 3 are read)")));
            }
            let tensor_count = c.u64("tensor_count")?;
            let kv_count = c.u64("metadata_kv_count")?;
            // Each kv needs at least 8 (key len) + 4 (type) + 1 bytes; each tensor info at least 8+4+8+4+8.
            if kv_count > c.remaining() as u64 / 13 {
                return Err(c.err("metadata_kv_count", 16, format!("{kv_count} entries cannot fit in a file of {} bytes", c.bytes.len())));
            }
            if tensor_count > c.remaining() as u64 / 32 {
                return Err(c.err("tensor_count", 8, format!("{tensor_count} tensors cannot fit in a file of {} bytes", c.bytes.len())));
            }
            let mut metadata = BTreeMap::new();
            for i in 0..kv_count {
                let key_at = c.pos;
                let key = c.string(&format!("metadata[{i}].key"))?;
                let ty = c.u32(&format!("{key}.type"))?;
                let v = c.value(ty, &key, 0)?;
                if metadata.insert(key.clone(), v).is_some() {
                    return Err(c.err(&key, key_at, "duplicate metadata key"));
                }
            }
            let alignment = match metadata.get("general.alignment") {
                None => DEFAULT_ALIGNMENT,
                Some(v) => match v.as_u64() {
                    Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a,
                    _ => return Err(c.err("general.alignment", 0, format!("alignment {v:?} is not a power of two up to 1 MiB"))),
                },
            };
            let mut raw = Vec::with_capacity(tensor_count as usize);
            for i in 0..tensor_count {
                let info_at = c.pos;
                let name = c.string(&format!("tensor[{i}].name"))?;
                let field = |f: &str| format!("tensor `{name}`.{f}");
                let n_dims_at = c.pos;
                let n_dims = c.u32(&field("n_dims"))? as usize;
                if n_dims == 0 || n_dims > MAX_DIMS {
                    return Err(c.err(&field("n_dims"), n_dims_at, format!("{n_dims} dimensions (1..={MAX_DIMS} allowed)")));
                }
                let mut dims = Vec::with_capacity(n_dims);
                let mut n_el: u64 = 1;
                for d in 0..n_dims {
                    let at = c.pos;
                    let v = c.u64(&field(&format!("dims[{d}]")))?;
                    if v == 0 {
                        return Err(c.err(&field(&format!("dims[{d}]")), at, "dimension is zero"));
                    }
                    n_el = n_el.checked_mul(v).ok_or_else(|| c.err(&field(&format!("dims[{d}]")), at, "element count overflows u64"))?;
                    dims.push(v);
                }
                let ty_at = c.pos;
                let ty_id = c.u32(&field("type"))?;
                let ty = GgmlType::from_id(ty_id).ok_or_else(|| {
                    let named = GgmlType::ggml_name(ty_id).map(|n| format!(" ({n})")).unwrap_or_default();
                    let known: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
                    c.err(&field("type"), ty_at, format!("unsupported tensor type id {ty_id}{named}; this tool decodes {}", known.join(", ")))
                })?;
                if dims[0] % ty.block_size() as u64 != 0 {
                    return Err(c.err(&field("dims[0]"), n_dims_at + 4, format!("row length {} is not a multiple of the {} block size {}", dims[0], ty.name(), ty.block_size())));
                }
                let n_bytes = ty
                    .bytes_for(n_el)
                    .ok_or_else(|| c.err(&field("dims"), n_dims_at, "tensor size overflows u64"))?;
                let off_at = c.pos;
                let offset = c.u64(&field("offset"))?;
                if offset % alignment != 0 {
                    return Err(c.err(&field("offset"), off_at, format!("offset {offset} is not a multiple of the alignment {alignment}")));
                }
                let _ = info_at;
                raw.push((name, dims, ty, offset, n_bytes, off_at));
            }
            let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
            let file_len = c.bytes.len() as u64;
            if data_offset > file_len && tensor_count > 0 {
                return Err(c.err("tensor_data", c.pos, format!("data section starts at {data_offset}, past the end of the {file_len}-byte file")));
            }
            let mut tensors = Vec::with_capacity(raw.len());
            let mut seen = std::collections::HashSet::new();
            for (name, dims, ty, offset, n_bytes, off_at) in raw {
                let start = data_offset.checked_add(offset);
                let end = start.and_then(|s| s.checked_add(n_bytes));
                match end {
                    Some(e) if e <= file_len => {}
                    _ => {
                        return Err(c.err(
                            &format!("tensor `{name}`.offset"),
                            off_at,
                            format!("data [{}+{offset}, +{n_bytes} bytes) runs past the end of the {file_len}-byte file", data_offset),
                        ))
                    }
                }
                if !seen.insert(name.clone()) {
                    return Err(c.err(&format!("tensor `{name}`.name"), off_at, "duplicate tensor name"));
                }
                tensors.push(TensorInfo {
                    name,
                    dims,
                    ty,
                    file_offset: data_offset + offset,
                    n_bytes,
                });
            }
            (version, metadata, tensors, alignment, data_offset)
        };
        Ok(GgufFile {
            path,
            version,
            metadata,
            tensors,
            alignment,
            data_offset,
            bytes,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor (bounds were checked at parse time).
    pub fn tensor_bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.bytes.as_slice()[info.file_offset as usize..(info.file_offset + info.n_bytes) as usize]
    }

    /// The tensor's bytes for a loader that keeps them packed, refused when any value decodes to NaN
    /// or an infinity (naming the file, tensor, element, row and column), as the oracle refuses it.
    pub fn weight_bytes(&self, info: &TensorInfo) -> Result<&[u8]> {
        crate::quant::finite_weight(&self.path, &info.name, info.ty, self.tensor_bytes(info), info.dims.first().copied().unwrap_or(1) as usize)
    }

    /// Decodes a whole tensor to f32.
    pub fn tensor_f32(&self, info: &TensorInfo) -> Result<Vec<f32>> {
        crate::quant::decode(info.ty, self.tensor_bytes(info), info.n_elements() as usize)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// `key`'s value read by `read`, None when absent. A value present with another type is an
    /// error (a message naming the file, the key and what was expected), never None: a default
    /// in place of what the file states would change the model without a word.
    pub fn field<'a, T>(&'a self, key: &str, read: impl Fn(&'a Value) -> Option<T>, expected: &str) -> std::result::Result<Option<T>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => read(v).map(Some).ok_or_else(|| format!("{}: metadata `{key}` is {v:?}, expected {expected}", self.path)),
        }
    }

    /// Size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }
}

/// Builds a GGUF v3 file in memory.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn meta(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor whose `dims` are in GGML order (`dims[0]` = row length) and whose `data` is
    /// already encoded as `ty`.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        self.tensors.push((name.to_string(), dims.to_vec(), ty, data));
        self
    }

    fn write_str(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u64).to_le_bytes());
        out.extend_from_slice(s.as_bytes());
    }

    fn write_value(out: &mut Vec<u8>, v: &Value) {
        match v {
            Value::U8(x) => out.push(*x),
            Value::I8(x) => out.push(*x as u8),
            Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::Bool(x) => out.push(*x as u8),
            Value::String(s) => Self::write_str(out, s),
            Value::Array(items) => {
                let item_ty = items.first().map(|i| i.type_id()).unwrap_or(4);
                out.extend_from_slice(&item_ty.to_le_bytes());
                out.extend_from_slice(&(items.len() as u64).to_le_bytes());
                for i in items {
                    Self::write_value(out, i);
                }
            }
            Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
            Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        }
    }

    /// Serializes to GGUF v3 bytes with 32-byte alignment.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(GGUF_MAGIC);
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            Self::write_str(&mut out, k);
            out.extend_from_slice(&v.type_id().to_le_bytes());
            Self::write_value(&mut out, v);
        }
        let align = DEFAULT_ALIGNMENT;
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            Self::write_str(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len() as u64).div_ceil(align) * align;
        }
        let data_start = (out.len() as u64).div_ceil(align) * align;
        out.resize(data_start as usize, 0);
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize((data_start + off) as usize, 0);
            out.extend_from_slice(data);
        }
        out
    }

    /// Writes atomically: a temporary file beside `path`, then a rename.
    pub fn write_to(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("gguf.tmp");
        std::fs::write(&tmp, self.to_bytes()).map_err(|e| OracleError::io(&tmp, e))?;
        std::fs::rename(&tmp, path).map_err(|e| OracleError::io(path, e))
    }
}
