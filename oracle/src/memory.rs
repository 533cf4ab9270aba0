//! How much memory a loader may plan to hold, checked before it decodes a single weight.
//!
//! A model too large for the machine would otherwise be decoded until the kernel's OOM killer
//! ends the process — after a minute of swapping, with no message. Each loader instead states
//! what it will hold (`check_fits`) and is refused, naming the file and both sizes, when that is
//! more than the machine has available.

use crate::error::{OracleError, Result};

/// Replaces the machine's available memory in the check (bytes, or with a K/M/G/T suffix, binary
/// units): for a machine whose overcommit the estimate does not know, or for tests.
pub const LIMIT_ENV: &str = "TOUCHSTONE_MEMORY_LIMIT";

/// What a loader may use, and where that figure came from: `TOUCHSTONE_MEMORY_LIMIT` when set,
/// else `MemAvailable` + `SwapFree` from /proc/meminfo; None where neither can be read (the check
/// is then skipped, not guessed).
pub fn available() -> Result<Option<(u64, String)>> {
    if let Ok(v) = std::env::var(LIMIT_ENV) {
        let bytes = parse_size(&v).ok_or_else(|| OracleError::Spec(format!("{LIMIT_ENV}={v:?}: expected a size such as 8G, 512M or 1048576")))?;
        return Ok(Some((bytes, LIMIT_ENV.into())));
    }
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else { return Ok(None) };
    Ok(meminfo_available(&text).map(|b| (b, "MemAvailable + SwapFree in /proc/meminfo".into())))
}

/// `MemAvailable + SwapFree` of a /proc/meminfo text, in bytes.
fn meminfo_available(text: &str) -> Option<u64> {
    let kib = |key: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(key))?;
        line[key.len()..].trim().trim_end_matches("kB").trim().parse::<u64>().ok()
    };
    Some(kib("MemAvailable:")?.saturating_add(kib("SwapFree:").unwrap_or(0)).saturating_mul(1024))
}

/// `1048576`, `64K`, `512M`, `8G`, `1T` (binary units; a trailing `B` or `iB` is allowed).
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let s = s.strip_suffix("iB").or_else(|| s.strip_suffix('B')).unwrap_or(s);
    let (digits, shift) = match s.chars().last()?.to_ascii_uppercase() {
        'K' => (&s[..s.len() - 1], 10),
        'M' => (&s[..s.len() - 1], 20),
        'G' => (&s[..s.len() - 1], 30),
        'T' => (&s[..s.len() - 1], 40),
        _ => (s, 0),
    };
    digits.trim().parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

/// Sizes for messages: `283.1 GiB`, `512.0 MiB`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_048_576 => format!("{:.1} KiB", b / 1024.0),
        1_048_576..1_073_741_824 => format!("{:.1} MiB", b / 1_048_576.0),
        _ => format!("{:.1} GiB", b / 1_073_741_824.0),
    }
}

/// Refuses to go on when `needed` bytes (what a loader of `file` will hold: `what`) exceed the
/// memory available; passes when the available memory cannot be read.
pub fn check_fits(file: &str, what: &str, needed: u64) -> Result<()> {
    match available()? {
        Some((avail, source)) => fits(file, what, needed, avail, &source),
        None => Ok(()),
    }
}

fn fits(file: &str, what: &str, needed: u64, avail: u64, source: &str) -> Result<()> {
    if needed <= avail {
        return Ok(());
    }
    Err(OracleError::Memory(format!(
        "{file}: {what} needs {}, more than the {} this machine has available ({source}); nothing was loaded. \
         Use a smaller model or a machine with more memory ({LIMIT_ENV} overrides the estimate)",
        human(needed),
        human(avail)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_units_and_nonsense_is_refused() {
        assert_eq!(parse_size("1048576"), Some(1 << 20));
        assert_eq!(parse_size("64K"), Some(64 << 10));
        assert_eq!(parse_size("512m"), Some(512 << 20));
        assert_eq!(parse_size("8GiB"), Some(8 << 30));
        assert_eq!(parse_size(" 2 T "), Some(2 << 40));
        for bad in ["", "G", "eight", "-1G", "99999999999T"] {
            assert_eq!(parse_size(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn meminfo_counts_available_memory_and_free_swap() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\nSwapTotal: 0 kB\nSwapFree:        1000 kB\n";
        assert_eq!(meminfo_available(text), Some((20_000_000 + 1000) * 1024));
        assert_eq!(meminfo_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn a_load_larger_than_the_machine_is_refused_naming_the_file_and_both_sizes() {
        assert!(fits("m.gguf", "the weights as f32", 10 << 30, 10 << 30, "test").is_ok());
        let e = fits("m.gguf", "the weights as f32", (283 << 30) + (1 << 29), 21 << 30, "test").unwrap_err().to_string();
        assert!(e.contains("m.gguf") && e.contains("283.5 GiB") && e.contains("21.0 GiB") && e.contains("the weights as f32"), "{e}");
    }
}
