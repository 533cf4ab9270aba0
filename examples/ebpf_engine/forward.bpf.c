/* The forward pass of a dense Llama-family model inside the kernel's eBPF virtual machine, in
 * integers only: Q16 activations, Q24 weights, Q20 norm scales, Q30 RoPE tables, an integer exp.
 *
 * Each op is one BPF_PROG_TYPE_SYSCALL program, run by the host loader (loader.c) through
 * BPF_PROG_TEST_RUN with its arguments (word offsets and sizes) as the context. Weights live in
 * the array map `wts` (s32 words), activations, the KV cache, RoPE tables and scratch in `act`
 * (s64 words); both are one value each, mmapped by the loader. Loops are bpf_loop() callbacks, so
 * the verifier checks each body once whatever the trip count; every map index is masked to the
 * map's size, so no access can leave it (the loader lays tensors out so that none needs to wrap).
 *
 * The verifier's limits and how the programs meet them: no unbounded loop (bpf_loop, and
 * fixed-count loops the compiler unrolls); 512 bytes of stack (each callback frame holds a few
 * words); no 128-bit arithmetic and no signed division in the BPF instruction set (mul_shr forms
 * the exact 128-bit product from 32-bit halves; divisions are unsigned, with the sign apart); map
 * values sized by the loader to the model (powers of two in words, up to forward.h's largest).
 *
 * Build: clang -O2 -target bpf -c forward.bpf.c (run.sh). -DSEEDED_BUG builds the engine with one
 * wrong shift in its Q16 multiply (the gated product of the FFN), for the tests that show the gates
 * catch it.
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "forward.h"

typedef __s64 s64;
typedef __u64 u64;
typedef __s32 s32;

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(map_flags, BPF_F_MMAPABLE);
    __uint(key_size, 4);
    __uint(value_size, 4); /* set by the loader: chunks of a power of two words */
    __uint(max_entries, 1); /* set by the loader: as many chunks as the weights fill */
} wts SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(map_flags, BPF_F_MMAPABLE);
    __uint(key_size, 4);
    __uint(value_size, 8); /* set by the loader, as `wts` */
    __uint(max_entries, 1);
} act SEC(".maps");

/* The maps' sizes in words less one, set by the loader before the programs load: read-only data,
 * so the verifier knows them as constants and every masked index as inside its map. */
const volatile u64 sizes[3] = {0, 0, 0}; /* a wts chunk's words - 1, act's words - 1, log2 of a wts chunk */

#define W(i) ((i) & sizes[0])
#define A(i) ((i) & sizes[1])

/* The chunk of `wts` that holds the tensor at word `at` (no tensor spans two chunks). */
static __always_inline s32 *wts_chunk(u64 at) {
    __u32 key = (__u32)(at >> sizes[2]);
    return bpf_map_lookup_elem(&wts, &key);
}

/* v / 2^s rounded to nearest, ties away from zero. */
static __always_inline s64 shr_round(s64 v, u64 s) {
    if (s == 0) return v;
    u64 half = 1ull << (s - 1);
    return v >= 0 ? (s64)(((u64)v + half) >> s) : -(s64)(((u64)(-v) + half) >> s);
}

/* a * b / 2^s rounded as shr_round, from the exact 128-bit product (0 < s < 64; the result must
 * fit 63 bits). */
static __always_inline s64 mul_shr(s64 a, s64 b, u64 s) {
    int neg = (a < 0) != (b < 0);
    u64 ua = a < 0 ? -(u64)a : (u64)a, ub = b < 0 ? -(u64)b : (u64)b;
    u64 al = ua & 0xffffffffull, ah = ua >> 32, bl = ub & 0xffffffffull, bh = ub >> 32;
    u64 ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    u64 mid = (ll >> 32) + (lh & 0xffffffffull) + (hl & 0xffffffffull);
    u64 lo = (ll & 0xffffffffull) | (mid << 32);
    u64 hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
    u64 half = 1ull << (s - 1);
    u64 lo2 = lo + half;
    hi += lo2 < lo;
    u64 r = (lo2 >> s) | (hi << (64 - s));
    return neg ? -(s64)r : (s64)r;
}

/* exp(z) for z <= 0, z and the result Q16: 2^(z log2 e) = 2^-k 2^f, 2^f = e^(f ln 2) for f in
 * [0, 1) from ten Taylor terms in Q30, one rounding to Q16. */
static __always_inline s64 exp_q16(s64 z) {
    if (z > 0) z = 0;
    if (z < -(24ll << Q_ACT)) return 0; /* e^-24 < 2^-34: 0 on the Q16 grid */
    s64 t = (z * 1549082005ll) >> Q_ACT; /* z log2(e), Q30, <= 0 */
    u64 k = (u64)(-t) >> 30;
    if ((u64)(-t) & ((1ull << 30) - 1)) k++;
    u64 f = (u64)(t + (s64)(k << 30)); /* [0, 2^30) */
    u64 y = (f * 744261118ull) >> 30;  /* f ln 2, Q30 */
    u64 acc = 1ull << 30;
    for (u64 n = 10; n >= 1; n--) acc = (1ull << 30) + ((acc * y) >> 30) / n;
    return shr_round((s64)acc, 30 - Q_ACT + k);
}

/* sigmoid(x), Q16, by the symmetry for x < 0. */
static __always_inline s64 sigmoid_q16(s64 x) {
    u64 one = 1ull << Q_ACT;
    u64 e = (u64)exp_q16(x < 0 ? x : -x);
    u64 pos = (one << Q_ACT) / (one + e);
    return x >= 0 ? (s64)pos : (s64)(one - pos);
}

/* floor(sqrt(n)) for n < 2^62, one bit per bpf_loop step: the verifier checks the step once,
 * where 31 unrolled branches would give it 2^31 paths to walk. */
struct sqrt_ctx {
    u64 n, r;
};

static long sqrt_step(u64 i, struct sqrt_ctx *c) {
    u64 cand = c->r | (1ull << ((30 - i) & 63));
    if (cand * cand <= c->n) c->r = cand;
    return 0;
}

static __always_inline u64 isqrt(u64 n) {
    struct sqrt_ctx c = {n, 0};
    bpf_loop(31, sqrt_step, &c, 0);
    return c.r;
}

/* ---- matvec: y[r] = round(sum_k x[k] w[r cols + k] / 2^24), rows r in 0..rows ---- */

struct dot_ctx {
    s64 *a;
    s32 *w;
    u64 x, wrow;
    s64 acc;
};

static long dot_step(u64 k, struct dot_ctx *c) {
    c->acc += c->a[A(c->x + k)] * (s64)c->w[W(c->wrow + k)];
    return 0;
}

struct matvec_ctx {
    s64 *a;
    s32 *w;
    struct matvec_args m;
};

static long matvec_row(u64 r, struct matvec_ctx *c) {
    struct dot_ctx d = {c->a, c->w, c->m.x, c->m.w + r * c->m.cols, 0};
    bpf_loop(c->m.cols, dot_step, &d, 0);
    c->a[A(c->m.y + r)] = shr_round(d.acc, Q_WGT);
    return 0;
}

SEC("syscall")
int matvec(struct matvec_args *args) {
    __u32 key = 0;
    s64 *a = bpf_map_lookup_elem(&act, &key);
    s32 *w = wts_chunk(args->w);
    if (!a || !w) return 1;
    struct matvec_ctx c = {a, w, *args};
    c.m.w = W(c.m.w);
    bpf_loop(c.m.rows, matvec_row, &c, 0);
    return 0;
}

/* ---- rmsnorm: y = x / sqrt(mean(x^2) + eps) * w, per row of n ---- */

struct sumsq_ctx {
    s64 *a;
    u64 x;
    u64 ss;
};

static long sumsq_step(u64 i, struct sumsq_ctx *c) {
    s64 v = c->a[A(c->x + i)];
    c->ss += (u64)(v * v);
    return 0;
}

struct scale_ctx {
    s64 *a;
    s32 *w;
    struct norm_args n;
    u64 inv; /* 1/rms, Q32 */
};

static long scale_step(u64 i, struct scale_ctx *c) {
    s64 xw = c->a[A(c->n.x + i)] * (s64)c->w[W(c->n.w + i)]; /* Q36 */
    c->a[A(c->n.y + i)] = mul_shr(xw, (s64)c->inv, 32 + Q_NORM);
    return 0;
}

SEC("syscall")
int rmsnorm(struct norm_args *args) {
    __u32 key = 0;
    s64 *a = bpf_map_lookup_elem(&act, &key);
    s32 *w = wts_chunk(args->w);
    if (!a || !w || args->n == 0) return 1;
    struct sumsq_ctx s = {a, args->x, 0};
    bpf_loop(args->n, sumsq_step, &s, 0);
    u64 mean = s.ss / args->n + args->eps_q32; /* Q32 */
    if (mean == 0) mean = 1;
    if (mean >= (1ull << 62)) mean = (1ull << 62) - 1; /* past any activation the Q16 grid holds */
    /* sqrt on 62 bits: shift left by an even amount (at most 30, so that 1/root stays in 64
     * bits), root in Q(16 + shift/2); the shift grows while the value is under 2^60. */
    u64 sh = 0;
    while (sh < 30 && (mean << sh) < (1ull << 60)) sh += 2;
    u64 root = isqrt(mean << sh);
    if (root == 0) root = 1;
    struct scale_ctx c = {a, w, *args, (1ull << (48 + sh / 2)) / root};
    c.n.w = W(c.n.w);
    bpf_loop(args->n, scale_step, &c, 0);
    return 0;
}

/* ---- rope: rotate each head's pairs by the position's Q30 cos/sin table ---- */

struct rope_ctx {
    s64 *a;
    struct rope_args r;
};

static long rope_step(u64 i, struct rope_ctx *c) {
    u64 half = c->r.n_rot / 2;
    u64 h = i / half, p = i % half;
    u64 base = c->r.x + h * c->r.hd;
    u64 i0 = c->r.neox ? base + p : base + 2 * p, i1 = c->r.neox ? base + p + half : base + 2 * p + 1;
    s64 cs = c->a[A(c->r.table + 2 * p)], sn = c->a[A(c->r.table + 2 * p + 1)];
    s64 x0 = c->a[A(i0)], x1 = c->a[A(i1)];
    c->a[A(i0)] = shr_round(x0 * cs - x1 * sn, Q_TABLE);
    c->a[A(i1)] = shr_round(x0 * sn + x1 * cs, Q_TABLE);
    return 0;
}

SEC("syscall")
int rope(struct rope_args *args) {
    __u32 key = 0;
    s64 *a = bpf_map_lookup_elem(&act, &key);
    if (!a || args->n_rot < 2) return 1;
    struct rope_ctx c = {a, *args};
    bpf_loop(args->n_head * (args->n_rot / 2), rope_step, &c, 0);
    return 0;
}

/* ---- attention of one position over the cache: scores, integer softmax, weighted values ---- */

struct qk_ctx {
    s64 *a;
    u64 q, k;
    s64 acc;
};

static long qk_step(u64 d, struct qk_ctx *c) {
    c->acc += c->a[A(c->q + d)] * c->a[A(c->k + d)];
    return 0;
}

struct head_ctx {
    s64 *a;
    struct attend_args t;
    u64 h;
    s64 max;
    u64 sum;
};

static long score_step(u64 j, struct head_ctx *c) {
    u64 kvh = c->h / (c->t.n_head / c->t.n_head_kv), row = c->t.n_head_kv * c->t.hd;
    struct qk_ctx d = {c->a, c->t.q + c->h * c->t.hd, c->t.kc + j * row + kvh * c->t.hd, 0};
    bpf_loop(c->t.hd, qk_step, &d, 0);
    s64 s = mul_shr(d.acc, c->t.scale_q30, 30 + Q_ACT); /* Q16 */
    c->a[A(c->t.scores + j)] = s;
    if (j == 0 || s > c->max) c->max = s;
    return 0;
}

static long exp_step(u64 j, struct head_ctx *c) {
    s64 e = exp_q16(c->a[A(c->t.scores + j)] - c->max);
    c->a[A(c->t.scores + j)] = e;
    c->sum += (u64)e;
    return 0;
}

static long prob_step(u64 j, struct head_ctx *c) {
    u64 e = (u64)c->a[A(c->t.scores + j)];
    c->a[A(c->t.scores + j)] = (s64)(((e << Q_ACT) + c->sum / 2) / c->sum);
    return 0;
}

struct pv_ctx {
    struct head_ctx *c;
    u64 d;
    s64 acc;
};

static long pv_step(u64 j, struct pv_ctx *p) {
    struct head_ctx *c = p->c;
    u64 kvh = c->h / (c->t.n_head / c->t.n_head_kv), row = c->t.n_head_kv * c->t.hd;
    p->acc += c->a[A(c->t.scores + j)] * c->a[A(c->t.vc + j * row + kvh * c->t.hd + p->d)];
    return 0;
}

static long out_step(u64 d, struct head_ctx *c) {
    struct pv_ctx p = {c, d, 0};
    bpf_loop(c->t.pos + 1, pv_step, &p, 0);
    c->a[A(c->t.out + c->h * c->t.hd + d)] = shr_round(p.acc, Q_ACT);
    return 0;
}

static long head_step(u64 h, struct head_ctx *c) {
    c->h = h;
    c->max = 0;
    c->sum = 0;
    bpf_loop(c->t.pos + 1, score_step, c, 0);
    bpf_loop(c->t.pos + 1, exp_step, c, 0);
    if (c->sum == 0) c->sum = 1;
    bpf_loop(c->t.pos + 1, prob_step, c, 0);
    bpf_loop(c->t.hd, out_step, c, 0);
    return 0;
}

SEC("syscall")
int attend(struct attend_args *args) {
    __u32 key = 0;
    s64 *a = bpf_map_lookup_elem(&act, &key);
    if (!a || args->n_head_kv == 0 || args->n_head % args->n_head_kv) return 1;
    struct head_ctx c = {a, *args, 0, 0, 0};
    bpf_loop(args->n_head, head_step, &c, 0);
    return 0;
}

/* ---- swiglu: y = silu(gate) * up; add: y = a + b; embed: y = the token's Q16 table row ---- */

struct ew_ctx {
    s64 *a;
    s32 *w;
    struct ew_args e;
};

static long swiglu_step(u64 i, struct ew_ctx *c) {
    s64 g = c->a[A(c->e.a + i)], u = c->a[A(c->e.b + i)];
    s64 silu = shr_round(g * sigmoid_q16(g), Q_ACT);
#ifdef SEEDED_BUG
    c->a[A(c->e.y + i)] = mul_shr(silu, u, Q_ACT - 1);
#else
    c->a[A(c->e.y + i)] = mul_shr(silu, u, Q_ACT);
#endif
    return 0;
}

static long add_step(u64 i, struct ew_ctx *c) {
    c->a[A(c->e.y + i)] = c->a[A(c->e.a + i)] + c->a[A(c->e.b + i)];
    return 0;
}

static long embed_step(u64 i, struct ew_ctx *c) {
    c->a[A(c->e.y + i)] = c->w[W(c->e.a + i)];
    return 0;
}

static __always_inline int elementwise(struct ew_args *args, void *step, int reads_wts) {
    __u32 key = 0;
    s64 *a = bpf_map_lookup_elem(&act, &key);
    s32 *w = wts_chunk(reads_wts ? args->a : 0);
    if (!a || !w) return 1;
    struct ew_ctx c = {a, w, *args};
    if (reads_wts) c.e.a = W(c.e.a);
    bpf_loop(args->n, step, &c, 0);
    return 0;
}

SEC("syscall")
int swiglu(struct ew_args *args) { return elementwise(args, swiglu_step, 0); }

SEC("syscall")
int add(struct ew_args *args) { return elementwise(args, add_step, 0); }

SEC("syscall")
int embed(struct ew_args *args) { return elementwise(args, embed_step, 1); }

char LICENSE[] SEC("license") = "GPL";
