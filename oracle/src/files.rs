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
}
