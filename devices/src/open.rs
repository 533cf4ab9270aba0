//! Opening a device by name: the names `open` reads, the devices a process opened, the
//! nearest name to a misspelt one.

use crate::{cpu, external, fixed, gpu, reference, slowed, Device, DeviceError, KvFormat, KvTypes};

/// Opens a device by name, or says why it is unavailable: [`DeviceSpec`]'s parse, then
/// [`open_spec`].
pub fn open(name: &str) -> Result<Box<dyn Device>, DeviceError> {
    open_spec(&name.parse()?)
}

/// Opens a parsed device, or says why it is unavailable (a GPU not compiled in or absent, a
/// dump directory that is not there). Every device opened is remembered with its description
/// (see [`opened`]).
pub fn open_spec(spec: &DeviceSpec) -> Result<Box<dyn Device>, DeviceError> {
    let d = open_kind(&spec.name, &spec.kind)?;
    OPENED.lock().unwrap_or_else(|e| e.into_inner()).insert(d.name(), d.describe());
    Ok(d)
}

/// A device as named (`--device cpu:kv-q8_0`), parsed once where the name enters: every
/// command's `--device` is parsed by clap into one, so an unknown or malformed name is refused
/// with the arguments (and the name that was meant); [`open_spec`] then opens what it says.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceSpec {
    name: String,
    kind: DeviceKind,
}

/// What a device name says.
#[derive(Clone, Debug, PartialEq)]
pub enum DeviceKind {
    /// The oracle itself.
    Ref,
    /// The `cpu` device with its KV cache formats.
    Cpu(KvTypes),
    Fixed { int4: bool },
    /// `gpu-emu[...]`, `cuda[:N]`, `rocm[:N]`: the name, whose options the GPU device reads.
    Gpu,
    /// `external:DIR`, `exec:CMD`, `ids:CMD`: an engine outside this tool.
    External,
    /// `DEVICE+slow=PCT`: a built-in device slowed by a busy wait (for the A/B tests).
    Slowed { base: Box<DeviceSpec>, fraction: f64 },
}

impl DeviceSpec {
    /// The name as given.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn kind(&self) -> &DeviceKind {
        &self.kind
    }

    /// Whether this is the oracle (`ref`).
    pub fn is_ref(&self) -> bool {
        self.kind == DeviceKind::Ref
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = DeviceError;
    fn from_str(name: &str) -> Result<DeviceSpec, DeviceError> {
        let malformed = |why: String| DeviceError::Malformed { name: name.to_string(), why };
        let spec = |kind| Ok(DeviceSpec { name: name.to_string(), kind });
        // Command lines of external engines may hold anything; only built-in devices take +slow=.
        let external = ["external:", "exec:", "ids:"].iter().any(|p| name.starts_with(p));
        if !external {
            match slowed::parse(name) {
                Some(Ok((base, fraction))) => return spec(DeviceKind::Slowed { base: Box::new(base.parse()?), fraction }),
                Some(Err(why)) => return Err(malformed(why)),
                None => {}
            }
        }
        match name {
            "ref" => spec(DeviceKind::Ref),
            "cpu" => spec(DeviceKind::Cpu(KvTypes::default())),
            n if n.starts_with("cpu:kv-") => match KvTypes::parse(&n["cpu:kv-".len()..]) {
                Some(kv) => spec(DeviceKind::Cpu(kv)),
                None => Err(malformed(format!("unknown KV cache format (cpu:kv-TYPE, or cpu:kv-K-V for keys and values apart, takes {})", KvFormat::names()))),
            },
            "fixed" => spec(DeviceKind::Fixed { int4: false }),
            "fixed-int4" => spec(DeviceKind::Fixed { int4: true }),
            n if n.starts_with("gpu-emu") || n.starts_with("cuda") || n.starts_with("rocm") => spec(DeviceKind::Gpu),
            "external:" | "exec:" | "ids:" => Err(malformed("give a dump directory (external:DIR) or a command (exec:CMD, ids:CMD)".into())),
            _ if external => spec(DeviceKind::External),
            _ => Err(DeviceError::Unknown { name: name.to_string(), suggestion: suggest_device(name) }),
        }
    }
}

fn open_kind(name: &str, kind: &DeviceKind) -> Result<Box<dyn Device>, DeviceError> {
    let unavailable = |why: String| Err(DeviceError::Unavailable(name.to_string(), why));
    match kind {
        DeviceKind::Ref => Ok(Box::new(reference::RefDevice)),
        DeviceKind::Cpu(kv) => Ok(Box::new(cpu::CpuDevice { kv_cache: *kv })),
        DeviceKind::Fixed { int4 } => Ok(Box::new(fixed::FixedDevice { int4: *int4 })),
        DeviceKind::Gpu => gpu::open(name),
        DeviceKind::External => match external::ExternalDevice::parse(name) {
            Some(Ok(d)) => Ok(Box::new(d)),
            Some(Err(why)) => unavailable(why),
            None => unavailable("not an engine name (external:DIR, exec:CMD, ids:CMD)".into()),
        },
        DeviceKind::Slowed { base, fraction } => Ok(Box::new(slowed::SlowedDevice { inner: open_kind(&base.name, &base.kind)?, fraction: *fraction })),
    }
}

static OPENED: std::sync::Mutex<std::collections::BTreeMap<String, String>> = std::sync::Mutex::new(std::collections::BTreeMap::new());

/// The devices this process opened: name -> description (for report provenance).
pub fn opened() -> std::collections::BTreeMap<String, String> {
    OPENED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// The built-in devices named by one word, and the prefixes of the others (parameterised
/// built-ins and external engines), as [`open`] reads them.
pub const BUILTIN_NAMES: [&str; 4] = ["ref", "cpu", "fixed", "fixed-int4"];
pub const DEVICE_PREFIXES: [&str; 7] = ["cpu:", "gpu-emu", "cuda", "rocm", "exec:", "external:", "ids:"];

/// Whether `name` reads as one of [`open`]'s device names: a name an external engine gives
/// itself that does is labelled apart from the device it would be taken for.
pub fn is_device_name(name: &str) -> bool {
    BUILTIN_NAMES.contains(&name) || DEVICE_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// The device name nearest a misspelt one (`cpuu`, `fxied`, `exec python3 e.py`, `cpu:kv-f61`),
/// when one is near enough to be what was meant.
fn suggest_device(name: &str) -> Option<String> {
    let kv = KvFormat::names().split(", ").map(|f| format!("cpu:kv-{f}")).collect::<Vec<_>>();
    let candidates = BUILTIN_NAMES.iter().map(|s| s.to_string()).chain(kv).chain(["gpu-emu", "cuda:0", "rocm:0"].map(String::from));
    // An engine command without its colon (`exec python3 engine.py`).
    for p in ["exec", "ids", "external"] {
        if let Some(rest) = name.strip_prefix(p).filter(|r| r.starts_with([' ', '='])) {
            return Some(format!("{p}:{}", rest[1..].trim_start()));
        }
    }
    let lower = name.to_lowercase();
    candidates.map(|c| (strsim::damerau_levenshtein(&lower, &c), c)).filter(|(d, c)| *d <= 2.max(c.len() / 4) && *d < c.len()).min_by_key(|(d, _)| *d).map(|(_, c)| c)
}
