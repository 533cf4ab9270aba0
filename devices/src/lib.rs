//! # devices — the backends under test
//!
//! The `Device` trait and the `cpu`, `fixed`, `cuda`, `rocm` and `external` backends land here
//! with the kernel-gate work (see docs/ARCHITECTURE.md, "Roadmap"). Nothing is implemented yet,
//! and `cargo xtask` reports every device other than the oracle (`ref`) as unavailable.
