//! Opening the files a user or an engine names: regular files only. A named pipe, a device or a
//! directory where a model, tokenizer, config or dump file is expected would block the command
//! forever on open or read (or read without end); it is refused, naming the path.

use crate::error::{OracleError, Result};
use std::path::Path;

/// The error for a path that is not a regular file (after following symbolic links), or None.
pub fn not_regular(path: &Path) -> Option<std::io::Error> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => None,
        Ok(m) => {
            let kind = if m.is_dir() { "a directory" } else { "not a regular file (a named pipe, socket or device)" };
            Some(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{kind}, where a file is expected")))
        }
        Err(e) => Some(e),
    }
}

/// Opens `path` for reading if it is a regular file.
pub fn open(path: &Path) -> Result<std::fs::File> {
    if let Some(e) = not_regular(path) {
        return Err(OracleError::io(path, e));
    }
    std::fs::File::open(path).map_err(|e| OracleError::io(path, e))
}

/// Reads `path` as text if it is a regular file.
pub fn read_to_string(path: &Path) -> Result<String> {
    if let Some(e) = not_regular(path) {
        return Err(OracleError::io(path, e));
    }
    std::fs::read_to_string(path).map_err(|e| OracleError::io(path, e))
}

/// Opens `name`, a file an engine wrote in its output directory `dir`: a plain name (no
/// separator, not `.` or `..`) of a regular file that is not a symbolic link. A link is refused
/// by name, never followed: an engine's output could otherwise make this tool read any file on
/// the machine.
pub fn open_written(dir: &Path, name: &str) -> Result<std::fs::File> {
    let path = dir.join(name);
    let refuse = |why: &str| OracleError::io(&path, std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string()));
    if name.is_empty() || name.contains('/') || name.contains('\\') || name == "." || name == ".." {
        return Err(refuse("not a plain file name inside the output directory"));
    }
    let meta = std::fs::symlink_metadata(&path).map_err(|e| OracleError::io(&path, e))?;
    if meta.file_type().is_symlink() {
        return Err(refuse("a symbolic link, which is never followed in an engine's output (it could lead anywhere on the machine)"));
    }
    if let Some(e) = not_regular(&path) {
        return Err(OracleError::io(&path, e));
    }
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // A link put in its place after the check is refused by the open itself.
        options.custom_flags(libc::O_NOFOLLOW);
    }
    options.open(&path).map_err(|e| OracleError::io(&path, e))
}

#[cfg(test)]
mod tests {
    /// A named pipe is refused at once (opening it would wait for a writer forever), a directory
    /// too; a regular file opens.
    #[test]
    fn only_regular_files_open() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("model.gguf");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if made.is_ok_and(|s| s.success()) {
            let e = super::open(&fifo).unwrap_err().to_string();
            assert!(e.contains("model.gguf") && e.contains("named pipe"), "{e}");
            assert!(super::read_to_string(&fifo).is_err());
        }
        assert!(super::open(dir.path()).unwrap_err().to_string().contains("a directory"));
        let file = dir.path().join("f.txt");
        std::fs::write(&file, "x").unwrap();
        assert_eq!(super::read_to_string(&file).unwrap(), "x");
    }

    /// In an engine's output, a link is refused by name wherever it points, as is a name that
    /// leaves the directory; a regular file opens.
    #[cfg(unix)]
    #[test]
    fn an_engines_output_is_read_without_following_links() {
        let dir = tempfile::tempdir().unwrap();
        let elsewhere = dir.path().join("secret.txt");
        std::fs::write(&elsewhere, "{}").unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::os::unix::fs::symlink(&elsewhere, out.join("manifest.json")).unwrap();
        let e = super::open_written(&out, "manifest.json").unwrap_err().to_string();
        assert!(e.contains("manifest.json") && e.contains("symbolic link"), "{e}");
        assert!(super::open_written(&out, "../secret.txt").unwrap_err().to_string().contains("not a plain file name"));
        std::fs::write(out.join("taps.safetensors"), "x").unwrap();
        assert!(super::open_written(&out, "taps.safetensors").is_ok());
    }
}
