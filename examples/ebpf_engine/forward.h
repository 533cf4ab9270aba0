/* What the eBPF programs (forward.bpf.c) and their host loader (loader.c) share: the maps' sizes,
 * the fixed-point formats, and each program's arguments (its BPF_PROG_TEST_RUN context). Offsets
 * are word indices into the map named: `wts` (s32 words) or `act` (s64 words). */
#ifndef EBPF_ENGINE_FORWARD_H
#define EBPF_ENGINE_FORWARD_H

/* The verifier admits variable offsets into a map value below 2^29 bytes, so weights (s32 words)
 * come in chunks of at most 2^26 words (256 MiB), one entry of the `wts` array each, and the
 * activations, KV cache, RoPE tables and scratch (s64 words) in one value of at most 2^25 words.
 * The loader makes each as small as the model allows (powers of two in words). */
#define WTS_CHUNK_MAX_LOG2 26
#define ACT_MAX_LOG2 25

#define Q_ACT 16   /* activations */
#define Q_WGT 24   /* matrix weights */
#define Q_NORM 20  /* norm scales */
#define Q_TABLE 30 /* RoPE cos/sin, the attention scale */

/* y (act) = x (act) W^T, W (wts) rows x cols. */
struct matvec_args {
    __u64 x, w, y, rows, cols;
};

/* y (act) = RMSNorm(x (act), n values) * w (wts, Q20); eps in Q32. */
struct norm_args {
    __u64 x, w, y, n, eps_q32;
};

/* Rotates x (act; n_head heads of hd, the first n_rot of each) in place by the (cos, sin) pairs
 * at table (act, Q30); neox: rotate-half pairs (i, i + n_rot/2), else adjacent ones. */
struct rope_args {
    __u64 x, table, n_head, hd, n_rot, neox;
};

/* out (act) = attention of q (act, n_head heads) over cache rows 0..=pos of kc and vc (act,
 * rows of n_head_kv heads); scores: pos + 1 words of scratch; scale_q30 = 1/sqrt(hd) in Q30. */
struct attend_args {
    __u64 q, kc, vc, out, scores, pos, n_head, n_head_kv, hd;
    __s64 scale_q30;
};

/* Elementwise over n values: swiglu y = silu(a) b, add y = a + b (all act); embed y (act) = the
 * n values of wts at a. */
struct ew_args {
    __u64 a, b, y, n;
};

#endif
