/* A small inference engine in C that reads Touchstone's flat model format and speaks the dump
 * protocol (docs/DUMP_FORMAT.md, docs/FLAT_FORMAT.md). It stands for an engine without a GGUF
 * parser: it maps the file, checks it with touchstone_flat.h, and runs a dense Llama-family model
 * (Llama, Qwen2, Qwen3: GQA, QK-norm, biases, tied output, either RoPE layout) with f32, Q8_0 or
 * Q4_0 matrices (a quantized row is decoded to f32 as ggml decodes it, which is exact) and f32
 * activations, accumulating dot products in double.
 *
 *   cc -O2 -std=c11 -o flat_engine examples/flat_engine/engine.c -lm
 *   cargo xtask export --model smollm2 --type q4_0 --out smollm2.flat
 *   cargo xtask fixed-token --device "exec:sh examples/flat_engine/run.sh" --model smollm2.flat
 *
 * run.sh builds it once. Touchstone gives TOUCHSTONE_MODEL, TOUCHSTONE_PROMPT_IDS,
 * TOUCHSTONE_N_GENERATE, TOUCHSTONE_OUT and TOUCHSTONE_MODEL_SHA256; touchstone_dump.h writes the
 * dump. With
 * N_GENERATE > 0 it writes a token-only dump (generated_ids) and prints the ids on stdout (so it
 * also runs as `ids:sh examples/flat_engine/run.sh`, as a serial-console engine would), else the output of every layer
 * (blk.N.l_out), the final norm and the logits of every position. It refuses what it does not
 * implement (other weight types, MoE, RoPE scaling, sliding windows, Gemma's norms) with a message and exit 2.
 */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "touchstone_dump.h"
#include "touchstone_flat.h"

static void die(const char *what, const char *why) {
    fprintf(stderr, "flat_engine: %s: %s\n", what, why);
    exit(2);
}

static const void *file;
static const struct ts_flat_header *h;

/* A matrix as stored: f32, or ggml's Q8_0 / Q4_0 blocks of 32 values. */
struct mat {
    uint32_t type;
    const uint8_t *data;
};

static const struct ts_flat_tensor *tensor(const char *name, uint64_t n) {
    const struct ts_flat_tensor *t = ts_flat_find(file, name);
    if (!t) die(name, "missing tensor");
    if (t->dims[0] * t->dims[1] * t->dims[2] * t->dims[3] != n) die(name, "unexpected shape");
    return t;
}

/* An f32 vector (norm weights, biases) of exactly `n` values. */
static const float *vec(const char *name, uint64_t n) {
    const struct ts_flat_tensor *t = tensor(name, n);
    if (t->type != TS_GGML_F32) die(name, "not f32");
    return (const float *)ts_flat_data(file, t);
}

static struct mat matrix(const char *name, uint64_t n) {
    const struct ts_flat_tensor *t = tensor(name, n);
    if (t->type != TS_GGML_F32 && t->type != TS_GGML_Q8_0 && t->type != TS_GGML_Q4_0)
        die(name, "not f32, q8_0 or q4_0: the types this engine reads (cargo xtask export --type f32|q8_0|q4_0)");
    return (struct mat){t->type, (const uint8_t *)ts_flat_data(file, t)};
}

static const char *layer_name(int l, const char *tail) {
    static char name[64];
    snprintf(name, sizeof name, "blk.%d.%s", l, tail);
    return name;
}

static const float *layer_vec(int l, const char *tail, uint64_t n, int present) { return present ? vec(layer_name(l, tail), n) : NULL; }

static struct mat layer_matrix(int l, const char *tail, uint64_t n) { return matrix(layer_name(l, tail), n); }

static float f16_to_f32(uint16_t h) {
    int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v = exp == 0 ? ldexpf((float)man, -24) : exp == 31 ? (man ? NAN : INFINITY) : ldexpf((float)(man | 0x400), exp - 25);
    return (h >> 15) ? -v : v;
}

/* Row `r` of a matrix with `cols` columns, decoded to f32 into `out`. */
static void row(struct mat w, int r, int cols, float *out) {
    if (w.type == TS_GGML_F32) {
        memcpy(out, w.data + (size_t)r * cols * 4, (size_t)cols * 4);
        return;
    }
    size_t block = w.type == TS_GGML_Q8_0 ? 34 : 18;
    const uint8_t *b = w.data + (size_t)r * (cols / 32) * block;
    for (int k = 0; k < cols / 32; k++, b += block, out += 32) {
        float d = f16_to_f32((uint16_t)(b[0] | b[1] << 8));
        for (int j = 0; j < 32; j++) {
            int q = w.type == TS_GGML_Q8_0 ? (int8_t)b[2 + j] : j < 16 ? (b[2 + j] & 15) - 8 : (b[2 + j - 16] >> 4) - 8;
            out[j] = (float)q * d;
        }
    }
}

static float *row_buf;

/* y[rows] = W[rows][cols] x (+ b) */
static void matvec(float *y, struct mat w, const float *x, int rows, int cols, const float *b) {
    for (int r = 0; r < rows; r++) {
        row(w, r, cols, row_buf);
        double s = 0;
        for (int c = 0; c < cols; c++) s += (double)row_buf[c] * x[c];
        y[r] = (float)(s + (b ? b[r] : 0));
    }
}

static void rmsnorm(float *y, const float *x, const float *w, int n) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float inv = (float)(1.0 / sqrt(ss / n + h->norm_eps));
    for (int i = 0; i < n; i++) y[i] = x[i] * inv * w[i];
}

static void rope(float *v, int n_heads, int pos) {
    int hd = (int)h->head_dim, half = (int)h->n_rot / 2;
    for (int hh = 0; hh < n_heads; hh++) {
        float *x = v + hh * hd;
        for (int i = 0; i < half; i++) {
            double theta = pos * pow(h->rope_theta, -2.0 * i / h->n_rot);
            double c = cos(theta), s = sin(theta);
            int a = h->rope_style ? i : 2 * i, b = h->rope_style ? i + half : 2 * i + 1;
            double x0 = x[a], x1 = x[b];
            x[a] = (float)(x0 * c - x1 * s);
            x[b] = (float)(x0 * s + x1 * c);
        }
    }
}

int main(void) {
    const char *model = getenv("TOUCHSTONE_MODEL"), *ids_env = getenv("TOUCHSTONE_PROMPT_IDS"), *out = getenv("TOUCHSTONE_OUT");
    const char *sha = getenv("TOUCHSTONE_MODEL_SHA256"), *gen_env = getenv("TOUCHSTONE_N_GENERATE");
    if (!model || !ids_env || !out || !sha) die("environment", "needs TOUCHSTONE_MODEL, TOUCHSTONE_PROMPT_IDS, TOUCHSTONE_OUT and TOUCHSTONE_MODEL_SHA256");
    int n_generate = gen_env ? atoi(gen_env) : 0;

    int fd = open(model, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st)) die(model, "cannot open");
    file = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (file == MAP_FAILED) die(model, "cannot map");
    const char *bad = ts_flat_check(file, (uint64_t)st.st_size, 1);
    if (bad) die(model, bad);
    h = ts_flat_header(file);
    if (h->n_expert) die(model, "MoE models are not implemented here");
    if (h->rope_scaling != TS_ROPE_NONE || (h->flags & TS_FLAT_FREQ_FACTORS)) die(model, "RoPE scaling is not implemented here");
    if (h->sliding_window) die(model, "sliding-window attention is not implemented here");
    if ((h->flags & TS_FLAT_POST_NORMS) || h->embd_scale != 0.0) die(model, "Gemma's post-norms and embedding scale are not implemented here");
    if (h->activation > 1) die(model, "unknown activation");

    int E = (int)h->n_embd, L = (int)h->n_layer, H = (int)h->n_head, HK = (int)h->n_head_kv, D = (int)h->head_dim, F = (int)h->n_ff, V = (int)h->n_vocab;
    int qk_norm = !!(h->flags & TS_FLAT_QK_NORM), bias = !!(h->flags & TS_FLAT_QKV_BIAS), obias = !!(h->flags & TS_FLAT_OUT_BIAS);
    struct mat embd = matrix("token_embd.weight", (uint64_t)E * V);
    const float *out_norm = vec("output_norm.weight", E);
    struct mat out_w = (h->flags & TS_FLAT_TIED_OUTPUT) ? embd : matrix("output.weight", (uint64_t)E * V);
    int widest = E > F ? E : F;
    row_buf = calloc((size_t)(widest > H * D ? widest : H * D), 4);

    /* The prompt, then room for the generated ids. */
    int n_prompt = 1;
    for (const char *p = ids_env; *p; p++) n_prompt += *p == ',';
    int cap = n_prompt + (n_generate > 0 ? n_generate : 0);
    int *ids = calloc((size_t)cap, sizeof *ids), n_ids = 0;
    for (char *p = (char *)ids_env, *end; *p; p = *end ? end + 1 : end) {
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v >= V) die("TOUCHSTONE_PROMPT_IDS", "not comma-separated ids inside the vocabulary");
        ids[n_ids++] = (int)v;
    }
    n_prompt = n_ids;

    float *kcache = calloc((size_t)L * cap * HK * D, 4), *vcache = calloc((size_t)L * cap * HK * D, 4);
    float *x = calloc(E, 4), *xn = calloc(E, 4), *q = calloc((size_t)H * D, 4), *k = calloc((size_t)HK * D, 4), *v = calloc((size_t)HK * D, 4);
    float *att = calloc((size_t)H * D, 4), *tmp = calloc(E, 4), *g = calloc(F, 4), *u = calloc(F, 4), *sc = calloc((size_t)cap, 4);
    float *l_out = calloc((size_t)L * n_prompt * E, 4), *result_norm = calloc((size_t)n_prompt * E, 4), *logits = calloc((size_t)n_prompt * V, 4);
    float *last = calloc(V, 4);

    for (int pos = 0; pos < cap && pos < n_ids; pos++) {
        row(embd, ids[pos], E, x);
        for (int l = 0; l < L; l++) {
            rmsnorm(xn, x, layer_vec(l, "attn_norm.weight", E, 1), E);
            matvec(q, layer_matrix(l, "attn_q.weight", (uint64_t)E * H * D), xn, H * D, E, layer_vec(l, "attn_q.bias", (uint64_t)H * D, bias));
            matvec(k, layer_matrix(l, "attn_k.weight", (uint64_t)E * HK * D), xn, HK * D, E, layer_vec(l, "attn_k.bias", (uint64_t)HK * D, bias));
            matvec(v, layer_matrix(l, "attn_v.weight", (uint64_t)E * HK * D), xn, HK * D, E, layer_vec(l, "attn_v.bias", (uint64_t)HK * D, bias));
            if (qk_norm) {
                const float *qn = layer_vec(l, "attn_q_norm.weight", D, 1), *kn = layer_vec(l, "attn_k_norm.weight", D, 1);
                for (int hh = 0; hh < H; hh++) rmsnorm(q + hh * D, q + hh * D, qn, D);
                for (int hh = 0; hh < HK; hh++) rmsnorm(k + hh * D, k + hh * D, kn, D);
            }
            rope(q, H, pos);
            rope(k, HK, pos);
            float *kc = kcache + ((size_t)l * cap) * HK * D, *vc = vcache + ((size_t)l * cap) * HK * D;
            memcpy(kc + (size_t)pos * HK * D, k, (size_t)HK * D * 4);
            memcpy(vc + (size_t)pos * HK * D, v, (size_t)HK * D * 4);
            for (int hh = 0; hh < H; hh++) {
                int kh = hh / (H / HK);
                double max = -INFINITY, sum = 0;
                for (int t = 0; t <= pos; t++) {
                    double s = 0;
                    for (int d = 0; d < D; d++) s += (double)q[hh * D + d] * kc[((size_t)t * HK + kh) * D + d];
                    sc[t] = (float)(s * h->attn_scale);
                    if (sc[t] > max) max = sc[t];
                }
                for (int t = 0; t <= pos; t++) sum += exp(sc[t] - max);
                for (int d = 0; d < D; d++) {
                    double acc = 0;
                    for (int t = 0; t <= pos; t++) acc += exp(sc[t] - max) / sum * vc[((size_t)t * HK + kh) * D + d];
                    att[hh * D + d] = (float)acc;
                }
            }
            matvec(tmp, layer_matrix(l, "attn_output.weight", (uint64_t)H * D * E), att, E, H * D, layer_vec(l, "attn_output.bias", E, obias));
            for (int i = 0; i < E; i++) x[i] += tmp[i];
            rmsnorm(xn, x, layer_vec(l, "ffn_norm.weight", E, 1), E);
            matvec(g, layer_matrix(l, "ffn_gate.weight", (uint64_t)E * F), xn, F, E, NULL);
            matvec(u, layer_matrix(l, "ffn_up.weight", (uint64_t)E * F), xn, F, E, NULL);
            for (int i = 0; i < F; i++) {
                double a = g[i];
                double act = h->activation ? 0.5 * a * (1 + tanh(0.7978845608028654 * (a + 0.044715 * a * a * a))) : a / (1 + exp(-a));
                g[i] = (float)(act * u[i]);
            }
            matvec(tmp, layer_matrix(l, "ffn_down.weight", (uint64_t)F * E), g, E, F, NULL);
            for (int i = 0; i < E; i++) x[i] += tmp[i];
            if (pos < n_prompt) memcpy(l_out + ((size_t)l * n_prompt + pos) * E, x, (size_t)E * 4);
        }
        rmsnorm(xn, x, out_norm, E);
        matvec(last, out_w, xn, V, E, NULL);
        if (pos < n_prompt) {
            memcpy(result_norm + (size_t)pos * E, xn, (size_t)E * 4);
            memcpy(logits + (size_t)pos * V, last, (size_t)V * 4);
        }
        if (n_generate > 0 && pos == n_ids - 1 && n_ids < cap) {
            int best = 0;
            for (int i = 1; i < V; i++)
                if (last[i] > last[best]) best = i;
            ids[n_ids++] = best;
        }
    }

    char arch[17] = {0};
    memcpy(arch, h->arch, 16);
    ts_dump d;
    ts_dump_begin(&d, out, "example-c-flat", "flat", sha, arch, ids, n_prompt,
                  "{\"storage\":\"f32\",\"accumulate\":\"f32\",\"activation_q8_block\":null,\"transcendental_ulps\":4.0,\"fixed\":null}");
    if (n_generate > 0) {
        ts_dump_generated(&d, ids + n_prompt, n_ids - n_prompt);
    } else {
        for (int l = 0; l < L; l++) {
            char name[64];
            snprintf(name, sizeof name, "blk.%d.l_out", l);
            ts_dump_tap(&d, name, l_out + (size_t)l * n_prompt * E, n_prompt, E);
        }
        ts_dump_tap(&d, "result_norm", result_norm, n_prompt, E);
        ts_dump_logits(&d, logits, n_prompt, V);
    }
    if (ts_dump_finish(&d)) die(out, d.error);
    /* The generated ids on stdout too, one line, as an engine whose only output is a serial
     * console prints them (`ids:` device). */
    if (n_generate > 0) {
        for (int i = n_prompt; i < n_ids; i++) printf("%s%d", i > n_prompt ? "," : "", ids[i]);
        printf("\n");
    }
    return 0;
}
