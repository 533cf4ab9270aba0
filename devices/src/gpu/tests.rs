//! Unit tests of the parent module.

use super::*;

fn plan(ty: GgmlType, cols: usize, aligned: bool, block: u32) -> (&'static str, u32) {
    let row_bytes = ty.bytes_for(cols as u64).unwrap() as usize;
    let p = matmul_plan(ty, cols, row_bytes, aligned, block);
    (p.kernel, p.lanes)
}

#[test]
fn a_long_row_is_streamed_by_a_few_threads_and_a_short_one_shares_them() {
    // The roofline's GEMV: 1,024 16-byte units per row, 32 per thread (8 batches of 4).
    assert_eq!(plan(GgmlType::F16, 8192, true, 256), ("ts_matmul_v", 32));
    // SmolLM2's Q4_1 rows of 576: 18 chunks, 16 lanes, 16 rows per block.
    assert_eq!(plan(GgmlType::Q4_1, 576, true, 256), ("ts_matmul_q", 16));
    assert_eq!(plan(GgmlType::Q4_K, 1536, true, 256), ("ts_matmul_q", 16));
    assert_eq!(plan(GgmlType::Q8_0, 64, true, 256), ("ts_matmul_q", 2));
    assert_eq!(plan(GgmlType::F32, 576, true, 256), ("ts_matmul_v", 32));
    assert_eq!(plan(GgmlType::BF16, 64, true, 256), ("ts_matmul_v", 8));
    // The emulator's 32-thread blocks cap the lanes.
    assert_eq!(plan(GgmlType::F16, 8192, true, 32), ("ts_matmul_v", 32));
    assert_eq!(plan(GgmlType::F16, 8192, true, 16), ("ts_matmul_v", 16));
}

#[test]
fn kernel_names_list_the_matmul_variants() {
    let names = kernel_names();
    for want in ["ts_matmul_v", "ts_matmul_v1", "ts_matmul_v1b2", "ts_matmul_q", "ts_matmul_q1"] {
        assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
    }
    assert!(names.iter().all(|n| n.starts_with("ts_") && !n.contains(['(', ' '])), "{names:?}");
}

#[test]
fn the_staged_x_tile_is_the_size_the_kernel_was_built_with() {
    assert!(KERNEL_SOURCE.contains(&format!("#define TS_XTILE {XTILE_FLOATS}\n")), "TS_XTILE in touchstone.cu differs from XTILE_FLOATS");
    // Its floats and the reduction's (8 tokens of a 256-thread block) fit the portable 48 KiB.
    assert!(4 * (XTILE_FLOATS as usize + MAX_TOKENS_PER_LAUNCH * 256) <= MAX_SHARED_BYTES);
}

#[test]
fn rows_that_cannot_take_16_byte_loads_go_element_by_element() {
    assert_eq!(plan(GgmlType::F32, 7, true, 256), ("ts_matmul", 8));
    assert_eq!(plan(GgmlType::F16, 12, true, 256), ("ts_matmul", 16));
    assert_eq!(plan(GgmlType::F16, 576, false, 256), ("ts_matmul", 256));
    assert_eq!(plan(GgmlType::F32, 1, true, 256), ("ts_matmul", 1));
}
