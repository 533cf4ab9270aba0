// Latent attention (DeepSeek MLA) in the absorbed form, appended to touchstone.cu (same
// conventions, same helpers): keys and values are never expanded. The cache holds, per
// position, the normed latent (`r` values) and the shared rotated key (`rr` values).

// Each query row t (positions pos[t], heads of nope + rr values: the unrotated part, then the
// rotated) against the cached latents [kv_len, r] and rotated keys [kv_len, rr] of positions
// 0..=pos[t]: the unrotated query taken into the latent's space through the head's key rows of
// the expansion (k_b: [n_head][nope][r]), scores (latent . q_abs + k_pe . q_pe) * scale, their
// softmax, the weighted sum of latents taken out through the head's value rows (v_b:
// [n_head][vd][r]) into out: [m, n_head * vd]. One block per (head, query). Dynamic shared:
// (blockDim + 2 r + kv_len) floats (reduction, q_abs, the weighted latent, scores).
extern "C" __global__ void ts_mla_attention(const float* q, const u32* pos, const float* latent, const float* kpe, const float* k_b, const float* v_b, float* out,
                                            int n_head, int nope, int rr, int r, int vd, float scale) {
    DYNAMIC_SHARED(float, smem);
    int h = blockIdx.x, t = blockIdx.y, tid = threadIdx.x, bd = blockDim.x;
    int len = (int)pos[t] + 1;
    float* red = smem;
    float* qa = smem + bd;
    float* ctx = qa + r;
    float* score = ctx + r;
    const float* qh = q + ((long long)t * n_head + h) * (nope + rr);
    const float* kb = k_b + (long long)h * nope * r;
    for (int c = tid; c < r; c += bd) {
        float a = 0.0f;
        for (int i = 0; i < nope; ++i) a += qh[i] * kb[(long long)i * r + c];
        qa[c] = a;
    }
    __syncthreads();
    float local_max = TS_NEG_INF;
    for (int j = tid; j < len; j += bd) {
        const float* lj = latent + (long long)j * r;
        const float* pj = kpe + (long long)j * rr;
        float s = 0.0f, sp = 0.0f;
        for (int c = 0; c < r; ++c) s += qa[c] * lj[c];
        for (int c = 0; c < rr; ++c) sp += qh[nope + c] * pj[c];
        s = (s + sp) * scale;
        score[j] = s;
        local_max = fmaxf(local_max, s);
    }
    float mx = ts_block_max(local_max, red);
    float sum = ts_exp_sum(score, len, mx, red);
    for (int c = tid; c < r; c += bd) {
        float a = 0.0f;
        for (int j = 0; j < len; ++j) a += score[j] * latent[(long long)j * r + c];
        ctx[c] = a / sum;
    }
    __syncthreads();
    const float* vb = v_b + (long long)h * vd * r;
    for (int d = tid; d < vd; d += bd) {
        float o = 0.0f;
        for (int c = 0; c < r; ++c) o += vb[(long long)d * r + c] * ctx[c];
        out[((long long)t * n_head + h) * vd + d] = o;
    }
}
