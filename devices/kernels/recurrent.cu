// Recurrent layers (Mamba-2's selective scan, a gated DeltaNet's delta rule) and the pieces
// around them, appended to touchstone.cu (same conventions, same helpers).
//
// A state-space layer keeps, per sequence, the convolution's inputs of every position (rows of
// `c`, like a KV cache's rows) and its recurrent state: `[n_head][head_dim][d_state]`, one row
// of `d_state` per (head, value element). The scans run one thread per such row, positions in
// order inside the thread, so the state never crosses threads and a launch's bits do not
// depend on scheduling.

// Columns [xoff, xoff + c) of m rows `xstride` apart into columns [yoff, yoff + c) of rows
// `ystride` apart: the convolution's inputs into the cache's history, a gated query's heads out
// of its joined query/gate rows, latent attention's rotated part of each head out and back.
// One thread per value.
extern "C" __global__ void ts_copy_cols(const float* x, long long xstride, long long xoff, float* y, long long ystride, long long yoff, long long m, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m * c) return;
    long long t = i / c, j = i % c;
    y[t * ystride + yoff + j] = x[t * xstride + xoff + j];
}

// The causal convolution, then SiLU: out[t][ch] = silu(bias[ch] + sum_j w[ch][j] *
// in[start + t - (k - 1) + j][ch]), `hist` holding the inputs of positions 0..start + m in rows
// of c; positions before 0 are zeros (nothing added). One thread per output value.
extern "C" __global__ void ts_conv_silu(const float* hist, const float* w, const float* bias, float* out, int start, int m, int c, int k) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)m * c) return;
    int t = (int)(i / c), ch = (int)(i % c);
    float acc = bias[ch];
    for (int j = 0; j < k; ++j) {
        long long p = (long long)start + t - (k - 1) + j;
        if (p >= 0) acc += w[ch * k + j] * hist[p * c + ch];
    }
    out[i] = ts_silu(acc);
}

__device__ __forceinline__ float ts_softplus(float v) {
    return v > 20.0f ? v : log1pf(expf(v));
}

// Mamba-2's selective scan over m positions. xbc: rows of d_inner + 2 * n_group * d_state
// (x, then B and C per group); the time step of head h at position t: dts[t * dstride + h].
// s0: the state before the first position; the state after position t is written at
// states + t * sstride (sstride 0 with states == s0: updated in place). y: rows of d_inner,
// y = C . state + D x. One thread per (head, value element).
extern "C" __global__ void ts_ssm_scan(const float* xbc, const float* dts, long long dstride, const float* dt_bias, const float* a, const float* dd,
                                       const float* s0, float* states, long long sstride, float* y, int m, int n_head, int hd, int ds, int n_group) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_head * hd) return;
    int h = (int)(i / hd), p = (int)(i % hd);
    int g = h / (n_head / n_group);
    int d_inner = n_head * hd;
    int cd = d_inner + 2 * n_group * ds;
    const float* prev = s0 + i * ds;
    for (int t = 0; t < m; ++t) {
        const float* row = xbc + (long long)t * cd;
        float xp = row[h * hd + p];
        const float* bg = row + d_inner + g * ds;
        const float* cg = row + d_inner + (n_group + g) * ds;
        float step = ts_softplus(dts[t * dstride + h] + dt_bias[h]);
        float decay = expf(step * a[h]);
        float sx = step * xp;
        float* cur = states + t * sstride + i * ds;
        float acc = 0.0f;
        for (int n = 0; n < ds; ++n) {
            float s = decay * prev[n] + sx * bg[n];
            cur[n] = s;
            acc += s * cg[n];
        }
        y[(long long)t * d_inner + i] = acc + dd[h] * xp;
        prev = cur;
    }
}

// A gated DeltaNet's delta rule over m positions. qkv: rows of 2 * n_group * d_state + d_inner
// (q and k per key head, then v per value head); ba: rows of 2 * n_head as the projection stores
// them (per key head, its r = n_head / n_group value heads' b, then their a). Per value head h
// of key head g: q and k L2-normed (q then over sqrt(d_state)), the state decayed by
// exp(A softplus(a + dt_bias)), corrected by k (v - S k) sigmoid(b), read through q. s0, states,
// sstride as ts_ssm_scan's. One thread per (head, value element).
extern "C" __global__ void ts_delta_scan(const float* qkv, const float* ba, const float* dt_bias, const float* a, const float* s0, float* states, long long sstride,
                                         float* y, int m, int n_head, int hd, int ds, int n_group) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_head * hd) return;
    int h = (int)(i / hd), p = (int)(i % hd);
    int r = n_head / n_group, g = h / r, j = h % r;
    int d_inner = n_head * hd;
    int cd = d_inner + 2 * n_group * ds;
    float q_scale = 1.0f / sqrtf((float)ds);
    const float* prev = s0 + i * ds;
    for (int t = 0; t < m; ++t) {
        const float* row = qkv + (long long)t * cd;
        const float* q = row + g * ds;
        const float* k = row + (n_group + g) * ds;
        float vp = row[2 * n_group * ds + h * hd + p];
        float qss = 0.0f, kss = 0.0f;
        for (int n = 0; n < ds; ++n) {
            qss += q[n] * q[n];
            kss += k[n] * k[n];
        }
        float rq = 1.0f / sqrtf(qss + 1e-6f), rk = 1.0f / sqrtf(kss + 1e-6f);
        const float* bar = ba + (long long)t * 2 * n_head + g * 2 * r;
        float beta = 1.0f / (1.0f + expf(-bar[j]));
        float decay = expf(a[h] * ts_softplus(bar[r + j] + dt_bias[h]));
        float* cur = states + t * sstride + i * ds;
        float recalled = 0.0f;
        for (int n = 0; n < ds; ++n) {
            float s = prev[n] * decay;
            cur[n] = s;
            recalled += s * (k[n] * rk);
        }
        float delta = beta * (vp - recalled);
        float acc = 0.0f;
        for (int n = 0; n < ds; ++n) {
            float s = cur[n] + (k[n] * rk) * delta;
            cur[n] = s;
            acc += s * (q[n] * rq * q_scale);
        }
        y[(long long)t * d_inner + i] = acc;
        prev = cur;
    }
}

// The gated norms after a scan, over groups of gs values of rows of `width` (y), the gate z at
// z + t * zstride. mode 0 (Mamba-2): v = y silu(z), RMS-normed over its group, times
// w[group start + i]; mode 1 (gated DeltaNet, a group is a head): y RMS-normed, times w[i], times
// silu(z). One block per group.
extern "C" __global__ void ts_gated_norm(const float* y, const float* z, long long zstride, const float* w, float* out, int width, int gs, float eps, int mode) {
    SHARED(float, red, TS_MAX_BLOCK);
    int per = width / gs;
    long long t = blockIdx.x / per;
    int c0 = (int)(blockIdx.x % per) * gs;
    const float* yr = y + t * width + c0;
    const float* zr = z + t * zstride + c0;
    float* o = out + t * width + c0;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < gs; i += blockDim.x) {
        float v = mode == 0 ? yr[i] * ts_silu(zr[i]) : yr[i];
        ss += v * v;
    }
    ss = ts_block_sum(ss, red);
    float r = 1.0f / sqrtf(ss / (float)gs + eps);
    for (int i = threadIdx.x; i < gs; i += blockDim.x) {
        o[i] = mode == 0 ? yr[i] * ts_silu(zr[i]) * r * w[c0 + i] : yr[i] * r * w[i] * ts_silu(zr[i]);
    }
}
