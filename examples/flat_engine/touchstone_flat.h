/* The Touchstone flat model format (docs/FLAT_FORMAT.md), version 1, for C engines.
 *
 * The file is read with a cast: map or load it whole (aligned to at least 8 bytes), call
 * ts_flat_check() once, then use ts_flat_header(), ts_flat_find() and ts_flat_data().
 * Freestanding: needs only <stdint.h> and <stddef.h> (no libc), so a bare-metal kernel can use it
 * on a module its boot loader placed in memory. Little-endian hosts only (as the format is).
 */
#ifndef TOUCHSTONE_FLAT_H
#define TOUCHSTONE_FLAT_H

#include <stddef.h>
#include <stdint.h>

#define TS_FLAT_VERSION 1u
#define TS_FLAT_HEADER_SIZE 512u
#define TS_FLAT_ENTRY_SIZE 128u
#define TS_FLAT_ALIGN 64u

enum ts_flat_flags {
    TS_FLAT_QK_NORM = 1,
    TS_FLAT_QKV_BIAS = 2,
    TS_FLAT_OUT_BIAS = 4,
    TS_FLAT_TIED_OUTPUT = 8,
    TS_FLAT_FREQ_FACTORS = 16,
    TS_FLAT_POST_NORMS = 32,
    TS_FLAT_ATTN_SINKS = 64,       /* GPT-OSS: blk.N.attn_sinks.weight, one logit per query head */
    TS_FLAT_YARN_UNTRUNCATED = 128, /* YaRN's correction range as computed (GPT-OSS) */
};

enum ts_flat_rope_scaling { TS_ROPE_NONE = 0, TS_ROPE_LINEAR = 1, TS_ROPE_YARN = 2, TS_ROPE_LONGROPE = 3 };

/* GGML type ids. */
enum ts_ggml_type {
    TS_GGML_F32 = 0, TS_GGML_F16 = 1, TS_GGML_Q4_0 = 2, TS_GGML_Q4_1 = 3, TS_GGML_Q5_0 = 6, TS_GGML_Q5_1 = 7,
    TS_GGML_Q8_0 = 8, TS_GGML_Q2_K = 10, TS_GGML_Q3_K = 11, TS_GGML_Q4_K = 12, TS_GGML_Q5_K = 13, TS_GGML_Q6_K = 14, TS_GGML_IQ4_NL = 20, TS_GGML_IQ4_XS = 23, TS_GGML_BF16 = 30,
    TS_GGML_TQ1_0 = 34, TS_GGML_TQ2_0 = 35, TS_GGML_MXFP4 = 39, TS_GGML_NVFP4 = 40, TS_GGML_Q1_0 = 41, TS_GGML_Q2_0 = 42,
};

struct ts_flat_header {
    char magic[8];                 /* "TSFLAT\0\0" */
    uint32_t version;              /* 1 */
    uint32_t header_size;          /* 512 */
    uint64_t file_size;
    uint64_t table_offset;         /* 512 */
    uint32_t n_tensors;
    uint32_t entry_size;           /* 128 */
    uint64_t data_offset;
    char arch[16];
    uint32_t n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, context_length;
    uint32_t n_rot;
    uint32_t rope_style;           /* 0 adjacent pairs, 1 rotate-half */
    uint32_t rope_scaling;         /* enum ts_flat_rope_scaling */
    uint32_t activation;           /* 0 SiLU, 1 GELU (tanh) */
    uint32_t flags;                /* enum ts_flat_flags */
    uint32_t sliding_window;       /* 0 none */
    uint32_t n_expert, n_expert_used, expert_ffn, moe_gating, moe_flags, shared_ffn;
    double norm_eps, rope_theta, attn_scale, rope_factor, yarn_beta_fast, yarn_beta_slow, yarn_ext_factor, rope_attn_factor;
    uint64_t rope_original_context;
    uint64_t rope_context;         /* LongRoPE: the context its factors serve (0: the original) */
    uint32_t swa_period;           /* 0: every layer windowed; N: all but layers N-1, 2N-1, ... */
    uint32_t pad0;
    double rope_theta_swa;         /* the windowed layers' RoPE base (0: the global one) */
    double embd_scale;             /* embeddings times this before the first layer (0: none) */
    double attn_softcap;           /* scores become c * tanh(s / c) (Gemma 2; 0: none) */
    double final_softcap;          /* logits become c * tanh(l / c) (Gemma 2; 0: none) */
    uint8_t reserved[240];
    uint64_t meta_checksum;        /* FNV-1a 64 of bytes 0..504, then the table */
};

struct ts_flat_tensor {
    char name[64];
    uint32_t type;                 /* enum ts_ggml_type */
    uint32_t n_dims;
    uint64_t dims[4];              /* dims[0] = row length */
    uint64_t offset;               /* absolute, multiple of 64 */
    uint64_t n_bytes;
    uint64_t checksum;             /* FNV-1a 64 of the bytes */
};

_Static_assert(sizeof(struct ts_flat_header) == 512, "header is 512 bytes");
_Static_assert(offsetof(struct ts_flat_header, arch) == 48, "arch at 48");
_Static_assert(offsetof(struct ts_flat_header, n_vocab) == 64, "n_vocab at 64");
_Static_assert(offsetof(struct ts_flat_header, n_rot) == 96, "n_rot at 96");
_Static_assert(offsetof(struct ts_flat_header, n_expert) == 120, "n_expert at 120");
_Static_assert(offsetof(struct ts_flat_header, norm_eps) == 144, "norm_eps at 144");
_Static_assert(offsetof(struct ts_flat_header, rope_original_context) == 208, "rope_original_context at 208");
_Static_assert(offsetof(struct ts_flat_header, rope_context) == 216, "rope_context at 216");
_Static_assert(offsetof(struct ts_flat_header, meta_checksum) == 504, "meta_checksum at 504");
_Static_assert(sizeof(struct ts_flat_tensor) == 128, "entry is 128 bytes");
_Static_assert(offsetof(struct ts_flat_tensor, offset) == 104, "offset at 104");

static inline uint64_t ts_fnv1a64(uint64_t h, const void *p, size_t n) {
    const uint8_t *b = (const uint8_t *)p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= 0x100000001b3ull;
    }
    return h;
}
#define TS_FNV_OFFSET 0xcbf29ce484222325ull

static inline const struct ts_flat_header *ts_flat_header(const void *file) { return (const struct ts_flat_header *)file; }

static inline const struct ts_flat_tensor *ts_flat_entry(const void *file, uint32_t i) {
    return (const struct ts_flat_tensor *)((const uint8_t *)file + TS_FLAT_HEADER_SIZE) + i;
}

/* Bytes per block and values per block of a GGML type (0 for an unknown type). */
static inline uint64_t ts_ggml_block_bytes(uint32_t type, uint64_t *values) {
    switch (type) {
    case TS_GGML_F32: *values = 1; return 4;
    case TS_GGML_F16: case TS_GGML_BF16: *values = 1; return 2;
    case TS_GGML_Q4_0: *values = 32; return 18;
    case TS_GGML_Q4_1: *values = 32; return 20;
    case TS_GGML_Q5_0: *values = 32; return 22;
    case TS_GGML_Q5_1: *values = 32; return 24;
    case TS_GGML_Q8_0: *values = 32; return 34;
    case TS_GGML_Q2_K: *values = 256; return 84;
    case TS_GGML_Q3_K: *values = 256; return 110;
    case TS_GGML_Q4_K: *values = 256; return 144;
    case TS_GGML_Q5_K: *values = 256; return 176;
    case TS_GGML_Q6_K: *values = 256; return 210;
    case TS_GGML_IQ4_NL: *values = 32; return 18;
    case TS_GGML_IQ4_XS: *values = 256; return 136;
    case TS_GGML_TQ1_0: *values = 256; return 54;
    case TS_GGML_TQ2_0: *values = 256; return 66;
    case TS_GGML_MXFP4: *values = 32; return 17;
    case TS_GGML_NVFP4: *values = 64; return 36;
    case TS_GGML_Q1_0: *values = 128; return 18;
    case TS_GGML_Q2_0: *values = 64; return 18;
    default: *values = 0; return 0;
    }
}

/* Checks a whole flat file held in memory: NULL when it is sound, else a message (static).
 * With verify_data, every tensor's checksum too (one pass over the file). */
static inline const char *ts_flat_check(const void *file, uint64_t len, int verify_data) {
    static const char magic[8] = {'T', 'S', 'F', 'L', 'A', 'T', 0, 0};
    const struct ts_flat_header *h = ts_flat_header(file);
    if (len < TS_FLAT_HEADER_SIZE) return "truncated: shorter than the header";
    for (int i = 0; i < 8; i++)
        if (h->magic[i] != magic[i]) return "bad magic: not a Touchstone flat file";
    if (h->version != TS_FLAT_VERSION) return "unsupported version";
    if (h->header_size != TS_FLAT_HEADER_SIZE || h->entry_size != TS_FLAT_ENTRY_SIZE || h->table_offset != TS_FLAT_HEADER_SIZE) return "bad header_size, entry_size or table_offset";
    if (h->file_size != len) return "file_size is not the file's length (truncated?)";
    uint64_t table_end = TS_FLAT_HEADER_SIZE + (uint64_t)h->n_tensors * TS_FLAT_ENTRY_SIZE;
    if (table_end > len) return "the table runs past the end of the file";
    if (h->data_offset < table_end || h->data_offset > len || h->data_offset % TS_FLAT_ALIGN) return "bad data_offset";
    uint64_t sum = ts_fnv1a64(TS_FNV_OFFSET, file, 504);
    sum = ts_fnv1a64(sum, (const uint8_t *)file + TS_FLAT_HEADER_SIZE, (size_t)(table_end - TS_FLAT_HEADER_SIZE));
    if (sum != h->meta_checksum) return "meta_checksum mismatch: the header or table is corrupt";
    uint64_t end = h->data_offset;
    for (uint32_t i = 0; i < h->n_tensors; i++) {
        const struct ts_flat_tensor *t = ts_flat_entry(file, i);
        uint64_t per_block_values, per_block = ts_ggml_block_bytes(t->type, &per_block_values);
        if (!per_block) return "a tensor has an unknown type";
        if (t->n_dims < 1 || t->n_dims > 4 || t->dims[0] % per_block_values) return "a tensor has bad dims";
        uint64_t n = 1;
        for (int d = 0; d < 4; d++) {
            if (t->dims[d] == 0 || n > UINT64_MAX / t->dims[d]) return "a tensor's dims overflow";
            n *= t->dims[d];
        }
        if (n / per_block_values > UINT64_MAX / per_block || n / per_block_values * per_block != t->n_bytes) return "a tensor's n_bytes does not match its dims";
        if (t->offset % TS_FLAT_ALIGN || t->offset < end || t->n_bytes > len - t->offset) return "a tensor lies outside the file or overlaps another";
        end = t->offset + t->n_bytes;
        if (verify_data && ts_fnv1a64(TS_FNV_OFFSET, (const uint8_t *)file + t->offset, (size_t)t->n_bytes) != t->checksum) return "a tensor's checksum does not match: the data is corrupt";
    }
    return NULL;
}

/* The entry named `name`, or NULL. */
static inline const struct ts_flat_tensor *ts_flat_find(const void *file, const char *name) {
    const struct ts_flat_header *h = ts_flat_header(file);
    for (uint32_t i = 0; i < h->n_tensors; i++) {
        const struct ts_flat_tensor *t = ts_flat_entry(file, i);
        size_t k = 0;
        while (k < sizeof t->name && name[k] && t->name[k] == name[k]) k++;
        if (k < sizeof t->name && !name[k] && !t->name[k]) return t;
    }
    return NULL;
}

static inline const void *ts_flat_data(const void *file, const struct ts_flat_tensor *t) { return (const uint8_t *)file + t->offset; }

#endif
