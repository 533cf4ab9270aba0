//! Running an engine's command: in a process group of its own, with a timeout and bounded
//! output, its whole group killed when it ends or is stopped; and the tail of what it logged.

use std::path::Path;
use std::time::{Duration, Instant};

/// Runs `command` to its end in a process group of its own, with no stdin and its stdout and
/// stderr written to files (one file when the paths are equal), and returns its exit status.
/// Err (a phrase to follow the command's name) when it cannot start, runs past `timeout` (the
/// `hint` says how to allow more) or writes more than [`OUTPUT_LIMIT`] to either file; its whole
/// group is then killed. Whatever it leaves running in its group when it exits (`engine &`) is
/// killed too, so nothing keeps writing what is about to be read or takes the CPU from what follows.
pub fn run_bounded(command: &mut std::process::Command, stdout: &Path, stderr: &Path, timeout: Duration, hint: &str) -> Result<std::process::ExitStatus, String> {
    run_bounded_watching(command, stdout, stderr, timeout, hint, None)
}

/// [`run_bounded`], and when `watch` is `(dir, limit)`, the command is also killed once what it
/// has written under `dir` (every file, links not followed) passes `limit` bytes.
pub fn run_bounded_watching(command: &mut std::process::Command, stdout: &Path, stderr: &Path, timeout: Duration, hint: &str, watch: Option<(&Path, u64)>) -> Result<std::process::ExitStatus, String> {
    use std::os::unix::process::CommandExt;
    let create = |p: &Path| std::fs::File::create(p).map_err(|e| format!("cannot write its output to {}: {e}", p.display()));
    let err_file = create(stderr)?;
    let out_file = if stdout == stderr { err_file.try_clone().map_err(|e| e.to_string())? } else { create(stdout)? };
    let mut child = command.stdin(std::process::Stdio::null()).stdout(out_file).stderr(err_file).process_group(0).spawn().map_err(|e| format!("cannot start: {e}"))?;
    let streams: Vec<(&Path, &str)> = if stdout == stderr { vec![(stdout, "its stdout and stderr")] } else { vec![(stdout, "its stdout"), (stderr, "its stderr")] };
    let t0 = Instant::now();
    let mut ticks = 0u64;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                kill_process_group(child.id());
                return Ok(status);
            }
            Ok(None) if t0.elapsed() > timeout => {
                stop(&mut child);
                return Err(format!("did not finish within {:.0} s (killed; {hint})", timeout.as_secs_f64()));
            }
            Ok(None) => {
                if let Some((_, what)) = streams.iter().find(|(p, _)| std::fs::metadata(p).is_ok_and(|m| m.len() > OUTPUT_LIMIT)) {
                    stop(&mut child);
                    return Err(format!("wrote more than {} MiB to {what} (killed: a command's output is for reading, not a disk to fill)", OUTPUT_LIMIT >> 20));
                }
                ticks += 1;
                if let Some((dir, limit)) = watch.filter(|_| ticks.is_multiple_of(10)) {
                    let size = dir_size(dir, limit);
                    if size > limit {
                        stop(&mut child);
                        return Err(format!("wrote more than {limit} bytes under {} (killed: more than its outputs can take)", dir.display()));
                    }
                }
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => {
                stop(&mut child);
                return Err(format!("could not be waited for: {e}"));
            }
        }
    }
}

/// The bytes of the files under `dir` (links not followed), counted until past `stop`.
fn dir_size(dir: &Path, stop: u64) -> u64 {
    let mut total = 0u64;
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let Ok(m) = e.path().symlink_metadata() else { continue };
            if m.is_dir() {
                todo.push(e.path());
            } else {
                total = total.saturating_add(m.len());
            }
            if total > stop {
                return total;
            }
        }
    }
    total
}

/// Kills a running command's whole process group and reaps it.
fn stop(child: &mut std::process::Child) {
    kill_process_group(child.id());
    let _ = child.kill();
    let _ = child.wait();
}

/// The most a command run by [`run_bounded`] (an engine, for one request) may write to its stdout
/// or its stderr.
pub const OUTPUT_LIMIT: u64 = 256 << 20;

/// The last `n` bytes of a file (all of it when shorter), with the first, partial line left out
/// when the file is longer; empty when unreadable.
pub fn file_tail(path: &Path, n: u64) -> Vec<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return Vec::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(n);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(start)).is_err() || f.take(n).read_to_end(&mut buf).is_err() {
        return Vec::new();
    }
    if start > 0 {
        let cut = buf.iter().position(|b| *b == b'\n').map_or(buf.len(), |i| i + 1);
        buf.drain(..cut);
    }
    buf
}

/// `; end of its log:` and an engine log's last 8 lines, for an error message (empty when the
/// log is empty or unreadable).
pub(crate) fn log_tail(log_path: &Path) -> String {
    let text = String::from_utf8_lossy(&file_tail(log_path, 64 << 10)).into_owned();
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(8)..].join("\n  ");
    if tail.is_empty() { String::new() } else { format!("; end of its log:\n  {tail}") }
}

/// SIGKILL to the process group led by `pid` (a child started with `process_group(0)`), so
/// grandchildren of `sh -c` die too. A direct system call: the `kill` program is not used because
/// procps-ng 4.0's `kill -KILL -PGID` was seen here to signal every process of the user instead.
pub fn kill_process_group(pid: u32) {
    // A group id of 0 or 1 would mean "our own group" or "everyone": never signal those.
    if let Ok(pgid) = i32::try_from(pid) {
        if pgid > 1 {
            // SAFETY: kill(2) with a negative pid signals exactly that process group.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }
}
