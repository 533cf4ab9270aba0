// Touchstone's GPU kernels: one source for CUDA (NVRTC), ROCm (hiprtc) and the host emulator.
//
// A platform prelude (prelude_gpu.h + prelude_{cuda,hip}.h, or prelude_host.h) comes first. It
// defines the integer types below, `ts_bits_to_float`, `ts_half` (f16 bits to float),
// `SHARED(T, name, n)` / `DYNAMIC_SHARED(T, name)` (static / dynamic shared arrays) and the
// 16-byte accesses `ts_load16` / `ts_store16`; everything else here is the common subset of CUDA
// C++ that NVRTC, hiprtc and a host C++ compiler accept:
// no headers, no warp intrinsics (AMD wavefronts are 64 wide, NVIDIA warps 32), no fast-math
// intrinsics. Reductions are shared-memory trees over a power-of-two block, so a kernel's result
// does not depend on scheduling: the same launch gives the same bits every time.
//
// Conventions: activations are f32 row-major; `*_stride` is the distance between rows in
// elements; weights are a GGUF type's packed bytes, `row_bytes` apart. Every kernel is written
// for any power-of-two blockDim.x the host picks (256 on GPUs, 32 in the emulator).

#define TS_MAX_TOKENS 8
#define TS_MAX_BLOCK 1024
#define TS_NEG_INF ts_bits_to_float(0xFF800000u)

// GGML type ids (the GGUF tensor-info ids).
#define TY_F32 0
#define TY_F16 1
#define TY_Q4_0 2
#define TY_Q4_1 3
#define TY_Q5_0 6
#define TY_Q5_1 7
#define TY_Q8_0 8
#define TY_Q2_K 10
#define TY_Q3_K 11
#define TY_Q4_K 12
#define TY_Q5_K 13
#define TY_Q6_K 14
#define TY_IQ4_NL 20
#define TY_IQ4_XS 23
#define TY_BF16 30
#define TY_TQ1_0 34
#define TY_TQ2_0 35
#define TY_MXFP4 39
#define TY_NVFP4 40
#define TY_Q1_0 41
#define TY_Q2_0 42

// ---------------------------------------------------------------------------------------------
// Number formats, decoded by hand so no platform header is needed.
// ---------------------------------------------------------------------------------------------

// IEEE half to float (exact): `ts_half` comes from the prelude, as one conversion instruction on
// GPUs; the host emulator's prelude decodes the bits (prelude_host.h).

__device__ __forceinline__ float ts_bf16(u16 h) {
    return ts_bits_to_float((u32)h << 16);
}

// Little-endian reads at any byte offset (block layouts put f16 and u32 fields at odd offsets).
__device__ __forceinline__ u16 ts_u16(const u8* p) {
    return (u16)(p[0] | ((u16)p[1] << 8));
}
__device__ __forceinline__ u32 ts_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

// One float of a float-typed row.
__device__ __forceinline__ float ts_float_at(int ty, const u8* row, long long j) {
    if (ty == TY_F32) return ((const float*)row)[j];
    u16 h = ts_u16(row + 2 * j);
    return ty == TY_F16 ? ts_half(h) : ts_bf16(h);
}

// The 6-bit scale and min of sub-block j (0..8) of a Q4_K/Q5_K super-block.
__device__ __forceinline__ void ts_k_scale_min(int j, const u8* q, float* sc, float* mn) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *mn = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4));
        *mn = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

// A 4-bit E2M1 value (MXFP4, NVFP4) doubled to an integer, as ggml stores its levels: magnitudes
// 0, 1, 2, 3, 4, 6, 8, 12 for codes 0..7, bit 3 the sign. Computed, not looked up, so the
// kernels keep no table on the stack.
__device__ __forceinline__ int ts_fp4(int q) {
    int i = q & 7, m = i < 4 ? i : (2 + (i & 1)) << ((i >> 1) - 1);
    return (q & 8) ? -m : m;
}

// Elements 32c..32c+32 of a packed row, for every type (float types included). The arithmetic
// of each line is the one GGML's reference dequantizers use.
__device__ void ts_dequant32(int ty, const u8* row, int c, float* out) {
    switch (ty) {
    case TY_Q4_0: {
        const u8* b = row + 18 * c;
        float d = ts_half(ts_u16(b));
        for (int j = 0; j < 16; ++j) {
            out[j] = (float)((int)(b[2 + j] & 0x0F) - 8) * d;
            out[j + 16] = (float)((int)(b[2 + j] >> 4) - 8) * d;
        }
        return;
    }
    case TY_Q4_1: {
        const u8* b = row + 20 * c;
        float d = ts_half(ts_u16(b)), m = ts_half(ts_u16(b + 2));
        for (int j = 0; j < 16; ++j) {
            out[j] = (float)(b[4 + j] & 0x0F) * d + m;
            out[j + 16] = (float)(b[4 + j] >> 4) * d + m;
        }
        return;
    }
    case TY_Q5_0: {
        const u8* b = row + 22 * c;
        float d = ts_half(ts_u16(b));
        u32 qh = ts_u32(b + 2);
        for (int j = 0; j < 16; ++j) {
            int h0 = (int)(((qh >> j) & 1u) << 4), h1 = (int)(((qh >> (j + 16)) & 1u) << 4);
            out[j] = (float)(((b[6 + j] & 0x0F) | h0) - 16) * d;
            out[j + 16] = (float)(((b[6 + j] >> 4) | h1) - 16) * d;
        }
        return;
    }
    case TY_Q5_1: {
        const u8* b = row + 24 * c;
        float d = ts_half(ts_u16(b)), m = ts_half(ts_u16(b + 2));
        u32 qh = ts_u32(b + 4);
        for (int j = 0; j < 16; ++j) {
            int h0 = (int)(((qh >> j) & 1u) << 4), h1 = (int)(((qh >> (j + 16)) & 1u) << 4);
            out[j] = (float)((b[8 + j] & 0x0F) | h0) * d + m;
            out[j + 16] = (float)((b[8 + j] >> 4) | h1) * d + m;
        }
        return;
    }
    case TY_Q8_0: {
        const u8* b = row + 34 * c;
        float d = ts_half(ts_u16(b));
        for (int j = 0; j < 32; ++j) out[j] = (float)(signed char)b[2 + j] * d;
        return;
    }
    case TY_Q4_K:
    case TY_Q5_K: {
        // Super-blocks of 256: d, dmin, scales[12], (Q5_K: qh[32]), qs[128]. Sub-block j uses
        // the low (j even) or high (j odd) nibbles of qs[32*(j/2) ..][0..32].
        int five = ty == TY_Q5_K;
        const u8* b = row + (five ? 176 : 144) * (c / 8);
        int j = c % 8;
        float d = ts_half(ts_u16(b)), dmin = ts_half(ts_u16(b + 2));
        float sc, mn;
        ts_k_scale_min(j, b + 4, &sc, &mn);
        float dj = d * sc, mj = dmin * mn;
        const u8* qs = b + (five ? 48 : 16) + 32 * (j / 2);
        int shift = 4 * (j % 2);
        for (int l = 0; l < 32; ++l) {
            int q = (qs[l] >> shift) & 0x0F;
            if (five && (b[16 + l] & (1u << j))) q += 16;
            out[l] = dj * (float)q - mj;
        }
        return;
    }
    case TY_Q2_K:
    case TY_Q3_K: {
        // Super-blocks of 256 in sixteen 16-value groups. Q2_K: scales[16] (low nibble scale,
        // high nibble min), qs[64], d, dmin; Q3_K: hmask[32], qs[64], scales[12] (6-bit, minus
        // 32), d. Chunk c%8 = 4n + j takes bits 2j..2j+2 of qs[32n ..][0..32] (and bit 4n + j of
        // hmask[0..32], clear meaning minus 4); its groups are 2(c%8) and 2(c%8) + 1.
        int two = ty == TY_Q2_K;
        const u8* b = row + (two ? 84 : 110) * (c / 8);
        int j = c % 8, n = j / 4, shift = 2 * (j % 4);
        const u8* qs = b + (two ? 16 : 32) + 32 * n;
        float d = ts_half(ts_u16(b + (two ? 80 : 108)));
        for (int h = 0; h < 2; ++h) {
            int g = 2 * j + h;
            float dl, ml = 0.0f;
            if (two) {
                dl = d * (float)(b[g] & 0x0F);
                ml = ts_half(ts_u16(b + 82)) * (float)(b[g] >> 4);
            } else {
                const u8* sc = b + 96;
                int low = g < 8 ? (sc[g] & 0x0F) : (sc[g - 8] >> 4);
                int high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                dl = d * (float)((low | (high << 4)) - 32);
            }
            for (int l = 16 * h; l < 16 * h + 16; ++l) {
                int q = (qs[l] >> shift) & 3;
                if (!two && !(b[l] & (1u << (4 * n + j % 4)))) q -= 4;
                out[l] = dl * (float)q - ml;
            }
        }
        return;
    }
    case TY_IQ4_NL:
    case TY_IQ4_XS: {
        // Non-linear levels (ggml's kvalues_iq4nl), 32 per block. IQ4_NL: d, qs[16]; IQ4_XS:
        // super-blocks of 256, d, scales_h (u16), scales_l[4], qs[128], sub-block c%8's scale
        // 6 bits (low four in scales_l, high two in scales_h) minus 32, times d.
        const signed char levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
        const u8* qs;
        float dl;
        if (ty == TY_IQ4_NL) {
            const u8* b = row + 18 * c;
            dl = ts_half(ts_u16(b));
            qs = b + 2;
        } else {
            const u8* b = row + 136 * (c / 8);
            int ib = c % 8;
            int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((ts_u16(b + 2) >> (2 * ib)) & 3) << 4);
            dl = ts_half(ts_u16(b)) * (float)(ls - 32);
            qs = b + 8 + 16 * ib;
        }
        for (int j = 0; j < 16; ++j) {
            out[j] = dl * (float)levels[qs[j] & 0x0F];
            out[j + 16] = dl * (float)levels[qs[j] >> 4];
        }
        return;
    }
    case TY_TQ1_0:
    case TY_TQ2_0: {
        // Super-blocks of 256 ternary digits (-1, 0, 1) on one f16 d at the block's end. TQ2_0:
        // qs[64], value 128j + 32l + m in bits 2l of byte 32j + m, as 0..2. TQ1_0: qs[48], qh[4],
        // five base-3 digits per byte as its fraction of 243, most significant first: digit n of
        // byte m is ((byte * 3^n mod 256) * 3) >> 8; bytes 0..32 hold values 32n + m, 32..48
        // values 160 + 16n + m, qh (four digits) values 240 + 4n + m.
        int one = ty == TY_TQ1_0;
        const u8* b = row + (one ? 54 : 66) * (c / 8);
        float d = ts_half(ts_u16(b + (one ? 52 : 64)));
        for (int l = 0; l < 32; ++l) {
            int i = 32 * (c % 8) + l, q;
            if (one) {
                int at, n;
                if (i < 160) { at = i % 32; n = i / 32; }
                else if (i < 240) { at = 32 + (i - 160) % 16; n = (i - 160) / 16; }
                else { at = 48 + (i - 240) % 4; n = (i - 240) / 4; }
                int p3 = n == 0 ? 1 : n == 1 ? 3 : n == 2 ? 9 : n == 3 ? 27 : 81;
                q = ((((int)b[at] * p3) & 0xFF) * 3) >> 8;
            } else {
                q = (b[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
            }
            out[l] = d * (float)(q - 1);
        }
        return;
    }
    case TY_MXFP4: {
        // Blocks of 32: e (E8M0), qs[16]; OCP E2M1 values doubled to integers (ts_fp4), the scale
        // 2^(e - 128) halved to match (subnormal for e < 2). Low nibbles are values 0..16.
        const u8* b = row + 17 * c;
        float d = ts_bits_to_float(b[0] < 2 ? 0x00200000u << b[0] : (u32)(b[0] - 1) << 23);
        for (int j = 0; j < 16; ++j) {
            out[j] = d * (float)ts_fp4(b[1 + j] & 0x0F);
            out[j + 16] = d * (float)ts_fp4(b[1 + j] >> 4);
        }
        return;
    }
    case TY_NVFP4: {
        // Blocks of 64: d[4] (unsigned E4M3, bias 7, one per 16 values; 0 and 0x7f read as 0;
        // halved as MXFP4's), qs[32]; sub-block s's values are the low nibbles of qs[8s..8s+8],
        // then their high nibbles. Chunk c is sub-blocks 2(c%2) and 2(c%2) + 1 of block c/2.
        const u8* b = row + 36 * (c / 2);
        for (int h = 0; h < 2; ++h) {
            int s = 2 * (c % 2) + h, x = b[s], e = (x >> 3) & 15, m = x & 7;
            float d = (x == 0 || x == 0x7f) ? 0.0f : 0.5f * (e == 0 ? (float)m * (1.0f / 512.0f) : (1.0f + (float)m / 8.0f) * ts_bits_to_float((u32)(e - 7 + 127) << 23));
            for (int j = 0; j < 8; ++j) {
                out[16 * h + j] = (float)ts_fp4(b[4 + 8 * s + j] & 0x0F) * d;
                out[16 * h + j + 8] = (float)ts_fp4(b[4 + 8 * s + j] >> 4) * d;
            }
        }
        return;
    }
    case TY_Q1_0:
    case TY_Q2_0: {
        // d, qs[16]. Q1_0: blocks of 128 sign bits (bit j of qs[j/8]: 1 for +d, 0 for -d);
        // Q2_0: blocks of 64 two-bit digits (bits 2(j%4) of qs[j/4]: 0..3 for -1..2, times d).
        int one = ty == TY_Q1_0, per = one ? 4 : 2;
        const u8* b = row + 18 * (c / per);
        float d = ts_half(ts_u16(b));
        for (int l = 0; l < 32; ++l) {
            int j = 32 * (c % per) + l;
            int q = one ? (((b[2 + j / 8] >> (j % 8)) & 1) ? 1 : -1) : (int)((b[2 + j / 4] >> (2 * (j % 4))) & 3) - 1;
            out[l] = (float)q * d;
        }
        return;
    }
    case TY_Q6_K: {
        // Super-blocks of 256: ql[128], qh[64], scales i8[16], d. Sub-block c%8 is quarter
        // (c%8)%4 of half (c%8)/4.
        const u8* b = row + 210 * (c / 8);
        int j = c % 8, half = j / 4, quarter = j % 4;
        float d = ts_half(ts_u16(b + 208));
        const u8* ql = b + 64 * half + (quarter % 2) * 32;
        const u8* qh = b + 128 + 32 * half;
        const signed char* sc = (const signed char*)(b + 192 + 8 * half);
        int lo_shift = (quarter / 2) * 4, hi_shift = 2 * quarter;
        for (int l = 0; l < 32; ++l) {
            int q = (((ql[l] >> lo_shift) & 0x0F) | (((qh[l] >> hi_shift) & 3) << 4)) - 32;
            out[l] = d * (float)sc[l / 16 + 2 * quarter] * (float)q;
        }
        return;
    }
    default:
        for (int l = 0; l < 32; ++l) out[l] = ts_float_at(ty, row, 32LL * c + l);
        return;
    }
}

// ---------------------------------------------------------------------------------------------
// Block reductions (shared-memory trees; blockDim.x a power of two).
// ---------------------------------------------------------------------------------------------

__device__ float ts_block_sum(float v, float* red) {
    int tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

__device__ float ts_block_max(float v, float* red) {
    int tid = threadIdx.x;
    red[tid] = v;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] = fmaxf(red[tid], red[tid + s]);
        __syncthreads();
    }
    float r = red[0];
    __syncthreads();
    return r;
}

// score[j] = exp(score[j] - mx) for the j < len this thread owns (j = tid, tid + blockDim, ...,
// as it computed them); their sum over the block, which every thread gets.
__device__ float ts_exp_sum(float* score, int len, float mx, float* red) {
    float local_sum = 0.0f;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float e = expf(score[j] - mx);
        score[j] = e;
        local_sum += e;
    }
    return ts_block_sum(local_sum, red);
}

// Is (v, i) ahead of (bv, bi) in "largest first, lowest index on ties, NaN never" order?
// bi < 0 means "nothing yet".
__device__ __forceinline__ int ts_ahead(float v, int i, float bv, int bi) {
    if (i < 0 || v != v) return 0;
    if (bi < 0) return 1;
    return v > bv || (v == bv && i < bi);
}

// The best (value, index) of the block; every thread gets it.
__device__ int ts_block_argbest(float v, int i, float* red, int* redi) {
    int tid = threadIdx.x;
    red[tid] = v;
    redi[tid] = i;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (tid < s && ts_ahead(red[tid + s], redi[tid + s], red[tid], redi[tid])) {
            red[tid] = red[tid + s];
            redi[tid] = redi[tid + s];
        }
        __syncthreads();
    }
    int r = redi[0];
    __syncthreads();
    return r;
}

// ---------------------------------------------------------------------------------------------
// Kernels.
// ---------------------------------------------------------------------------------------------

// Matmul: y[t, r] = sum_k x[t, k] * W[r, k] for t < m (m <= TS_MAX_TOKENS); each weight element
// is read once and used for every token. A weight row is shared by `lanes` threads (a power of
// two dividing blockDim.x), so a block holds blockDim.x / lanes rows: the host picks lanes from
// the row length, so a short row (SmolLM2's k = 576 is 18 Q4_1 chunks) does not leave most of a
// block idle while a long one still gets the whole block. Three kernels by weight layout, one
// epilogue: ts_matmul (float types element by element, any k), ts_matmul_v (float types 16 bytes
// at a time), ts_matmul_q (packed 32-element chunks, every type). Dynamic shared: m * blockDim.x
// floats.
//
// One launch multiplies the same x by up to three matrices (Q, K and V; gate and up), which
// saves launches where a decode step is bound by them: blocks [0, b1) compute matrix 0, [b1, b2)
// matrix 1 and [b2, gridDim.x) matrix 2, each with its own weights, type, row count, lanes and
// output (y's rows are `rows` apart). A one-matrix launch passes b1 = b2 = gridDim.x. Each row's
// arithmetic is the same as in a launch of its matrix alone.
#define TS_MATMUL_PARAMS                                                                       \
    int k, const float *x, int x_stride, int m, const u8 *w0, int ty0, long long rb0, int rows0, \
        int lanes0, float *y0, int b1, const u8 *w1, int ty1, long long rb1, int rows1,         \
        int lanes1, float *y1, int b2, const u8 *w2, int ty2, long long rb2, int rows2, int lanes2, float *y2
#define TS_MATMUL_SEGMENTS w0, ty0, rb0, rows0, lanes0, y0, b1, w1, ty1, rb1, rows1, lanes1, y1, b2, w2, ty2, rb2, rows2, lanes2, y2

// The matrix this block computes, and the block's index among that matrix's blocks.
struct TsMatmulSegment {
    const u8* w;
    int ty;
    long long row_bytes;
    int rows, lanes;
    float* y;
    int block;
};

__device__ __forceinline__ TsMatmulSegment ts_matmul_segment(const u8* w0, int ty0, long long rb0, int rows0, int lanes0, float* y0, int b1,
                                                             const u8* w1, int ty1, long long rb1, int rows1, int lanes1, float* y1, int b2,
                                                             const u8* w2, int ty2, long long rb2, int rows2, int lanes2, float* y2) {
    int b = blockIdx.x;
    TsMatmulSegment s;
    if (b >= b2) {
        s.w = w2; s.ty = ty2; s.row_bytes = rb2; s.rows = rows2; s.lanes = lanes2; s.y = y2; s.block = b - b2;
    } else if (b >= b1) {
        s.w = w1; s.ty = ty1; s.row_bytes = rb1; s.rows = rows1; s.lanes = lanes1; s.y = y1; s.block = b - b1;
    } else {
        s.w = w0; s.ty = ty0; s.row_bytes = rb0; s.rows = rows0; s.lanes = lanes0; s.y = y0; s.block = b;
    }
    return s;
}

// Sums each row's lanes for every token with one shared-memory tree (the same tree for every
// launch of a shape, so the result does not depend on scheduling) and lane 0 writes y (r < 0:
// a thread past the last row, which still takes part in the barriers).
template <int MAXM>
__device__ __forceinline__ void ts_matmul_store(const float* acc, float* red, int lanes, int r, int m, float* y, int y_stride) {
    int tid = threadIdx.x, bd = blockDim.x, lane = tid & (lanes - 1);
    for (int t = 0; t < MAXM; ++t)
        if (t < m) red[t * bd + tid] = acc[t];
    __syncthreads();
    for (int s = lanes / 2; s > 0; s >>= 1) {
        if (lane < s)
            for (int t = 0; t < MAXM; ++t)
                if (t < m) red[t * bd + tid] += red[t * bd + tid + s];
        __syncthreads();
    }
    if (lane == 0 && r >= 0)
        for (int t = 0; t < MAXM; ++t)
            if (t < m) y[(long long)t * y_stride + r] = red[t * bd + tid];
}

// This thread's weight row index in its segment (r = -1 past the last row; the row pointer is
// then null), its lane, and its sums set to zero.
template <int MAXM>
__device__ __forceinline__ const u8* ts_matmul_begin(const TsMatmulSegment& sg, int* r, int* lane, float* acc) {
    for (int t = 0; t < MAXM; ++t) acc[t] = 0.0f;
    *lane = threadIdx.x & (sg.lanes - 1);
    *r = sg.block * (blockDim.x / sg.lanes) + threadIdx.x / sg.lanes;
    if (*r >= sg.rows) *r = -1;
    return *r < 0 ? 0 : sg.w + (long long)*r * sg.row_bytes;
}

extern "C" __global__ void ts_matmul(TS_MATMUL_PARAMS) {
    DYNAMIC_SHARED(float, red);
    TsMatmulSegment sg = ts_matmul_segment(TS_MATMUL_SEGMENTS);
    int ty = sg.ty, lanes = sg.lanes, r, lane;
    float acc[TS_MAX_TOKENS];
    const u8* row = ts_matmul_begin<TS_MAX_TOKENS>(sg, &r, &lane, acc);
    if (row) {
        for (int i = lane; i < k; i += lanes) {
            float wv = ts_float_at(ty, row, i);
            for (int t = 0; t < TS_MAX_TOKENS; ++t)
                if (t < m) acc[t] += wv * x[(long long)t * x_stride + i];
        }
    }
    ts_matmul_store<TS_MAX_TOKENS>(acc, red, lanes, r, m, sg.y, sg.rows);
}

// Float weights 16 bytes at a time (ts_matmul_v, ts_matmul_v1, ts_matmul_v1b2): unit u of a row
// is its bytes [16u, 16u + 16), 4 f32 or 8 f16/bf16 values, and x is read 16 bytes at a time
// too. Needs k * size % 16 == 0, row_bytes % 16 == 0, w and x 16-byte aligned and x_stride % 4
// == 0 (the host checks).
//
// One unit (`per` values) times the x values at xr: the products summed in order into one float,
// which the caller adds to its token's sum.
__device__ __forceinline__ float ts_unit_dot(int ty, int per, uint4 w, const float* xr) {
    u32 bits[4] = {w.x, w.y, w.z, w.w};
    float wv[8];
    for (int l = 0; l < 4; ++l) {
        if (ty == TY_F32) {
            wv[l] = ts_bits_to_float(bits[l]);
        } else {
            u16 lo = (u16)(bits[l] & 0xFFFFu), hi = (u16)(bits[l] >> 16);
            wv[2 * l] = ty == TY_F16 ? ts_half(lo) : ts_bf16(lo);
            wv[2 * l + 1] = ty == TY_F16 ? ts_half(hi) : ts_bf16(hi);
        }
    }
    uint4 a = ts_load16(xr);
    float s = wv[0] * ts_bits_to_float(a.x) + wv[1] * ts_bits_to_float(a.y) + wv[2] * ts_bits_to_float(a.z) + wv[3] * ts_bits_to_float(a.w);
    if (per == 8) {
        uint4 b = ts_load16(xr + 4);
        s += wv[4] * ts_bits_to_float(b.x) + wv[5] * ts_bits_to_float(b.y) + wv[6] * ts_bits_to_float(b.z) + wv[7] * ts_bits_to_float(b.w);
    }
    return s;
}

// Up to 8 tokens: a thread loads 4 of its units (TS_MATMUL_BATCH) before it uses any, since a
// GEMV is bound by the bytes waiting on memory and one load in flight per thread is too few to
// cover a GPU's memory latency; then it multiplies them by every token.
#define TS_MATMUL_BATCH 4
extern "C" __global__ void ts_matmul_v(TS_MATMUL_PARAMS) {
    DYNAMIC_SHARED(float, red);
    TsMatmulSegment sg = ts_matmul_segment(TS_MATMUL_SEGMENTS);
    int ty = sg.ty, lanes = sg.lanes, r, lane;
    float acc[TS_MAX_TOKENS];
    const u8* row = ts_matmul_begin<TS_MAX_TOKENS>(sg, &r, &lane, acc);
    if (row) {
        int per = ty == TY_F32 ? 4 : 8;
        int units = k / per;
        for (int u0 = lane; u0 < units; u0 += TS_MATMUL_BATCH * lanes) {
            uint4 q[TS_MATMUL_BATCH];
            TS_UNROLL for (int j = 0; j < TS_MATMUL_BATCH; ++j)
                if (u0 + j * lanes < units) q[j] = ts_load16_stream(row + 16LL * (u0 + j * lanes));
            TS_UNROLL for (int j = 0; j < TS_MATMUL_BATCH; ++j) {
                int u = u0 + j * lanes;
                if (u >= units) continue;
                for (int t = 0; t < TS_MAX_TOKENS; ++t) {
                    if (t >= m) break;
                    acc[t] += ts_unit_dot(ty, per, q[j], x + (long long)t * x_stride + (long long)u * per);
                }
            }
        }
    }
    ts_matmul_store<TS_MAX_TOKENS>(acc, red, lanes, r, m, sg.y, sg.rows);
}

// One token (a decode step's GEMV), pipelined: a thread issues the loads of its next BATCH units
// before it multiplies the batch it holds, so its loads are in flight while it computes (in
// ts_matmul_v they are not). The units are summed in the same order as ts_matmul_v sums them:
// the same bits. ts_matmul_v1 holds 2 x 4 units, ts_matmul_v1b2 2 x 2 (fewer registers).
template <int BATCH>
__device__ __forceinline__ void ts_matmul_v1_body(TS_MATMUL_PARAMS) {
    DYNAMIC_SHARED(float, red);
    TsMatmulSegment sg = ts_matmul_segment(TS_MATMUL_SEGMENTS);
    int ty = sg.ty, lanes = sg.lanes, r, lane;
    float acc[1];
    const u8* row = ts_matmul_begin<1>(sg, &r, &lane, acc);
    if (row) {
        int per = ty == TY_F32 ? 4 : 8;
        int units = k / per;
        uint4 q[BATCH], next[BATCH];
        TS_UNROLL for (int j = 0; j < BATCH; ++j)
            if (lane + j * lanes < units) q[j] = ts_load16_stream(row + 16LL * (lane + j * lanes));
        for (int u0 = lane; u0 < units; u0 += BATCH * lanes) {
            int n0 = u0 + BATCH * lanes;
            TS_UNROLL for (int j = 0; j < BATCH; ++j)
                if (n0 + j * lanes < units) next[j] = ts_load16_stream(row + 16LL * (n0 + j * lanes));
            TS_UNROLL for (int j = 0; j < BATCH; ++j) {
                int u = u0 + j * lanes;
                if (u < units) acc[0] += ts_unit_dot(ty, per, q[j], x + (long long)u * per);
            }
            TS_UNROLL for (int j = 0; j < BATCH; ++j) q[j] = next[j];
        }
    }
    ts_matmul_store<1>(acc, red, lanes, r, m, sg.y, sg.rows);
}
extern "C" __global__ void ts_matmul_v1(TS_MATMUL_PARAMS) {
    ts_matmul_v1_body<4>(k, x, x_stride, m, TS_MATMUL_SEGMENTS);
}
extern "C" __global__ void ts_matmul_v1b2(TS_MATMUL_PARAMS) {
    ts_matmul_v1_body<2>(k, x, x_stride, m, TS_MATMUL_SEGMENTS);
}

// Packed weights (every type, k % 32 == 0): unit c of a row is its 32-element chunk c, which one
// thread decodes and multiplies by x[32c, 32c + 32). Threads of a warp work on neighbouring chunks,
// so reading x straight from global memory would touch 32 cache lines per load; the block stages
// x through shared memory instead, TS_XTILE floats at a time (split among the m tokens), each
// chunk's eight 16-byte groups rotated by the chunk's index so that neighbouring threads reading
// the same group hit different banks. Each thread still takes its chunks in increasing order and
// sums each chunk's products in element order: the staging changes where x is read from, not
// one bit of the result. Dynamic shared: m * blockDim.x + TS_XTILE floats.
#define TS_XTILE 8192

__device__ __forceinline__ int ts_xtile_slot(int cl, int l) {
    return 32 * cl + ((((l >> 2) + cl) & 7) << 2) + (l & 3);
}

template <int MAXM>
__device__ __forceinline__ void ts_matmul_q_body(TS_MATMUL_PARAMS) {
    DYNAMIC_SHARED(float, red);
    float* xs = red + m * blockDim.x;
    TsMatmulSegment sg = ts_matmul_segment(TS_MATMUL_SEGMENTS);
    int ty = sg.ty, lanes = sg.lanes, r, lane;
    float acc[MAXM];
    const u8* row = ts_matmul_begin<MAXM>(sg, &r, &lane, acc);
    int chunks = k / 32, tile = TS_XTILE / 32 / m;
    for (int c0 = 0; c0 < chunks; c0 += tile) {
        int n = chunks - c0 < tile ? chunks - c0 : tile;
        __syncthreads();  // every thread is done with the previous tile
        for (int e = threadIdx.x; e < m * n * 32; e += blockDim.x) {
            int t = e / (n * 32), i = e - t * n * 32;
            xs[t * tile * 32 + ts_xtile_slot(i >> 5, i & 31)] = x[(long long)t * x_stride + 32LL * c0 + i];
        }
        __syncthreads();
        if (!row) continue;
        // This thread's first chunk in the tile: chunks c = lane (mod lanes), as without tiles.
        int first = c0 + ((lane - c0 % lanes) % lanes + lanes) % lanes;
        for (int c = first; c < c0 + n; c += lanes) {
            float wv[32];
            ts_dequant32(ty, row, c, wv);
            int cl = c - c0;
            for (int t = 0; t < MAXM; ++t) {
                if (t >= m) break;
                const float* xr = xs + t * tile * 32;
                float s = 0.0f;
                TS_UNROLL for (int g = 0; g < 8; ++g) {
                    uint4 a = ts_load16(xr + ts_xtile_slot(cl, 4 * g));
                    s += wv[4 * g] * ts_bits_to_float(a.x);
                    s += wv[4 * g + 1] * ts_bits_to_float(a.y);
                    s += wv[4 * g + 2] * ts_bits_to_float(a.z);
                    s += wv[4 * g + 3] * ts_bits_to_float(a.w);
                }
                acc[t] += s;
            }
        }
    }
    ts_matmul_store<MAXM>(acc, red, lanes, r, m, sg.y, sg.rows);
}

// MAXM as in ts_matmul_v: ts_matmul_q1 is the one-token variant, with the same bits.
extern "C" __global__ void ts_matmul_q(TS_MATMUL_PARAMS) {
    ts_matmul_q_body<TS_MAX_TOKENS>(k, x, x_stride, m, TS_MATMUL_SEGMENTS);
}
extern "C" __global__ void ts_matmul_q1(TS_MATMUL_PARAMS) {
    ts_matmul_q_body<1>(k, x, x_stride, m, TS_MATMUL_SEGMENTS);
}

// Rows `ids` of a packed table: out[i, :] = decode(W[ids[i], :]). One block per id. Float
// types go element by element (any width); packed types by 32-element chunks.
extern "C" __global__ void ts_get_rows(const u8* w, int ty, long long row_bytes, int cols, const u32* ids, float* out) {
    int i = blockIdx.x, tid = threadIdx.x, bd = blockDim.x;
    const u8* row = w + (long long)ids[i] * row_bytes;
    float* o = out + (long long)i * cols;
    if (ty == TY_F32 || ty == TY_F16 || ty == TY_BF16) {
        for (int j = tid; j < cols; j += bd) o[j] = ts_float_at(ty, row, j);
    } else {
        for (int c = tid; c < cols / 32; c += bd) ts_dequant32(ty, row, c, o + 32 * c);
    }
}

// RMSNorm over rows of n: y = x / sqrt(mean(x^2) + eps) * w (w has n values, shared by all rows;
// for QK-norm a "row" is one head). One block per row.
// With a residual r (not null), x += r first and the norm is of the sum: the residual add and
// the next norm in one launch, with the bits of the two launches (each thread adds, stores and
// later reads back the same elements).
// Blocks from `rows1` on normalize the rows of a second tensor x2 (weights w2, into y2, no
// residual): QK-norm of Q and K in one launch. A one-tensor launch passes rows1 = gridDim.x.
extern "C" __global__ void ts_rms_norm(float* x, const float* r, const float* w, float* y, int n, float eps, int rows1, float* x2, const float* w2, float* y2) {
    SHARED(float, red, TS_MAX_BLOCK);
    long long row = blockIdx.x;
    if (row >= rows1) {
        row -= rows1;
        x = x2;
        w = w2;
        y = y2;
        r = 0;
    }
    float* xr = x + row * n;
    float* yr = y + row * n;
    if (r) {
        const float* rr = r + row * n;
        for (int i = threadIdx.x; i < n; i += blockDim.x) xr[i] = xr[i] + rr[i];
    }
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = ts_block_sum(ss, red);
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * scale * w[i];
}

// LayerNorm: y = (x - mean) / sqrt(var + eps) * w + b. One block per row.
extern "C" __global__ void ts_layer_norm(const float* x, const float* w, const float* b, float* y, int n, float eps) {
    SHARED(float, red, TS_MAX_BLOCK);
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += xr[i];
    float mean = ts_block_sum(s, red) / (float)n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (xr[i] - mean) * (xr[i] - mean);
    ss = ts_block_sum(ss, red);
    float scale = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (xr[i] - mean) * scale * w[i] + b[i];
}

// y[i] = a[i] + b[i % bn] (bn = n: residual add; bn = row width: bias).
extern "C" __global__ void ts_add(const float* a, const float* b, float* y, long long n, long long bn) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i % bn];
}

// x *= s in place (Gemma's embedding scale).
// Gemma 2's soft-capping in place: x = c * tanh(x / c).
extern "C" __global__ void ts_softcap(float* x, float c, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = c * tanhf(x[i] / c);
}

extern "C" __global__ void ts_scale(float* x, float s, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * s;
}

__device__ __forceinline__ float ts_silu(float x) {
    return x / (1.0f + expf(-x));
}
__device__ __forceinline__ float ts_gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978846f * (x + 0.044715f * x * x * x)));
}

// Gated activations: y = act(gate) * up, or y = act(gate) when up is null.
// act: 0 SiLU, 1 GELU (tanh approximation), 2 sigmoid (MoE scores), 3 GPT-OSS's clamped
// SwiGLU: min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(up, -7, 7) + 1) (up required).
extern "C" __global__ void ts_glu(const float* gate, const float* up, float* y, long long n, int act) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = gate[i];
    if (act == 3) {
        g = fminf(g, 7.0f);
        float u = fminf(fmaxf(up[i], -7.0f), 7.0f);
        y[i] = g / (1.0f + expf(-1.702f * g)) * (u + 1.0f);
        return;
    }
    float a = act == 0 ? ts_silu(g) : act == 1 ? ts_gelu_tanh(g) : 1.0f / (1.0f + expf(-g));
    y[i] = up ? a * up[i] : a;
}

// RoPE in place on x: [tokens, n_head * hd]. `table`: [tokens, n_rot / 2] (cos, sin) pairs
// computed on the host in f64 and rounded to f32. neox rotates (i, i + n_rot/2), normal
// rotates (2i, 2i + 1). One thread per (token, head, pair). A second tensor x2 of n_head2 heads
// per token (K beside Q; n_head2 = 0 for none) is rotated by the same launch, threads past x's
// pairs taking x2's.
extern "C" __global__ void ts_rope(float* x, int n_head, float* x2, int n_head2, const float* table, int tokens, int hd, int n_rot, int neox) {
    int half = n_rot / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long first = (long long)tokens * n_head * half;
    if (idx >= first + (long long)tokens * n_head2 * half) return;
    if (idx >= first) {
        idx -= first;
        x = x2;
        n_head = n_head2;
    }
    int i = (int)(idx % half);
    long long th = idx / half;
    int t = (int)(th / n_head);
    float* head = x + th * hd;
    float c = table[((long long)t * half + i) * 2], s = table[((long long)t * half + i) * 2 + 1];
    int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    float x0 = head[a], x1 = head[b];
    head[a] = x0 * c - x1 * s;
    head[b] = x0 * s + x1 * c;
}

// Causal GQA attention of query rows q: [m, n_head * hd] at positions pos[m] over a cache
// k, v: [kv_len, n_kv * hd]; window > 0 keeps the last `window` positions; sinks (null: none)
// holds one logit per query head that joins the softmax and takes its share to no value;
// softcap > 0 turns each scaled score s into softcap * tanh(s / softcap) (Gemma 2).
// One block per (head, query). Dynamic shared: (kv_len + blockDim) floats (scores, then
// probabilities).
extern "C" __global__ void ts_attention(const float* q, const u32* pos, const float* k, const float* v, float* out,
                                        int n_head, int n_kv, int hd, int window, float scale, const float* sinks, float softcap) {
    DYNAMIC_SHARED(float, smem);
    int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, bd = blockDim.x;
    int kvh = h / (n_head / n_kv);
    int p = (int)pos[t];
    int first = window > 0 && p + 1 > window ? p + 1 - window : 0;
    int len = p + 1 - first;
    float* red = smem;
    float* score = smem + bd;
    const float* qh = q + ((long long)t * n_head + h) * hd;
    long long kv_stride = (long long)n_kv * hd;
    float local_max = TS_NEG_INF;
    for (int j = tid; j < len; j += bd) {
        const float* kj = k + (first + j) * kv_stride + (long long)kvh * hd;
        float s = 0.0f;
        for (int d = 0; d < hd; ++d) s += qh[d] * kj[d];
        s *= scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        score[j] = s;
        local_max = fmaxf(local_max, s);
    }
    float mx = ts_block_max(local_max, red);
    if (sinks) mx = fmaxf(mx, sinks[h]);
    float sum = ts_exp_sum(score, len, mx, red);
    if (sinks) sum += expf(sinks[h] - mx);
    for (int d = tid; d < hd; d += bd) {
        float o = 0.0f;
        for (int j = 0; j < len; ++j) o += score[j] * v[(first + j) * kv_stride + (long long)kvh * hd + d];
        out[((long long)t * n_head + h) * hd + d] = o / sum;
    }
}

// Row softmax, max-subtracted (-inf entries give 0). One block per row of n.
extern "C" __global__ void ts_softmax(const float* x, float* y, int n) {
    SHARED(float, red, TS_MAX_BLOCK);
    const float* xr = x + (long long)blockIdx.x * n;
    float* yr = y + (long long)blockIdx.x * n;
    float mx = TS_NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mx = fmaxf(mx, xr[i]);
    mx = ts_block_max(mx, red);
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float e = expf(xr[i] - mx);
        yr[i] = e;
        s += e;
    }
    s = ts_block_sum(s, red);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = yr[i] / s;
}

// The k best indices of each row of n (largest first, lowest index on ties, NaN skipped);
// k <= 64. One block per row. k = 1 is argmax. Unfilled slots (all NaN) get n.
extern "C" __global__ void ts_top_k(const float* x, u32* ids, int n, int k) {
    SHARED(float, red, TS_MAX_BLOCK);
    SHARED(int, redi, TS_MAX_BLOCK);
    SHARED(int, chosen, 64);
    const float* xr = x + (long long)blockIdx.x * n;
    for (int j = 0; j < k; ++j) {
        float bv = 0.0f;
        int bi = -1;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            int taken = 0;
            for (int c = 0; c < j; ++c) taken |= chosen[c] == i;
            if (!taken && ts_ahead(xr[i], i, bv, bi)) {
                bv = xr[i];
                bi = i;
            }
        }
        int best = ts_block_argbest(bv, bi, red, redi);
        if (threadIdx.x == 0) {
            chosen[j] = best;
            ids[(long long)blockIdx.x * k + j] = best < 0 ? (u32)n : (u32)best;
        }
        __syncthreads();
    }
}

// MoE routing of each row of n_expert logits (<= 256): softmax or sigmoid scores, the k best
// experts (largest first, lowest index on ties), weights optionally renormalised to sum 1.
// DeepSeek V3's additions: `bias` (null: none) added to the scores for the choice only; with
// n_group > 0 the choice limited to the `keep` groups (of n_expert / n_group experts) whose two
// best biased scores sum highest; the weights multiplied by `scale` last.
// One thread per row: the row is short and the selection sequential.
extern "C" __global__ void ts_moe_route(const float* logits, u32* ids, float* weights, int rows, int n_expert, int k, int sigmoid, int normalize,
                                        const float* bias, int n_group, int keep, float scale) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    const float* l = logits + (long long)r * n_expert;
    float p[256], c[256];
    if (sigmoid) {
        for (int e = 0; e < n_expert; ++e) p[e] = 1.0f / (1.0f + expf(-l[e]));
    } else {
        float mx = TS_NEG_INF, s = 0.0f;
        for (int e = 0; e < n_expert; ++e) mx = fmaxf(mx, l[e]);
        for (int e = 0; e < n_expert; ++e) {
            p[e] = expf(l[e] - mx);
            s += p[e];
        }
        for (int e = 0; e < n_expert; ++e) p[e] = p[e] / s;
    }
    for (int e = 0; e < n_expert; ++e) c[e] = bias ? p[e] + bias[e] : p[e];
    if (n_group > 0) {
        int per = n_expert / n_group;
        float best2[256];
        for (int g = 0; g < n_group; ++g) {
            float a = TS_NEG_INF, b = TS_NEG_INF;
            for (int e = g * per; e < (g + 1) * per; ++e) {
                if (c[e] > a) {
                    b = a;
                    a = c[e];
                } else if (c[e] > b) {
                    b = c[e];
                }
            }
            best2[g] = per > 1 ? a + b : a;
        }
        // Mark the kept groups, best first; mask the others out of the choice.
        int kept[256];
        for (int g = 0; g < n_group; ++g) kept[g] = 0;
        for (int j = 0; j < keep && j < n_group; ++j) {
            int best = -1;
            for (int g = 0; g < n_group; ++g)
                if (!kept[g] && ts_ahead(best2[g], g, best < 0 ? 0.0f : best2[best], best)) best = g;
            if (best >= 0) kept[best] = 1;
        }
        for (int e = 0; e < n_expert; ++e)
            if (!kept[e / per]) c[e] = TS_NEG_INF;
    }
    float total = 0.0f;
    for (int j = 0; j < k; ++j) {
        int best = -1;
        for (int e = 0; e < n_expert; ++e) {
            int taken = 0;
            for (int q = 0; q < j; ++q) taken |= (int)ids[(long long)r * k + q] == e;
            if (!taken && ts_ahead(c[e], e, best < 0 ? 0.0f : c[best], best)) best = e;
        }
        ids[(long long)r * k + j] = best < 0 ? (u32)n_expert : (u32)best;
        weights[(long long)r * k + j] = best < 0 ? 0.0f : p[best];
        total += best < 0 ? 0.0f : p[best];
    }
    for (int j = 0; j < k; ++j) {
        float w = weights[(long long)r * k + j];
        if (normalize) w = w / total;
        weights[(long long)r * k + j] = w * scale;
    }
}

// out[i] += alpha[i / d] * y[i]: accumulates one expert's (or the shared expert's) output,
// scaled per token. alpha_stride selects each token's weight in a [tokens, stride] table.
extern "C" __global__ void ts_axpy_rows(float* out, const float* y, const float* alpha, int alpha_stride, long long n, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] += alpha[(i / d) * alpha_stride] * y[i];
}

// s[t] = sigmoid(dot(x[t, :], w)) for the shared-expert gate. One block per token.
extern "C" __global__ void ts_sigmoid_dot(const float* x, const float* w, float* s, int d) {
    SHARED(float, red, TS_MAX_BLOCK);
    const float* xr = x + (long long)blockIdx.x * d;
    float acc = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) acc += xr[i] * w[i];
    acc = ts_block_sum(acc, red);
    if (threadIdx.x == 0) s[blockIdx.x] = 1.0f / (1.0f + expf(-acc));
}

// Copies n floats (the bandwidth probe's reference, and KV-cache appends). Reads and writes
// 16 bytes per thread when both pointers and n allow it (vec4 = 1).
extern "C" __global__ void ts_copy(const float* src, float* dst, long long n, int vec4) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec4) {
        if (4 * i < n) ts_store16(dst + 4 * i, ts_load16(src + 4 * i));
    } else if (i < n) {
        dst[i] = src[i];
    }
}
