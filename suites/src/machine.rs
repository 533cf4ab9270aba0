//! What the OS says about the machine's state while a benchmark runs (Linux /proc and /sys):
//! peak resident memory of this process, load average, CPU frequency. Missing facts are None,
//! never invented.

/// Peak resident set size of this process (VmHWM), in KiB.
pub fn peak_rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// Resets the peak resident set size to the current one (Linux 4.0+: `5` written to
/// /proc/self/clear_refs), so a later `peak_rss_kb` is the peak since now; false where that is
/// not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// 1-minute load average.
pub fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg").ok()?.split_whitespace().next()?.parse().ok()
}

/// Current frequency of CPU 0 in MHz (cpufreq when exposed, else /proc/cpuinfo's "cpu MHz").
pub fn cpu_mhz() -> Option<f64> {
    if let Ok(s) = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq") {
        if let Ok(khz) = s.trim().parse::<f64>() {
            return Some(khz / 1000.0);
        }
    }
    let s = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    s.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse().ok()
}

/// The machine state at one sample.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct MachineState {
    pub load_average_1m: Option<f64>,
    pub cpu_mhz: Option<f64>,
    pub peak_rss_kb: Option<u64>,
}

pub fn state() -> MachineState {
    MachineState { load_average_1m: load_average(), cpu_mhz: cpu_mhz(), peak_rss_kb: peak_rss_kb() }
}

#[cfg(test)]
mod tests {
    #[test]
    fn linux_reports_memory_and_load() {
        if cfg!(target_os = "linux") {
            assert!(super::peak_rss_kb().unwrap() > 0);
            // A peak reached by a freed buffer is forgotten after a reset.
            let big = vec![1u8; 256 << 20];
            std::hint::black_box(&big);
            let before = super::peak_rss_kb().unwrap();
            drop(big);
            if super::reset_peak_rss() {
                assert!(super::peak_rss_kb().unwrap() + 200 * 1024 < before, "{before} kB before the reset");
            }
            assert!(super::load_average().is_some());
        }
    }
}
