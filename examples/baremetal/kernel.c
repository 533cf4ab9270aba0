/* A bare-metal x86 kernel that runs a language model: booted by a multiboot loader (GRUB, or
 * `qemu-system-x86_64 -kernel`), it takes a Touchstone flat model file (`cargo xtask export --type
 * f32`) as its first boot module, runs greedy generation and prints the ids on the first serial
 * port. No operating system, no libc: 32-bit protected mode as multiboot leaves it, the x87 FPU
 * for arithmetic (f32 values, sums in the FPU's 64-bit-mantissa registers, its own sqrt, sin,
 * cos, log2 and 2^x), a bump allocator over the memory above the module.
 *
 * The command line (multiboot's, `qemu -append`): `ids=1,2,3` (the prompt), `gen=N` (greedy
 * tokens to generate after it) and `logits=1`, which streams every prompt position's logits over
 * the second serial port as frames (serial_to_dump.py turns them into a dump):
 *   "TSLG" | u32 position | u32 n_vocab | n_vocab f32 | u32 FNV-1a of the values' bytes
 * The run ends through QEMU's isa-debug-exit port (0xf4): 0 written for success, 1 for an error
 * (its reason printed on the first serial port first); on other machines it halts.
 *
 * Models: dense Llama-family ones (Llama, Qwen2 without biases, Qwen3: GQA, QK-norm, tied output,
 * either RoPE layout), every tensor f32; anything else is refused with its reason.
 * -DSEEDED_BUG rotates each query one position too far (the keys are right): an off-by-one RoPE
 * position, for the tests that show the gates catch it.
 */
#include <stddef.h>
#include <stdint.h>

#include "../flat_engine/touchstone_flat.h"

/* ---- boot: the multiboot header, a stack, and a call to kmain(magic, info) ---- */

__asm__(".section .multiboot, \"a\"\n"
        ".align 4\n"
        ".long 0x1BADB002\n"         /* magic */
        ".long 0x00000003\n"         /* page-aligned modules, memory information */
        ".long -(0x1BADB002 + 3)\n"  /* checksum */
        ".section .bss\n"
        ".align 16\n"
        "stack_bottom: .skip 262144\n"
        "stack_top:\n"
        ".section .text\n"
        ".global _start\n"
        "_start:\n"
        "  mov $stack_top, %esp\n"
        "  push %ebx\n"
        "  push %eax\n"
        "  call kmain\n"
        "1: cli\n"
        "  hlt\n"
        "  jmp 1b\n");

struct multiboot_info {
    uint32_t flags, mem_lower, mem_upper, boot_device, cmdline, mods_count, mods_addr;
};
struct multiboot_module {
    uint32_t start, end, string, reserved;
};

/* ---- ports: serial (COM1 text, COM2 frames) and QEMU's exit device ---- */

static inline void outb(uint16_t port, uint8_t v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port)); }
static inline uint8_t inb(uint16_t port) {
    uint8_t v;
    __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port));
    return v;
}

#define COM1 0x3f8
#define COM2 0x2f8

static void serial_init(uint16_t port) {
    outb(port + 1, 0x00); /* no interrupts */
    outb(port + 3, 0x80); /* divisor latch */
    outb(port + 0, 0x01); /* 115200 baud */
    outb(port + 1, 0x00);
    outb(port + 3, 0x03); /* 8N1 */
    outb(port + 2, 0xc7); /* FIFO on, cleared */
}

static void serial_byte(uint16_t port, uint8_t b) {
    while (!(inb(port + 5) & 0x20)) {
    }
    outb(port, b);
}

static void puts_(const char *s) {
    for (; *s; s++) {
        if (*s == '\n') serial_byte(COM1, '\r');
        serial_byte(COM1, (uint8_t)*s);
    }
}

static void putu(uint32_t v) {
    char b[11];
    int n = 0;
    do b[n++] = (char)('0' + v % 10); while ((v /= 10));
    while (n) serial_byte(COM1, (uint8_t)b[--n]);
}

static __attribute__((noreturn)) void finish(uint8_t code) {
    outb(0xf4, code); /* QEMU exits with (code << 1) | 1 */
    for (;;) __asm__ volatile("cli; hlt");
}

static __attribute__((noreturn)) void fail(const char *what, const char *why) {
    puts_("\nerror: ");
    puts_(what);
    puts_(": ");
    puts_(why);
    puts_("\n");
    finish(1);
}

/* 64-bit division for the flat header's checks: the i386 compiler calls these helpers, and a
 * freestanding kernel has no runtime library to provide them. */
uint64_t __udivmoddi4(uint64_t n, uint64_t d, uint64_t *rem) {
    if (d == 0) fail("division", "by zero");
    uint64_t q = 0, r = 0;
    for (int i = 63; i >= 0; i--) {
        r = (r << 1) | ((n >> i) & 1);
        if (r >= d) {
            r -= d;
            q |= 1ull << i;
        }
    }
    if (rem) *rem = r;
    return q;
}
uint64_t __udivdi3(uint64_t n, uint64_t d) { return __udivmoddi4(n, d, 0); }
uint64_t __umoddi3(uint64_t n, uint64_t d) {
    uint64_t r;
    __udivmoddi4(n, d, &r);
    return r;
}

/* ---- x87 arithmetic ---- */

static inline double fsqrt(double x) {
    __asm__("fsqrt" : "+t"(x));
    return x;
}
static inline double fsin(double x) {
    __asm__("fsin" : "+t"(x));
    return x;
}
static inline double fcos(double x) {
    __asm__("fcos" : "+t"(x));
    return x;
}
/* log2(x), x > 0: fyl2x with y = 1. */
static inline double flog2(double x) {
    double r;
    __asm__("fld1\n\tfxch\n\tfyl2x" : "=t"(r) : "0"(x));
    return r;
}
/* 2^x: 2^frac by f2xm1 (|frac| <= 0.5 after rounding), scaled by 2^int with fscale. */
static inline double fexp2(double x) {
    double i, f, r;
    __asm__("frndint" : "=t"(i) : "0"(x));
    f = x - i;
    __asm__("f2xm1" : "+t"(f));
    f += 1.0;
    __asm__("fscale" : "=t"(r) : "0"(f), "u"(i));
    return r;
}
static inline double fexp(double x) {
    if (x < -700.0) return 0.0;
    return fexp2(x * 1.4426950408889634074);
}

/* ---- memory ---- */

static uint8_t *heap, *heap_end;

static void *alloc(uint32_t bytes) {
    uint8_t *p = (uint8_t *)(((uintptr_t)heap + 15) & ~(uintptr_t)15);
    if (bytes > (uint32_t)(heap_end - p)) fail("memory", "the model's activations and cache do not fit: give the machine more memory");
    heap = p + bytes;
    for (uint32_t i = 0; i < bytes; i++) p[i] = 0;
    return p;
}

/* ---- the model ---- */

static const void *file;
static const struct ts_flat_header *h;

static const float *tensor(const char *name, uint64_t n) {
    const struct ts_flat_tensor *t = ts_flat_find(file, name);
    if (!t) fail(name, "missing tensor");
    if (t->dims[0] * t->dims[1] * t->dims[2] * t->dims[3] != n) fail(name, "unexpected shape");
    if (t->type != TS_GGML_F32) fail(name, "not f32: this kernel reads f32 flat files (cargo xtask export --type f32)");
    return (const float *)ts_flat_data(file, t);
}

static const float *layer(int l, const char *tail, uint64_t n) {
    char name[64];
    int k = 0;
    const char *p = "blk.";
    while (*p) name[k++] = *p++;
    char digits[11];
    int d = 0, v = l;
    do digits[d++] = (char)('0' + v % 10); while ((v /= 10));
    while (d) name[k++] = digits[--d];
    name[k++] = '.';
    while (*tail && k < 63) name[k++] = *tail++;
    name[k] = 0;
    return tensor(name, n);
}

static void matvec(float *y, const float *w, const float *x, int rows, int cols) {
    for (int r = 0; r < rows; r++) {
        const float *row = w + (size_t)r * cols;
        double s = 0;
        for (int c = 0; c < cols; c++) s += (double)row[c] * x[c];
        y[r] = (float)s;
    }
}

static void rmsnorm(float *y, const float *x, const float *w, int n) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    double inv = 1.0 / fsqrt(ss / n + h->norm_eps);
    for (int i = 0; i < n; i++) y[i] = (float)(x[i] * inv * w[i]);
}

static void rope(float *v, int n_heads, int pos) {
    int hd = (int)h->head_dim, half = (int)h->n_rot / 2;
    double log2_theta = flog2(h->rope_theta);
    for (int i = 0; i < half; i++) {
        double angle = pos * fexp2(-2.0 * i / h->n_rot * log2_theta);
        double c = fcos(angle), s = fsin(angle);
        for (int hh = 0; hh < n_heads; hh++) {
            float *x = v + hh * hd;
            int a = h->rope_style ? i : 2 * i, b = h->rope_style ? i + half : 2 * i + 1;
            double x0 = x[a], x1 = x[b];
            x[a] = (float)(x0 * c - x1 * s);
            x[b] = (float)(x0 * s + x1 * c);
        }
    }
}

/* ---- the command line ---- */

#define MAX_IDS 4096
static int ids[MAX_IDS], n_ids, n_generate, stream_logits;

static int starts(const char *s, const char *p) {
    while (*p)
        if (*s++ != *p++) return 0;
    return 1;
}

static void parse_cmdline(const char *c) {
    while (*c) {
        while (*c == ' ') c++;
        if (starts(c, "ids=")) {
            c += 4;
            while (*c && *c != ' ') {
                uint32_t v = 0;
                int digits = 0;
                while (*c >= '0' && *c <= '9' && digits < 9) v = v * 10 + (uint32_t)(*c++ - '0'), digits++;
                if (!digits || n_ids == MAX_IDS) fail("ids=", "not up to 4096 comma-separated ids");
                ids[n_ids++] = (int)v;
                if (*c == ',') c++;
                else if (*c && *c != ' ') fail("ids=", "not comma-separated ids");
            }
        } else if (starts(c, "gen=")) {
            c += 4;
            while (*c >= '0' && *c <= '9' && n_generate < 100000) n_generate = n_generate * 10 + (*c++ - '0');
        } else if (starts(c, "logits=1")) {
            stream_logits = 1;
            c += 8;
        }
        while (*c && *c != ' ') c++;
    }
}

/* ---- the logit frames on COM2 ---- */

static void frame_u32(uint32_t v, uint32_t *fnv) {
    for (int i = 0; i < 4; i++) {
        uint8_t b = (uint8_t)(v >> (8 * i));
        serial_byte(COM2, b);
        if (fnv) *fnv = (*fnv ^ b) * 16777619u;
    }
}

static void send_logits(int pos, const float *logits, int n) {
    const char *magic = "TSLG";
    for (int i = 0; i < 4; i++) serial_byte(COM2, (uint8_t)magic[i]);
    frame_u32((uint32_t)pos, 0);
    frame_u32((uint32_t)n, 0);
    uint32_t fnv = 2166136261u;
    for (int i = 0; i < n; i++) {
        union {
            float f;
            uint32_t u;
        } v = {logits[i]};
        frame_u32(v.u, &fnv);
    }
    frame_u32(fnv, 0);
}

/* ---- kmain ---- */

void kmain(uint32_t magic, const struct multiboot_info *mbi) {
    __asm__ volatile("fninit");
    serial_init(COM1);
    serial_init(COM2);
    puts_("touchstone bare-metal kernel\n");
    if (magic != 0x2BADB002) fail("boot", "not started by a multiboot loader");
    if (!(mbi->flags & 8) || mbi->mods_count < 1) fail("boot", "no boot module: pass the flat model file as the first module (qemu -initrd)");
    if (!(mbi->flags & 1)) fail("boot", "the loader gave no memory size");
    if (mbi->flags & 4) parse_cmdline((const char *)(uintptr_t)mbi->cmdline);
    if (n_ids == 0) fail("command line", "no prompt: ids=1,2,3");

    const struct multiboot_module *mod = (const struct multiboot_module *)(uintptr_t)mbi->mods_addr;
    file = (const void *)(uintptr_t)mod->start;
    uint32_t len = mod->end - mod->start;
    heap = (uint8_t *)(uintptr_t)((mod->end + 4095) & ~4095u);
    heap_end = (uint8_t *)(uintptr_t)(0x100000u + mbi->mem_upper * 1024u);
    if (heap >= heap_end) fail("memory", "nothing above the module");
    const char *bad = ts_flat_check(file, len, 1);
    if (bad) fail("model", bad);
    h = ts_flat_header(file);
    if (h->n_expert) fail("model", "MoE models are not implemented here");
    if (h->rope_scaling != TS_ROPE_NONE || (h->flags & TS_FLAT_FREQ_FACTORS)) fail("model", "RoPE scaling is not implemented here");
    if (h->sliding_window) fail("model", "sliding-window attention is not implemented here");
    if ((h->flags & (TS_FLAT_POST_NORMS | TS_FLAT_QKV_BIAS | TS_FLAT_OUT_BIAS)) || h->embd_scale != 0.0) fail("model", "post-norms, biases and embedding scales are not implemented here");
    if (h->activation != 0) fail("model", "only SiLU-gated FFNs are implemented here");

    const int E = (int)h->n_embd, L = (int)h->n_layer, H = (int)h->n_head, HK = (int)h->n_head_kv, D = (int)h->head_dim, F = (int)h->n_ff, V = (int)h->n_vocab;
    if (!E || !L || !H || !HK || !D || !F || !V || H % HK || h->n_rot > h->head_dim) fail("model", "inconsistent dimensions");
    for (int i = 0; i < n_ids; i++)
        if (ids[i] >= V) fail("ids=", "an id outside the vocabulary");
    const int qk_norm = !!(h->flags & TS_FLAT_QK_NORM);
    const int n_prompt = n_ids, cap = n_prompt + n_generate > MAX_IDS ? MAX_IDS : n_prompt + n_generate;
    const float *embd = tensor("token_embd.weight", (uint64_t)E * V), *out_norm = tensor("output_norm.weight", E);
    const float *out_w = (h->flags & TS_FLAT_TIED_OUTPUT) ? embd : tensor("output.weight", (uint64_t)E * V);

    float *kcache = alloc((uint32_t)L * cap * HK * D * 4), *vcache = alloc((uint32_t)L * cap * HK * D * 4);
    float *x = alloc(E * 4), *xn = alloc(E * 4), *q = alloc(H * D * 4), *k = alloc(HK * D * 4), *v = alloc(HK * D * 4);
    float *att = alloc(H * D * 4), *tmp = alloc(E * 4), *g = alloc(F * 4), *u = alloc(F * 4), *logits = alloc(V * 4);
    double *sc = alloc(cap * 8);

    for (int pos = 0; pos < n_ids && pos < cap; pos++) {
        for (int i = 0; i < E; i++) x[i] = embd[(size_t)ids[pos] * E + i];
        for (int l = 0; l < L; l++) {
            rmsnorm(xn, x, layer(l, "attn_norm.weight", E), E);
            matvec(q, layer(l, "attn_q.weight", (uint64_t)E * H * D), xn, H * D, E);
            matvec(k, layer(l, "attn_k.weight", (uint64_t)E * HK * D), xn, HK * D, E);
            matvec(v, layer(l, "attn_v.weight", (uint64_t)E * HK * D), xn, HK * D, E);
            if (qk_norm) {
                const float *qn = layer(l, "attn_q_norm.weight", D), *kn = layer(l, "attn_k_norm.weight", D);
                for (int hh = 0; hh < H; hh++) rmsnorm(q + hh * D, q + hh * D, qn, D);
                for (int hh = 0; hh < HK; hh++) rmsnorm(k + hh * D, k + hh * D, kn, D);
            }
#ifdef SEEDED_BUG
            rope(q, H, pos + 1);
#else
            rope(q, H, pos);
#endif
            rope(k, HK, pos);
            float *kc = kcache + (size_t)l * cap * HK * D, *vc = vcache + (size_t)l * cap * HK * D;
            for (int i = 0; i < HK * D; i++) {
                kc[(size_t)pos * HK * D + i] = k[i];
                vc[(size_t)pos * HK * D + i] = v[i];
            }
            for (int hh = 0; hh < H; hh++) {
                int kh = hh / (H / HK);
                double max = -1e300, sum = 0;
                for (int t = 0; t <= pos; t++) {
                    double s = 0;
                    for (int d = 0; d < D; d++) s += (double)q[hh * D + d] * kc[((size_t)t * HK + kh) * D + d];
                    sc[t] = s * h->attn_scale;
                    if (sc[t] > max) max = sc[t];
                }
                for (int t = 0; t <= pos; t++) {
                    sc[t] = fexp(sc[t] - max);
                    sum += sc[t];
                }
                for (int d = 0; d < D; d++) {
                    double acc = 0;
                    for (int t = 0; t <= pos; t++) acc += sc[t] * vc[((size_t)t * HK + kh) * D + d];
                    att[hh * D + d] = (float)(acc / sum);
                }
            }
            matvec(tmp, layer(l, "attn_output.weight", (uint64_t)H * D * E), att, E, H * D);
            for (int i = 0; i < E; i++) x[i] += tmp[i];
            rmsnorm(xn, x, layer(l, "ffn_norm.weight", E), E);
            matvec(g, layer(l, "ffn_gate.weight", (uint64_t)E * F), xn, F, E);
            matvec(u, layer(l, "ffn_up.weight", (uint64_t)E * F), xn, F, E);
            for (int i = 0; i < F; i++) g[i] = (float)(g[i] / (1.0 + fexp(-(double)g[i])) * u[i]);
            matvec(tmp, layer(l, "ffn_down.weight", (uint64_t)F * E), g, E, F);
            for (int i = 0; i < E; i++) x[i] += tmp[i];
        }
        rmsnorm(xn, x, out_norm, E);
        matvec(logits, out_w, xn, V, E);
        if (stream_logits && pos < n_prompt) send_logits(pos, logits, V);
        if (pos == n_ids - 1 && n_ids < cap) {
            int best = 0;
            for (int i = 1; i < V; i++)
                if (logits[i] > logits[best]) best = i;
            ids[n_ids++] = best;
        }
    }
    puts_("generated:\n");
    for (int i = n_prompt; i < n_ids; i++) {
        if (i > n_prompt) serial_byte(COM1, ',');
        putu((uint32_t)ids[i]);
    }
    puts_("\n");
    finish(0);
}
