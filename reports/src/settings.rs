//! Kernel and CPU settings that change how a timing behaves, read from /proc and /sys as the OS
//! states them (absent where it does not), and the notes a benchmark prints about them.
//!
//! Engineers who publish A/B tables have found second-long stalls that only end-to-end runs
//! showed, caused by machine settings such as automatic NUMA balancing and proactive memory
//! compaction. A report that records them lets a reader tell such a machine from a slow build.

use std::collections::BTreeMap;
use std::path::Path;

/// (report key, file under the root). Files whose text lists choices (`always [madvise] never`)
/// are recorded as the chosen one.
const FILES: [(&str, &str); 6] = [
    ("kernel.numa_balancing", "proc/sys/kernel/numa_balancing"),
    ("vm.compaction_proactiveness", "proc/sys/vm/compaction_proactiveness"),
    ("transparent_hugepage.enabled", "sys/kernel/mm/transparent_hugepage/enabled"),
    ("transparent_hugepage.defrag", "sys/kernel/mm/transparent_hugepage/defrag"),
    ("cpufreq.governor", "sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
    ("cpufreq.boost", "sys/devices/system/cpu/cpufreq/boost"),
];

/// The settings of the machine this runs on.
pub fn collect() -> BTreeMap<String, String> {
    collect_at(Path::new("/"))
}

/// The settings as files under `root` state them (`/` for this machine).
pub fn collect_at(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for (key, file) in FILES {
        if let Ok(text) = std::fs::read_to_string(root.join(file)) {
            let text = text.trim();
            let chosen = text.split_whitespace().find(|w| w.starts_with('[') && w.ends_with(']')).map(|w| w.trim_matches(['[', ']']));
            out.insert(key.to_string(), chosen.unwrap_or(text).to_string());
        }
    }
    if let Ok(dir) = std::fs::read_dir(root.join("sys/devices/system/node")) {
        let nodes = dir.filter_map(|e| e.ok()).filter(|e| e.file_name().to_str().is_some_and(|n| n.strip_prefix("node").is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit())))).count();
        if nodes > 0 {
            out.insert("numa_nodes".into(), nodes.to_string());
        }
    }
    out
}

/// What in `settings` can disturb a timing, each note with the setting that avoids it.
pub fn timing_notes(settings: &BTreeMap<String, String>) -> Vec<String> {
    let get = |k: &str| settings.get(k).map(String::as_str);
    let mut notes = Vec::new();
    let nodes: usize = get("numa_nodes").and_then(|n| n.parse().ok()).unwrap_or(1);
    if nodes > 1 && get("kernel.numa_balancing").is_some_and(|v| v != "0") {
        notes.push(format!("kernel.numa_balancing is on with {nodes} NUMA nodes: pages migrate while the engine runs (`sysctl kernel.numa_balancing=0` for formal numbers)"));
    }
    if let Some(v) = get("vm.compaction_proactiveness").filter(|v| *v != "0") {
        notes.push(format!("vm.compaction_proactiveness is {v}: background memory compaction can stall a run (`sysctl vm.compaction_proactiveness=0` for formal numbers)"));
    }
    if get("transparent_hugepage.enabled") == Some("always") && get("transparent_hugepage.defrag") == Some("always") {
        notes.push("transparent hugepages are `always` with defrag `always`: a page fault can wait on direct compaction".into());
    }
    if let Some(g) = get("cpufreq.governor").filter(|g| *g != "performance") {
        notes.push(format!("the cpufreq governor is `{g}`: clocks ramp with load (`performance` for formal numbers)"));
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let p = root.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
        root
    }

    #[test]
    fn settings_are_read_as_the_os_states_them_and_notes_name_what_disturbs_a_timing() {
        let root = tree(&[
            ("proc/sys/kernel/numa_balancing", "1\n"),
            ("proc/sys/vm/compaction_proactiveness", "20\n"),
            ("sys/kernel/mm/transparent_hugepage/enabled", "[always] madvise never\n"),
            ("sys/kernel/mm/transparent_hugepage/defrag", "[always] defer defer+madvise madvise never\n"),
            ("sys/devices/system/cpu/cpu0/cpufreq/scaling_governor", "powersave\n"),
            ("sys/devices/system/node/node0/cpulist", "0-7"),
            ("sys/devices/system/node/node1/cpulist", "8-15"),
            ("sys/devices/system/node/possible", "0-1"),
        ]);
        let s = collect_at(root.path());
        let want: BTreeMap<String, String> = [
            ("kernel.numa_balancing", "1"),
            ("vm.compaction_proactiveness", "20"),
            ("transparent_hugepage.enabled", "always"),
            ("transparent_hugepage.defrag", "always"),
            ("cpufreq.governor", "powersave"),
            ("numa_nodes", "2"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(s, want);
        let notes = timing_notes(&s);
        assert_eq!(notes.len(), 4, "{notes:?}");
        assert!(notes[0].contains("numa_balancing is on with 2 NUMA nodes") && notes[1].contains("compaction_proactiveness is 20"), "{notes:?}");
        assert!(notes[2].contains("direct compaction") && notes[3].contains("governor is `powersave`"), "{notes:?}");
    }

    #[test]
    fn a_quiet_machine_gets_no_notes_and_missing_files_are_absent_not_guessed() {
        let root = tree(&[
            ("proc/sys/kernel/numa_balancing", "1\n"), // one node: nothing to migrate between
            ("proc/sys/vm/compaction_proactiveness", "0\n"),
            ("sys/kernel/mm/transparent_hugepage/enabled", "always [madvise] never\n"),
            ("sys/devices/system/node/node0/cpulist", "0-1"),
        ]);
        let s = collect_at(root.path());
        assert!(!s.contains_key("cpufreq.governor") && !s.contains_key("transparent_hugepage.defrag"), "{s:?}");
        assert_eq!(s.get("transparent_hugepage.enabled").map(String::as_str), Some("madvise"));
        assert_eq!(timing_notes(&s), Vec::<String>::new());
        assert!(collect_at(Path::new("/no/such/root")).is_empty());
    }
}
