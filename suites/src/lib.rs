//! # suites — the gates
//!
//! Today: `membw` (a memory-bandwidth probe) and `throughput` (prefill/decode timing of the
//! oracle against that probe). The kernel, layer-diff and fixed-token gates land here next
//! (see docs/ARCHITECTURE.md, "Roadmap").

pub mod ab;
pub mod attention_terms;
pub mod coverage;
pub mod emulate;
pub mod fixedtoken;
pub mod kernels;
pub mod layerdiff;
pub mod machine;
pub mod reduce;
pub mod membw;
pub mod selfcheck;
pub mod serving;
pub mod throughput;
pub mod tolerance;
