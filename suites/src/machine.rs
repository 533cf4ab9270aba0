//! What the OS says about the machine's state while a benchmark runs (Linux /proc and /sys):
//! peak resident memory of this process, load average, CPU frequency. Missing facts are None,
//! never invented.

/// Peak resident set size of this process (VmHWM), in KiB.
pub fn peak_rss_kb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    s.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
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
            assert!(super::load_average().is_some());
        }
    }
}
