/* The host side of the eBPF engine: loads forward.bpf.o with libbpf, puts a flat model's weights
 * into the `wts` map on their integer grids, and runs the forward pass op by op, each op one
 * BPF_PROG_TEST_RUN of its program. It speaks Touchstone's dump protocol (docs/DUMP_FORMAT.md):
 * TOUCHSTONE_MODEL (a flat file of f32 weights, `cargo xtask export --type f32`),
 * TOUCHSTONE_MODEL_SHA256 (the sha256 of the model under test), TOUCHSTONE_PROMPT_IDS,
 * TOUCHSTONE_N_GENERATE and TOUCHSTONE_OUT. With N_GENERATE > 0 it writes a token-only dump and
 * prints the generated ids, else every tap it computes and the logits of every position, as f32
 * values of its Q16 integers, with its arithmetic declared (Q16/Q24/Q20/Q30 fixed point).
 *
 * Why libbpf: it is what the kernel's own tree ships for loading BPF objects (map creation, the
 * relocations of map references, program loading with the verifier's log), packaged by Debian as
 * libbpf-dev; the loader stays a small C program, like the engine it stands for.
 *
 * Usage: loader FORWARD_BPF_OBJECT (run.sh builds both and calls it). It needs root (or
 * CAP_BPF + CAP_SYS_ADMIN) for bpf(). Exit 2 with a message for what it cannot run.
 */
#define _POSIX_C_SOURCE 200809L
#include <bpf/bpf.h>
#include <bpf/libbpf.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "forward.h"
#include "../flat_engine/touchstone_dump.h"
#include "../flat_engine/touchstone_flat.h"

static void die(const char *what, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ebpf_engine: %s: ", what);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(2);
}

static const void *file;
static const struct ts_flat_header *h;
static int32_t *wts; /* the `wts` map, mmapped */
static int64_t *act; /* the `act` map, mmapped */
static uint64_t wts_used, act_used;
/* Weights are laid out in chunks of 2^chunk_log2 words (one entry of the `wts` array each; a
 * tensor never spans two). */
static int chunk_log2 = WTS_CHUNK_MAX_LOG2;

/* The weights to place once the maps exist: each tensor's values on the grid of `frac`. */
struct placement {
    const char *name;
    const float *values;
    uint64_t n, at;
    int frac;
};
static struct placement placed[4096];
static int n_placed;

/* round(x 2^frac), ties away from zero. */
static int64_t to_q(double x, int frac) { return (int64_t)llround(ldexp(x, frac)); }

static const float *f32_tensor(const char *name, uint64_t n) {
    const struct ts_flat_tensor *t = ts_flat_find(file, name);
    if (!t) die(name, "missing tensor");
    if (t->dims[0] * t->dims[1] * t->dims[2] * t->dims[3] != n) die(name, "unexpected shape");
    if (t->type != TS_GGML_F32) die(name, "not f32: this engine reads f32 flat files (cargo xtask export --type f32) and holds every value on its own integer grid");
    return (const float *)ts_flat_data(file, t);
}

/* Lays out n values of `name` in `wts` (written by fill_wts once the map exists); returns their
 * offset. */
static uint64_t put_wts(const char *name, uint64_t n, int frac) {
    const float *v = f32_tensor(name, n);
    const uint64_t chunk = 1ull << chunk_log2;
    if (n > chunk) die(name, "a tensor of more than 2^%d words (the largest `wts` chunk)", chunk_log2);
    if ((wts_used & (chunk - 1)) + n > chunk) wts_used = (wts_used + chunk - 1) & ~(chunk - 1);
    if (n_placed == (int)(sizeof placed / sizeof *placed)) die(name, "too many tensors");
    placed[n_placed++] = (struct placement){name, v, n, wts_used, frac};
    wts_used += n;
    return wts_used - n;
}

/* Writes every laid-out tensor into `wts` on its grid. */
static void fill_wts(void) {
    for (int t = 0; t < n_placed; t++) {
        const struct placement *p = &placed[t];
        for (uint64_t i = 0; i < p->n; i++) {
            int64_t q = to_q(p->values[i], p->frac);
            if (q > INT32_MAX || q < -INT32_MAX) die(p->name, "value %g at %llu does not fit a 32-bit Q%d word", p->values[i], (unsigned long long)i, p->frac);
            wts[p->at + i] = (int32_t)q;
        }
    }
}

/* n words of `act`. */
static uint64_t take_act(uint64_t n, const char *what) {
    if (act_used + n > (1ull << ACT_MAX_LOG2)) die(what, "activations, cache and tables need more than the 2^%d words of the largest `act` map", ACT_MAX_LOG2);
    uint64_t at = act_used;
    act_used += n;
    return at;
}

/* The smallest power of two at least n (and at least 2^12). */
static uint64_t pow2_at_least(uint64_t n) {
    uint64_t p = 1ull << 12;
    while (p < n) p <<= 1;
    return p;
}

static const char *layer_name(int l, const char *tail) {
    static char name[64];
    snprintf(name, sizeof name, "blk.%d.%s", l, tail);
    return name;
}

/* ---- running the programs ---- */

enum { P_MATVEC, P_RMSNORM, P_ROPE, P_ATTEND, P_SWIGLU, P_ADD, P_EMBED, N_PROGS };
static const char *prog_names[N_PROGS] = {"matvec", "rmsnorm", "rope", "attend", "swiglu", "add", "embed"};
static int prog_fd[N_PROGS];
static unsigned long long runs, macs;

static void run(int p, void *args, size_t size) {
    LIBBPF_OPTS(bpf_test_run_opts, o, .ctx_in = args, .ctx_size_in = (unsigned)size);
    int err = bpf_prog_test_run_opts(prog_fd[p], &o);
    if (err) die(prog_names[p], "BPF_PROG_TEST_RUN failed: %s", strerror(errno));
    if (o.retval) die(prog_names[p], "the program returned %u (bad arguments)", o.retval);
    runs++;
}

static void matvec(uint64_t x, uint64_t w, uint64_t y, uint64_t rows, uint64_t cols) {
    struct matvec_args a = {x, w, y, rows, cols};
    run(P_MATVEC, &a, sizeof a);
    macs += rows * cols;
}

static void rmsnorm(uint64_t x, uint64_t w, uint64_t y, uint64_t n) {
    struct norm_args a = {x, w, y, n, (uint64_t)to_q(h->norm_eps, 32)};
    run(P_RMSNORM, &a, sizeof a);
}

static void elementwise(int p, uint64_t a, uint64_t b, uint64_t y, uint64_t n) {
    struct ew_args e = {a, b, y, n};
    run(p, &e, sizeof e);
}

/* ---- the dump ---- */

struct tap {
    char name[64];
    uint64_t width;
    float *rows; /* [n_prompt][width] */
};
static struct tap *taps;
static int n_taps, taps_cap, n_prompt;

/* Records `width` values of `act` at `at` as row `pos` of tap `name` (created on first use, in
 * execution order). */
static void tap(const char *name, int pos, uint64_t at, uint64_t width) {
    if (pos >= n_prompt) return;
    int i = 0;
    while (i < n_taps && strcmp(taps[i].name, name)) i++;
    if (i == n_taps) {
        if (n_taps == taps_cap) {
            taps_cap = taps_cap ? 2 * taps_cap : 64;
            taps = realloc(taps, (size_t)taps_cap * sizeof *taps);
            if (!taps) die("taps", "out of memory");
        }
        snprintf(taps[i].name, sizeof taps[i].name, "%s", name);
        taps[i].width = width;
        taps[i].rows = calloc((size_t)n_prompt * width, 4);
        if (!taps[i].rows) die(name, "out of memory");
        n_taps++;
    }
    for (uint64_t j = 0; j < width; j++) taps[i].rows[(size_t)pos * width + j] = (float)ldexp((double)act[at + j], -Q_ACT);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const char *model = getenv("TOUCHSTONE_MODEL"), *ids_env = getenv("TOUCHSTONE_PROMPT_IDS"), *out = getenv("TOUCHSTONE_OUT");
    const char *sha = getenv("TOUCHSTONE_MODEL_SHA256"), *gen_env = getenv("TOUCHSTONE_N_GENERATE");
    if (argc != 2) die("usage", "loader FORWARD_BPF_OBJECT");
    if (!model || !ids_env || !out || !sha) die("environment", "needs TOUCHSTONE_MODEL, TOUCHSTONE_PROMPT_IDS, TOUCHSTONE_OUT and TOUCHSTONE_MODEL_SHA256");
    int n_generate = gen_env ? atoi(gen_env) : 0;

    int fd = open(model, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) die(model, "cannot open: %s", strerror(errno));
    file = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (file == MAP_FAILED) die(model, "cannot map: %s", strerror(errno));
    const char *bad = ts_flat_check(file, (uint64_t)st.st_size, 1);
    if (bad) die(model, "%s", bad);
    h = ts_flat_header(file);
    if (h->n_expert) die(model, "MoE models are not implemented here");
    if (h->rope_scaling != TS_ROPE_NONE || (h->flags & TS_FLAT_FREQ_FACTORS)) die(model, "RoPE scaling is not implemented here");
    if (h->sliding_window) die(model, "sliding-window attention is not implemented here");
    if ((h->flags & TS_FLAT_POST_NORMS) || h->embd_scale != 0.0) die(model, "Gemma's post-norms and embedding scale are not implemented here");
    if (h->flags & (TS_FLAT_QKV_BIAS | TS_FLAT_OUT_BIAS)) die(model, "biases are not implemented here");
    if (h->activation != 0) die(model, "only SiLU-gated FFNs are implemented here");

    const uint64_t E = h->n_embd, L = h->n_layer, H = h->n_head, HK = h->n_head_kv, D = h->head_dim, F = h->n_ff, V = h->n_vocab, R = h->n_rot;
    if (!E || !L || !H || !HK || !D || !F || !V || H % HK || R > D || R % 2) die(model, "inconsistent dimensions");
    const int qk_norm = !!(h->flags & TS_FLAT_QK_NORM), tied = !!(h->flags & TS_FLAT_TIED_OUTPUT);

    int ids[4096], n_ids = 0;
    for (char *p = (char *)ids_env, *end; *p; p = *end ? end + 1 : end) {
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || (uint64_t)v >= V || n_ids == 4096) die("TOUCHSTONE_PROMPT_IDS", "not up to 4096 comma-separated ids inside the vocabulary");
        ids[n_ids++] = (int)v;
    }
    n_prompt = n_ids;
    uint64_t cap = (uint64_t)n_prompt + (n_generate > 0 ? (uint64_t)n_generate : 0);
    if (cap > 4096) die("TOUCHSTONE_N_GENERATE", "prompt and generation past 4096 positions");

    /* Weights on their grids: matrices Q24, norm scales Q20, the embedding table Q16 (looked up
     * as activations); a tied output matrix is also held as Q24 weights. */
    const uint64_t embd = put_wts("token_embd.weight", E * V, Q_ACT);
    const uint64_t out_norm = put_wts("output_norm.weight", E, Q_NORM);
    const uint64_t out_w = put_wts(tied ? "token_embd.weight" : "output.weight", E * V, Q_WGT);
    uint64_t (*lw)[11] = calloc(L, sizeof *lw);
    enum { W_ATTN_NORM, W_Q, W_K, W_V, W_O, W_FFN_NORM, W_GATE, W_UP, W_DOWN, W_QN, W_KN };
    for (uint64_t l = 0; l < L; l++) {
        lw[l][W_ATTN_NORM] = put_wts(layer_name((int)l, "attn_norm.weight"), E, Q_NORM);
        lw[l][W_Q] = put_wts(layer_name((int)l, "attn_q.weight"), E * H * D, Q_WGT);
        lw[l][W_K] = put_wts(layer_name((int)l, "attn_k.weight"), E * HK * D, Q_WGT);
        lw[l][W_V] = put_wts(layer_name((int)l, "attn_v.weight"), E * HK * D, Q_WGT);
        lw[l][W_O] = put_wts(layer_name((int)l, "attn_output.weight"), H * D * E, Q_WGT);
        lw[l][W_FFN_NORM] = put_wts(layer_name((int)l, "ffn_norm.weight"), E, Q_NORM);
        lw[l][W_GATE] = put_wts(layer_name((int)l, "ffn_gate.weight"), E * F, Q_WGT);
        lw[l][W_UP] = put_wts(layer_name((int)l, "ffn_up.weight"), E * F, Q_WGT);
        lw[l][W_DOWN] = put_wts(layer_name((int)l, "ffn_down.weight"), F * E, Q_WGT);
        if (qk_norm) {
            lw[l][W_QN] = put_wts(layer_name((int)l, "attn_q_norm.weight"), D, Q_NORM);
            lw[l][W_KN] = put_wts(layer_name((int)l, "attn_k_norm.weight"), D, Q_NORM);
        }
    }

    /* Activations, the cache of every layer, the RoPE tables (computed here in double, as the
     * host of an integer engine does) and the attention's scratch. */
    const uint64_t x = take_act(E, "x"), xn = take_act(E, "xn"), q = take_act(H * D, "q"), k = take_act(HK * D, "k"), v = take_act(HK * D, "v");
    const uint64_t att = take_act(H * D, "att"), tmp = take_act(E, "tmp"), g = take_act(F, "gate"), u = take_act(F, "up"), fa = take_act(F, "act");
    const uint64_t logits = take_act(V, "logits"), scores = take_act(cap, "scores");
    const uint64_t kc = take_act(L * cap * HK * D, "k cache"), vc = take_act(L * cap * HK * D, "v cache");
    const uint64_t tables = take_act(cap * R, "RoPE tables");
    /* Load the programs (the verifier checks each one now), with maps as small as the model
     * allows and their sizes in read-only data. */
    /* One chunk as small as the weights allow, else as many of the largest as they fill. */
    const uint64_t chunks = (wts_used + (1ull << chunk_log2) - 1) >> chunk_log2;
    if (chunks == 1)
        while (chunk_log2 > 12 && (1ull << (chunk_log2 - 1)) >= wts_used) chunk_log2--;
    const uint64_t chunk_words = 1ull << chunk_log2, wts_words = chunks * chunk_words, act_words = pow2_at_least(act_used);
    libbpf_set_strict_mode(LIBBPF_STRICT_ALL);
    struct bpf_object *obj = bpf_object__open_file(argv[1], NULL);
    if (!obj) die(argv[1], "cannot open the BPF object: %s", strerror(errno));
    struct bpf_map *wm = bpf_object__find_map_by_name(obj, "wts"), *am = bpf_object__find_map_by_name(obj, "act"), *rm = bpf_object__find_map_by_name(obj, ".rodata");
    if (!wm || !am || !rm) die(argv[1], "no `wts`, `act` or `.rodata` map");
    const uint64_t sizes[3] = {chunk_words - 1, act_words - 1, (uint64_t)chunk_log2};
    size_t rodata_size = 0;
    if (!bpf_map__initial_value(rm, &rodata_size) || rodata_size != sizeof sizes) die(argv[1], ".rodata is not the maps' sizes");
    if (bpf_map__set_initial_value(rm, sizes, sizeof sizes) || bpf_map__set_value_size(wm, (uint32_t)(chunk_words * 4)) || bpf_map__set_max_entries(wm, (uint32_t)chunks) || bpf_map__set_value_size(am, (uint32_t)(act_words * 8)))
        die(argv[1], "cannot size the maps: %s", strerror(errno));
    /* One small map first: a bpf() that is refused outright (no root, no CAP_BPF, a sandbox)
     * is said as such, apart from a program the verifier rejects. */
    int probe = bpf_map_create(BPF_MAP_TYPE_ARRAY, NULL, 4, 4, 1, NULL);
    if (probe < 0) die("bpf()", "refused here: %s (root, or CAP_BPF and CAP_SYS_ADMIN, is needed)", strerror(-probe));
    close(probe);
    if (bpf_object__load(obj)) die(argv[1], "the kernel did not load the programs (the verifier's log above): %s", strerror(errno));
    for (int p = 0; p < N_PROGS; p++) {
        struct bpf_program *prog = bpf_object__find_program_by_name(obj, prog_names[p]);
        if (!prog) die(argv[1], "no program `%s`", prog_names[p]);
        prog_fd[p] = bpf_program__fd(prog);
    }
    wts = mmap(NULL, (size_t)wts_words * 4, PROT_READ | PROT_WRITE, MAP_SHARED, bpf_map__fd(wm), 0);
    act = mmap(NULL, (size_t)act_words * 8, PROT_READ | PROT_WRITE, MAP_SHARED, bpf_map__fd(am), 0);
    if (wts == MAP_FAILED || act == MAP_FAILED) die(argv[1], "cannot map the BPF maps (%llu and %llu words): %s", (unsigned long long)wts_words, (unsigned long long)act_words, strerror(errno));
    fill_wts();

    for (uint64_t p = 0; p < cap; p++)
        for (uint64_t i = 0; i < R / 2; i++) {
            double theta = (double)p * pow(h->rope_theta, -2.0 * (double)i / (double)R);
            act[tables + p * R + 2 * i] = to_q(cos(theta), Q_TABLE);
            act[tables + p * R + 2 * i + 1] = to_q(sin(theta), Q_TABLE);
        }
    const int64_t scale_q30 = to_q(h->attn_scale, Q_TABLE);
    float *all_logits = calloc((size_t)n_prompt * V, 4);
    if (!lw || !all_logits) die("memory", "out of memory");

    /* TOUCHSTONE_EBPF_STATS=1: the kernel's run-time statistics of every program, printed at
     * the end with each program's size and the instructions its verification processed. */
    const int stats = getenv("TOUCHSTONE_EBPF_STATS") && !strcmp(getenv("TOUCHSTONE_EBPF_STATS"), "1");
    const int stats_fd = stats ? bpf_enable_stats(BPF_STATS_RUN_TIME) : -1;
    if (stats && stats_fd < 0) die("TOUCHSTONE_EBPF_STATS", "the kernel refused run-time statistics: %s", strerror(-stats_fd));
    double t0 = now();
    for (uint64_t pos = 0; pos < cap && pos < (uint64_t)n_ids; pos++) {
        const int tp = (int)pos;
        elementwise(P_EMBED, embd + (uint64_t)ids[pos] * E, 0, x, E);
        tap("inp_embd", tp, x, E);
        for (uint64_t l = 0; l < L; l++) {
            char name[64];
#define TAP(tail, at, width) (snprintf(name, sizeof name, "blk.%llu.%s", (unsigned long long)l, tail), tap(name, tp, at, width))
            rmsnorm(x, lw[l][W_ATTN_NORM], xn, E);
            TAP("attn_norm", xn, E);
            matvec(xn, lw[l][W_Q], q, H * D, E);
            TAP("attn_q", q, H * D);
            matvec(xn, lw[l][W_K], k, HK * D, E);
            TAP("attn_k", k, HK * D);
            matvec(xn, lw[l][W_V], v, HK * D, E);
            TAP("attn_v", v, HK * D);
            if (qk_norm) {
                for (uint64_t hh = 0; hh < H; hh++) rmsnorm(q + hh * D, lw[l][W_QN], q + hh * D, D);
                TAP("attn_q_norm", q, H * D);
                for (uint64_t hh = 0; hh < HK; hh++) rmsnorm(k + hh * D, lw[l][W_KN], k + hh * D, D);
                TAP("attn_k_norm", k, HK * D);
            }
            struct rope_args rq = {q, tables + pos * R, H, D, R, h->rope_style}, rk = {k, tables + pos * R, HK, D, R, h->rope_style};
            run(P_ROPE, &rq, sizeof rq);
            TAP("attn_q_rope", q, H * D);
            run(P_ROPE, &rk, sizeof rk);
            TAP("attn_k_rope", k, HK * D);
            const uint64_t kl = kc + l * cap * HK * D, vl = vc + l * cap * HK * D;
            memcpy(&act[kl + pos * HK * D], &act[k], HK * D * 8);
            memcpy(&act[vl + pos * HK * D], &act[v], HK * D * 8);
            struct attend_args at = {q, kl, vl, att, scores, pos, H, HK, D, scale_q30};
            run(P_ATTEND, &at, sizeof at);
            macs += 2 * H * D * (pos + 1);
            TAP("attn_kqv", att, H * D);
            matvec(att, lw[l][W_O], tmp, E, H * D);
            TAP("attn_out", tmp, E);
            elementwise(P_ADD, x, tmp, x, E);
            TAP("ffn_inp", x, E);
            rmsnorm(x, lw[l][W_FFN_NORM], xn, E);
            TAP("ffn_norm", xn, E);
            matvec(xn, lw[l][W_GATE], g, F, E);
            TAP("ffn_gate", g, F);
            matvec(xn, lw[l][W_UP], u, F, E);
            TAP("ffn_up", u, F);
            elementwise(P_SWIGLU, g, u, fa, F);
            TAP("ffn_act", fa, F);
            matvec(fa, lw[l][W_DOWN], tmp, E, F);
            TAP("ffn_out", tmp, E);
            elementwise(P_ADD, x, tmp, x, E);
            TAP("l_out", x, E);
#undef TAP
        }
        rmsnorm(x, out_norm, xn, E);
        tap("result_norm", tp, xn, E);
        matvec(xn, out_w, logits, V, E);
        if (tp < n_prompt)
            for (uint64_t i = 0; i < V; i++) all_logits[(size_t)pos * V + i] = (float)ldexp((double)act[logits + i], -Q_ACT);
        if (n_generate > 0 && pos == (uint64_t)n_ids - 1 && (uint64_t)n_ids < cap) {
            uint64_t best = 0; /* argmax over the integers, first of equals */
            for (uint64_t i = 1; i < V; i++)
                if (act[logits + i] > act[logits + best]) best = i;
            ids[n_ids++] = (int)best;
        }
    }
    double secs = now() - t0;
    unsigned long long positions = (unsigned long long)(n_ids < (int)cap ? n_ids : (int)cap);
    fprintf(stderr, "ebpf_engine: %llu positions in %.3f s (%.1f tok/s): %llu BPF_PROG_TEST_RUN calls, %llu multiply-adds per position\n",
            positions, secs, (double)positions / secs, runs / positions, macs / positions);

    if (stats) {
        fprintf(stderr, "%-8s %8s %9s %9s %12s\n", "program", "insns", "verified", "runs", "run ms");
        for (int p = 0; p < N_PROGS; p++) {
            struct bpf_prog_info info = {0};
            uint32_t len = sizeof info;
            if (bpf_obj_get_info_by_fd(prog_fd[p], &info, &len)) die(prog_names[p], "no program information: %s", strerror(errno));
            fprintf(stderr, "%-8s %8u %9u %9llu %12.3f\n", prog_names[p], info.xlated_prog_len / 8, info.verified_insns, (unsigned long long)info.run_cnt, (double)info.run_time_ns * 1e-6);
        }
        close(stats_fd);
    }

    char arch[17] = {0}, arithmetic[512];
    memcpy(arch, h->arch, 16);
    snprintf(arithmetic, sizeof arithmetic,
             "{\"storage\":\"i32\",\"accumulate\":\"i32\",\"activation_q8_block\":null,\"transcendental_ulps\":0.0,"
             "\"fixed\":{\"act_frac\":%d,\"weight_frac\":%d,\"norm_frac\":%d,\"table_frac\":%d,\"exp_abs\":%.17g,\"int4_group\":null}}",
             Q_ACT, Q_WGT, Q_NORM, Q_TABLE, 2.0 / 65536.0);
    ts_dump d;
    ts_dump_begin(&d, out, "ebpf", "flat", sha, arch, ids, n_prompt, arithmetic);
    ts_dump_set_precision(&d, "q16");
    if (n_generate > 0) {
        ts_dump_generated(&d, ids + n_prompt, n_ids - n_prompt);
    } else {
        for (int i = 0; i < n_taps; i++) ts_dump_tap(&d, taps[i].name, taps[i].rows, n_prompt, (int)taps[i].width);
        ts_dump_logits(&d, all_logits, n_prompt, (int)V);
    }
    if (ts_dump_finish(&d)) die(out, "%s", d.error);
    if (n_generate > 0) {
        for (int i = n_prompt; i < n_ids; i++) printf("%s%d", i > n_prompt ? "," : "", ids[i]);
        printf("\n");
    }
    return 0;
}
