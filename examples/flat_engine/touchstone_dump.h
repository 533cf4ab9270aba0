/* touchstone_dump.h: write a Touchstone dump (docs/DUMP_FORMAT.md, version 1) from a C engine.
 *
 * One header, C99, the C library only: copy it beside your engine. Touchstone runs the engine as
 * `exec:CMD` with the request in its environment (TOUCHSTONE_MODEL, TOUCHSTONE_PROMPT_IDS,
 * TOUCHSTONE_N_GENERATE, TOUCHSTONE_OUT, TOUCHSTONE_MODEL_SHA256); the engine writes what it
 * computed:
 *
 *     ts_dump d;
 *     if (ts_dump_begin(&d, getenv("TOUCHSTONE_OUT"), "my-engine", "model", getenv("TOUCHSTONE_MODEL_SHA256"),
 *                       "llama", ids, n_ids, "{\"storage\":\"f32\",\"accumulate\":\"f32\"}")) die(d.error);
 *     ts_dump_tap(&d, "blk.0.l_out", l_out0, n_ids, n_embd);     // [n_positions, width], f32, row-major
 *     ...
 *     ts_dump_logits(&d, logits, n_ids, n_vocab);                 // or ts_dump_generated(&d, ids, n)
 *     if (ts_dump_finish(&d)) die(d.error);
 *
 * Each tap is written to a safetensors file of its own as it is given (nothing is held but the
 * manifest's text); the manifest is written last, by ts_dump_finish. Every function returns 0,
 * or -1 with the reason in d.error; after a failure the others do nothing and return -1. The
 * arithmetic declaration is JSON as docs/DUMP_FORMAT.md gives it (NULL: f32 storage and
 * accumulation). Tap names are the ones docs/DUMP_FORMAT.md lists.
 */
#ifndef TOUCHSTONE_DUMP_H
#define TOUCHSTONE_DUMP_H

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct ts_dump {
    char dir[4096];
    char error[512];
    int n_positions;
    int n_taps;
    int failed;
    char precision[32]; /* the manifest's `precision` (default "f32"): ts_dump_set_precision */
    /* The manifest's `taps` and the fields after them, grown as taps are given. */
    char *taps_json;
    size_t taps_len, taps_cap;
    char *head_json; /* format, model, device, ids, positions, arithmetic */
    char *tail_json; /* logits or generated_ids */
} ts_dump;

static inline int ts__fail(ts_dump *d, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->error, sizeof d->error, fmt, ap);
    va_end(ap);
    d->failed = 1;
    return -1;
}

/* Appends printf-formatted text to a growing buffer; -1 when out of memory. */
static inline int ts__append(char **buf, size_t *len, size_t *cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0) return -1;
    if (*len + (size_t)n + 1 > *cap) {
        size_t want = (*cap ? *cap * 2 : 4096);
        while (want < *len + (size_t)n + 1) want *= 2;
        char *p = (char *)realloc(*buf, want);
        if (!p) return -1;
        *buf = p;
        *cap = want;
    }
    va_start(ap, fmt);
    vsnprintf(*buf + *len, *cap - *len, fmt, ap);
    va_end(ap);
    *len += (size_t)n;
    return 0;
}

/* A JSON string (quotes included) of `s`, escaped; -1 when out of memory. */
static inline int ts__append_string(char **buf, size_t *len, size_t *cap, const char *s) {
    if (ts__append(buf, len, cap, "\"")) return -1;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        int r = c == '"' || c == '\\' ? ts__append(buf, len, cap, "\\%c", c) : c < 0x20 ? ts__append(buf, len, cap, "\\u%04x", c) : ts__append(buf, len, cap, "%c", c);
        if (r) return -1;
    }
    return ts__append(buf, len, cap, "\"");
}

/* Writes one f32 tensor [rows, cols] as a safetensors file `dir/file`, little-endian. */
static inline int ts__write_tensor(ts_dump *d, const char *file, const char *name, const float *data, int rows, int cols) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", d->dir, file);
    char *head = NULL;
    size_t len = 0, cap = 0;
    size_t bytes = (size_t)rows * (size_t)cols * 4;
    if (ts__append(&head, &len, &cap, "{") || ts__append_string(&head, &len, &cap, name) ||
        ts__append(&head, &len, &cap, ":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":[0,%zu]}}", rows, cols, bytes))
        return free(head), ts__fail(d, "%s: out of memory", path);
    while (len % 8)
        if (ts__append(&head, &len, &cap, " ")) return free(head), ts__fail(d, "%s: out of memory", path);
    FILE *f = fopen(path, "wb");
    if (!f) return free(head), ts__fail(d, "%s: cannot create", path);
    unsigned char n8[8];
    for (int i = 0; i < 8; i++) n8[i] = (unsigned char)((uint64_t)len >> (8 * i));
    int ok = fwrite(n8, 1, 8, f) == 8 && fwrite(head, 1, len, f) == len;
    free(head);
    /* Little-endian f32, whatever the host's byte order. */
    for (size_t i = 0; ok && i < (size_t)rows * (size_t)cols; i++) {
        uint32_t u;
        memcpy(&u, &data[i], 4);
        unsigned char b[4] = {(unsigned char)u, (unsigned char)(u >> 8), (unsigned char)(u >> 16), (unsigned char)(u >> 24)};
        ok = fwrite(b, 1, 4, f) == 4;
    }
    if (fclose(f) || !ok) return ts__fail(d, "%s: write failed", path);
    return 0;
}

/* Starts a dump of the request `ids` into `dir`. `model_sha256` is the model's sha256, as
 * Touchstone passes it in TOUCHSTONE_MODEL_SHA256; `arithmetic_json` may be NULL. */
static inline int ts_dump_begin(ts_dump *d, const char *dir, const char *device, const char *model_name, const char *model_sha256, const char *arch, const int *ids, int n_ids,
                         const char *arithmetic_json) {
    memset(d, 0, sizeof *d);
    if (!dir || !*dir) return ts__fail(d, "no output directory (TOUCHSTONE_OUT)");
    if (!model_sha256 || !*model_sha256) return ts__fail(d, "no model sha256 (TOUCHSTONE_MODEL_SHA256)");
    if (strlen(dir) >= sizeof d->dir) return ts__fail(d, "output directory path too long");
    strcpy(d->dir, dir);
    strcpy(d->precision, "f32");
    d->n_positions = n_ids;
    size_t len = 0, cap = 0;
    char **h = &d->head_json;
    int bad = ts__append(h, &len, &cap, "{\"format\":\"touchstone-dump\",\"version\":1,\"model\":{\"name\":") || ts__append_string(h, &len, &cap, model_name ? model_name : "model") ||
              ts__append(h, &len, &cap, ",\"sha256\":") || ts__append_string(h, &len, &cap, model_sha256) || ts__append(h, &len, &cap, ",\"arch\":") ||
              ts__append_string(h, &len, &cap, arch ? arch : "llama") || ts__append(h, &len, &cap, "},\"device\":") || ts__append_string(h, &len, &cap, device ? device : "engine") ||
              ts__append(h, &len, &cap, ",\"token_ids\":[");
    for (int i = 0; !bad && i < n_ids; i++) bad = ts__append(h, &len, &cap, "%s%d", i ? "," : "", ids[i]);
    bad = bad || ts__append(h, &len, &cap, "],\"positions\":[");
    for (int i = 0; !bad && i < n_ids; i++) bad = ts__append(h, &len, &cap, "%s%d", i ? "," : "", i);
    bad = bad || ts__append(h, &len, &cap, "],");
    if (!bad && arithmetic_json) bad = ts__append(h, &len, &cap, "\"arithmetic\":%s,", arithmetic_json);
    if (bad) return ts__fail(d, "out of memory");
    return 0;
}

/* The manifest's `precision`, a word for how the engine computes (`q16`, `bf16`); "f32" unless set. */
static inline int ts_dump_set_precision(ts_dump *d, const char *precision) {
    if (d->failed) return -1;
    if (strlen(precision) >= sizeof d->precision || strpbrk(precision, "\"\\")) return ts__fail(d, "precision `%s`: at most 31 characters, no quotes", precision);
    strcpy(d->precision, precision);
    return 0;
}

/* One tap: `data` holds [rows, cols] f32 row-major, a row per position (rows == n_ids). */
static inline int ts_dump_tap(ts_dump *d, const char *name, const float *data, int rows, int cols) {
    if (d->failed) return -1;
    if (rows != d->n_positions) return ts__fail(d, "tap %s: %d rows for %d positions", name, rows, d->n_positions);
    char file[64];
    snprintf(file, sizeof file, "tap_%04d.safetensors", d->n_taps);
    if (ts__write_tensor(d, file, name, data, rows, cols)) return -1;
    if (ts__append(&d->taps_json, &d->taps_len, &d->taps_cap, "%s{\"name\":", d->n_taps ? "," : "") || ts__append_string(&d->taps_json, &d->taps_len, &d->taps_cap, name) ||
        ts__append(&d->taps_json, &d->taps_len, &d->taps_cap, ",\"shape\":[%d,%d],\"dtype\":\"f32\",\"file\":\"%s\"}", rows, cols, file))
        return ts__fail(d, "out of memory");
    d->n_taps++;
    return 0;
}

/* The logits of every position: [rows, n_vocab] f32 row-major. */
static inline int ts_dump_logits(ts_dump *d, const float *data, int rows, int n_vocab) {
    if (d->failed) return -1;
    if (rows != d->n_positions) return ts__fail(d, "logits: %d rows for %d positions", rows, d->n_positions);
    if (ts__write_tensor(d, "logits.safetensors", "logits", data, rows, n_vocab)) return -1;
    size_t len = 0, cap = 0;
    free(d->tail_json);
    d->tail_json = NULL;
    if (ts__append(&d->tail_json, &len, &cap, "\"logits\":{\"name\":\"logits\",\"shape\":[%d,%d],\"dtype\":\"f32\",\"file\":\"logits.safetensors\"}", rows, n_vocab))
        return ts__fail(d, "out of memory");
    return 0;
}

/* A token-only dump: the ids generated greedily after the request's ids. */
static inline int ts_dump_generated(ts_dump *d, const int *ids, int n) {
    if (d->failed) return -1;
    size_t len = 0, cap = 0;
    free(d->tail_json);
    d->tail_json = NULL;
    int bad = ts__append(&d->tail_json, &len, &cap, "\"logits\":null,\"generated_ids\":[");
    for (int i = 0; !bad && i < n; i++) bad = ts__append(&d->tail_json, &len, &cap, "%s%d", i ? "," : "", ids[i]);
    if (bad || ts__append(&d->tail_json, &len, &cap, "]")) return ts__fail(d, "out of memory");
    return 0;
}

/* Writes manifest.json and frees what the dump held. */
static inline int ts_dump_finish(ts_dump *d) {
    int rc = 0;
    if (d->failed) {
        rc = -1;
    } else if (!d->tail_json) {
        rc = ts__fail(d, "nothing to write: give the logits (ts_dump_logits) or the generated ids (ts_dump_generated)");
    } else {
        char path[4200], tmp[4300];
        snprintf(path, sizeof path, "%s/manifest.json", d->dir);
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        FILE *f = fopen(tmp, "w");
        if (!f) {
            rc = ts__fail(d, "%s: cannot create", tmp);
        } else {
            int ok = fprintf(f, "%s\"precision\":\"%s\",\"taps\":[%s],%s}\n", d->head_json, d->precision, d->taps_json ? d->taps_json : "", d->tail_json) > 0;
            if (fclose(f) || !ok || rename(tmp, path)) rc = ts__fail(d, "%s: write failed", path);
        }
    }
    free(d->head_json);
    free(d->taps_json);
    free(d->tail_json);
    d->head_json = d->taps_json = d->tail_json = NULL;
    return rc;
}

#endif
