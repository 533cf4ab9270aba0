//! registry (below)
