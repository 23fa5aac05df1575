/* Linear layers and embedding lookups on weights stored in other formats than
 * float32 panels, computed from the stored values without a float32 copy.
 *
 * Formats (QUANT_* below): bf16 (bf16_kernels.c) and W8A8 (int8_kernels.c),
 * dispatched to their own sources; here, int8 with one float32 scale per
 * output column (float32 activations), and three GGUF block formats over
 * blocks of 32 weights along K, each block with a float16 scale d (and for
 * Q4_1 a float16 minimum m):
 *   Q8_0: w = d * q,        q int8
 *   Q4_0: w = d * (q - 8),  q in 0..15
 *   Q4_1: w = d * q + m,    q in 0..15
 *
 * Weights are repacked at load (not dequantized) into panels of LINEAR_NR = 16
 * output columns, like the float32 path's.
 *
 * int8: a panel is [K][16] int8. Each k's 16 quants are widened to two float
 * vectors in registers and multiplied by x; y = scale * sum_k x q. Few rows
 * (decode) read the panel once, in tiles of rows x panels that keep enough
 * independent sums in flight; many rows (prompt chunks) widen each panel once
 * into a float32 scratch panel and run the float32 register-blocked kernel
 * over it. Both compute each output in the same order.
 *
 * GGUF: integer dot products, as llama.cpp computes them, but with 16-bit
 * activations: each row of x is quantized per block of 32 to int16 (x = dx *
 * xq, dx = max |x| / 32767; the perplexity of the default model moves by
 * under 0.001 %, where 8-bit activations moved it by 0.19 %). A panel is a run
 * of groups, one per block: the 16 columns' d (float16), for Q4_1 their 16 m,
 * then 16 pairs of k, each pair the 16 columns' quants interleaved by k so
 * that one multiply-add of int16 pairs (pmaddwd) sums a pair of k for 8
 * columns: Q8_0 32 bytes per pair (columns 0-7 as c0k0 c0k1 c1k0 ..., then
 * columns 8-15); Q4_0/Q4_1 16 bytes per pair, byte 2c + j holding column c's
 * quant of k 2p + j in its low nibble and column c + 8's in its high one.
 * A block's integer sums t = sum_k xq q (exact in int32) then give
 *   y += (d dx) t + m (dx sum_k xq)   (Q4_1),   y += (d dx) (t - 8 sum_k xq)   (Q4_0).
 * Every row is computed by the same code whatever the batch, so results do not
 * depend on it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "linear_kernel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_X86 1
#endif

enum { QUANT_INT8 = 0, QUANT_Q8_0 = 1, QUANT_Q4_0 = 2, QUANT_Q4_1 = 3, QUANT_BF16 = 4,
       QUANT_W8A8 = 5 };

#define QUANT_BLOCK 32
/* int8: from this many rows on, widen each panel once into scratch. */
#define QUANT_SCRATCH_MIN_ROWS 8
/* GGUF: rows computed together against one panel (sharing each widened quant). */
#define GGUF_MR 4
/* Groups ahead of use that a tile asks the memory for. */
#define GGUF_PREFETCH_GROUPS 8

typedef int16_t v16h __attribute__((vector_size(32)));
typedef uint8_t v16u8 __attribute__((vector_size(16), aligned(1), may_alias));
typedef int8_t v16s8 __attribute__((vector_size(16), aligned(1), may_alias));

/* ---- widening helpers (AVX2 instructions where present) ---- */

/* 8 bytes to 8 int32, sign- or zero-extended. */
static inline __attribute__((always_inline)) v8i widen_bytes(const uint8_t *p, int is_signed)
{
#ifdef QUANT_X86
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    return (v8i)(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
    v8i v;
    for (int i = 0; i < 8; i++)
        v[i] = is_signed ? (int8_t)p[i] : p[i];
    return v;
#endif
}

static inline v8f to_float(v8i v)
{
#ifdef QUANT_X86
    return (v8f)_mm256_cvtepi32_ps((__m256i)v);
#else
    return __builtin_convertvector(v, v8f);
#endif
}

/* IEEE half (bits) to float. */
static inline float half_to_float(uint16_t h)
{
#ifdef QUANT_X86
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        v.u = sign | ((exp + 112) << 23) | (mant << 13);
    } else {  /* zero or subnormal: mant * 2^-24 */
        v.f = (float)mant * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
#endif
}

static inline v8f halves_to_float(const uint8_t *p)
{
#ifdef QUANT_X86
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    v8f v;
    for (int i = 0; i < 8; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        v[i] = half_to_float(h);
    }
    return v;
#endif
}

/* Lane i: w[2i] * x[0] + w[2i + 1] * x[1], x the int16 pair in `pair`. */
static inline __attribute__((always_inline)) v8i madd_pairs(v16h w, int32_t pair)
{
#ifdef QUANT_X86
    return (v8i)_mm256_madd_epi16((__m256i)w, _mm256_set1_epi32(pair));
#else
    const int16_t x0 = (int16_t)(pair & 0xffff), x1 = (int16_t)((uint32_t)pair >> 16);
    v8i r;
    for (int i = 0; i < 8; i++)
        r[i] = (int32_t)w[2 * i] * x0 + (int32_t)w[2 * i + 1] * x1;
    return r;
#endif
}

/* ---- panel layout ---- */

static inline int64_t header_bytes(int fmt)
{
    return fmt == QUANT_Q4_1 ? 4 * LINEAR_NR : 2 * LINEAR_NR;
}

/* Bytes of one pair of k's quants for the 16 columns. */
static inline int64_t pair_bytes(int fmt)
{
    return fmt == QUANT_Q8_0 ? 2 * LINEAR_NR : LINEAR_NR;
}

static inline int64_t group_bytes(int fmt)
{
    return header_bytes(fmt) + QUANT_BLOCK / 2 * pair_bytes(fmt);
}

static inline int64_t panel_bytes_of(int64_t fmt, int64_t k)
{
    return fmt == QUANT_INT8 ? k * LINEAR_NR : k / QUANT_BLOCK * group_bytes((int)fmt);
}

/* ---- int8: float arithmetic on widened quants ---- */

/* The 16 quants of row kk of an int8 panel as floats. */
static inline __attribute__((always_inline)) void widen_int8(const uint8_t *q, int64_t kk,
                                                             v8f *w0, v8f *w1)
{
    *w0 = to_float(widen_bytes(q + kk * LINEAR_NR, 1));
    *w1 = to_float(widen_bytes(q + kk * LINEAR_NR + 8, 1));
}

#define INT8_TILE 4  /* rows x panels of a tile, at most */

/* `rows` rows against `panels` adjacent panels (rows * panels <= 4), read once. */
static inline __attribute__((always_inline)) void int8_tile(
    const float *x, int64_t k, const uint8_t *panel, int64_t panel_bytes, int panels,
    const float *scale, const float *bias, float *y, int64_t n, int64_t col, int rows)
{
    v8f acc[INT8_TILE][2];  /* row r, panel p at r * panels + p */
    for (int i = 0; i < INT8_TILE; i++)
        acc[i][0] = acc[i][1] = (v8f){0};
    for (int64_t kk = 0; kk < k; kk++) {
        for (int p = 0; p < panels; p++) {
            v8f w0, w1;
            widen_int8(panel + p * panel_bytes, kk, &w0, &w1);
            for (int r = 0; r < rows; r++) {
                const float xv = x[r * k + kk];
                acc[r * panels + p][0] += xv * w0;
                acc[r * panels + p][1] += xv * w1;
            }
        }
    }
    for (int p = 0; p < panels; p++) {
        v8f out[INT8_TILE][2];
        for (int r = 0; r < rows; r++) {
            out[r][0] = acc[r * panels + p][0];
            out[r][1] = acc[r * panels + p][1];
        }
        const int64_t c = col + p * LINEAR_NR;
        store_block(out, rows, scale, bias, y, n, c, n - c < LINEAR_NR ? n - c : LINEAR_NR);
    }
}

/* `count` adjacent panels from column col: directly for few rows, else each
 * through the float32 scratch panel `wide`. */
static void int8_unit(const float *x, int64_t m, int64_t k, const uint8_t *panel,
                      int64_t panel_bytes, int count, const float *scale, const float *bias,
                      float *y, int64_t n, int64_t col, float *wide)
{
    if (wide != NULL) {
        for (int64_t kk = 0; kk < k; kk++)
            widen_int8(panel, kk, (v8f *)(wide + kk * LINEAR_NR),
                       (v8f *)(wide + kk * LINEAR_NR + 8));
        linear_panel(x, m, k, wide, WEIGHTS_F32, scale, bias, y, n, col,
                     n - col < LINEAR_NR ? n - col : LINEAR_NR, NULL);
        return;
    }
    if (m == 1 && count == 4) {
        int8_tile(x, k, panel, panel_bytes, 4, scale, bias, y, n, col, 1);
        return;
    }
    if (m == 2 && count == 2) {
        int8_tile(x, k, panel, panel_bytes, 2, scale, bias, y, n, col, 2);
        return;
    }
    for (int p = 0; p < count; p++) {
        const uint8_t *pp = panel + p * panel_bytes;
        const int64_t c = col + p * LINEAR_NR;
        int64_t row = 0;
        for (; row + 4 <= m; row += 4)
            int8_tile(x + row * k, k, pp, panel_bytes, 1, scale, bias, y + row * n, n, c, 4);
        const float *xr = x + row * k;
        float *yr = y + row * n;
        switch (m - row) {  /* constant row counts, so each tail is unrolled too */
        case 3: int8_tile(xr, k, pp, panel_bytes, 1, scale, bias, yr, n, c, 3); break;
        case 2: int8_tile(xr, k, pp, panel_bytes, 1, scale, bias, yr, n, c, 2); break;
        case 1: int8_tile(xr, k, pp, panel_bytes, 1, scale, bias, yr, n, c, 1); break;
        default: break;
        }
    }
}

static int int8_linear(const float *x, const uint8_t *packed, const float *scale,
                       const float *bias, float *y, int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR;
    const int64_t panel_bytes = panel_bytes_of(QUANT_INT8, k);
    const int scratch = m >= QUANT_SCRATCH_MIN_ROWS;
    /* Panels per unit of work: a decode tile's, or one. */
    const int64_t width = scratch ? 1 : m == 1 ? 4 : m == 2 ? 2 : 1;
    const int64_t units = (panels + width - 1) / width;
    int failed = 0;
#pragma omp parallel if (m * n * k > PARALLEL_MIN_WORK)
    {
        /* Cache-line aligned: a vector load never straddles two lines. */
        float *wide = scratch ? aligned_alloc(64, (size_t)(k * LINEAR_NR) * sizeof(float))
                              : NULL;
        if (scratch && wide == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t u = 0; u < units; u++) {
            if (scratch && wide == NULL)
                continue;
            const int64_t first = u * width;
            const int count = (int)(panels - first < width ? panels - first : width);
            int8_unit(x, m, k, packed + first * panel_bytes, panel_bytes, count, scale, bias,
                      y, n, first * LINEAR_NR, wide);
        }
        free(wide);
    }
    return failed ? -1 : 0;
}

/* ---- GGUF: integer sums over int16 activations ---- */

/* Row r's activations per block g: xq (int16, k per row), dx[r * groups + g]
 * and the block's integer sum of xq (for Q4_0's offset) or dx times it (for
 * Q4_1's minimum). */
typedef struct {
    int16_t *xq;
    float *dx, *xsum;
    int32_t *isum;
} quantized_rows;

static void quantize_rows(const float *x, int64_t m, int64_t k, quantized_rows *qr)
{
    const int64_t groups = k / QUANT_BLOCK;
#pragma omp parallel for if (m * k > PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < m * groups; i++) {
        const float *xb = x + i * QUANT_BLOCK;  /* rows are k floats apart: blocks too */
        int16_t *qb = qr->xq + i * QUANT_BLOCK;
        float amax = 0.0f;
        for (int j = 0; j < QUANT_BLOCK; j++) {
            const float a = xb[j] < 0 ? -xb[j] : xb[j];
            amax = a > amax ? a : amax;
        }
        const float inv = amax > 0 ? 32767.0f / amax : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QUANT_BLOCK; j++) {
            float v = __builtin_nearbyintf(xb[j] * inv);
            v = v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v;
            qb[j] = (int16_t)v;
            sum += qb[j];
        }
        qr->dx[i] = amax / 32767.0f;
        qr->isum[i] = sum;
        qr->xsum[i] = qr->dx[i] * (float)sum;
    }
}

/* The 16 columns' quants of pair p of a group as int16: columns 0-7 in *w0,
 * 8-15 in *w1, each as c0k0 c0k1 c1k0 ... */
static inline __attribute__((always_inline)) void widen_pair(int fmt, const uint8_t *q, int p,
                                                             v16h *w0, v16h *w1)
{
#ifdef QUANT_X86
    if (fmt == QUANT_Q8_0) {
        *w0 = (v16h)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + p * 32)));
        *w1 = (v16h)_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + p * 32 + 16)));
        return;
    }
    const v16h v = (v16h)_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(q + p * 16)));
#else
    if (fmt == QUANT_Q8_0) {
        *w0 = __builtin_convertvector(*(const v16s8 *)(q + p * 32), v16h);
        *w1 = __builtin_convertvector(*(const v16s8 *)(q + p * 32 + 16), v16h);
        return;
    }
    const v16h v = __builtin_convertvector(*(const v16u8 *)(q + p * 16), v16h);
#endif
    *w0 = v & 15;
    *w1 = v >> 4;
}

/* `rows` rows (of xq, k apart) against one panel into y's columns col.. */
static inline __attribute__((always_inline)) void gguf_tile(
    int fmt, const quantized_rows *qr, int64_t row0, int64_t k, const uint8_t *panel,
    const float *bias, float *y, int64_t n, int64_t col, int64_t cols, int rows)
{
    const int64_t groups = k / QUANT_BLOCK, stride = group_bytes(fmt);
    v8f acc[GGUF_MR][2];
    for (int r = 0; r < GGUF_MR; r++)
        acc[r][0] = acc[r][1] = (v8f){0};
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = panel + g * stride, *q = group + header_bytes(fmt);
        /* The hardware prefetcher alone left a decode's small matrices well
         * short of the memory bandwidth (1.12x slower over a layer's four).
         * Past the last group this asks for the next panel, or for nothing
         * (a prefetch never faults). */
        for (int64_t b = 0; b < stride; b += 64)
            __builtin_prefetch(group + GGUF_PREFETCH_GROUPS * stride + b);
        v8i t[GGUF_MR][2];
        for (int r = 0; r < GGUF_MR; r++)
            t[r][0] = t[r][1] = (v8i){0};
#pragma GCC unroll 4
        for (int p = 0; p < QUANT_BLOCK / 2; p++) {
            v16h w0, w1;
            widen_pair(fmt, q, p, &w0, &w1);
            for (int r = 0; r < rows; r++) {
                int32_t pair;
                memcpy(&pair, qr->xq + (row0 + r) * k + g * QUANT_BLOCK + 2 * p, 4);
                t[r][0] += madd_pairs(w0, pair);
                t[r][1] += madd_pairs(w1, pair);
            }
        }
        const v8f d0 = halves_to_float(group), d1 = halves_to_float(group + 16);
        v8f m0 = {0}, m1 = {0};
        if (fmt == QUANT_Q4_1) {
            m0 = halves_to_float(group + 32);
            m1 = halves_to_float(group + 48);
        }
        for (int r = 0; r < rows; r++) {
            const int64_t i = (row0 + r) * groups + g;
            if (fmt == QUANT_Q4_0) {
                t[r][0] -= 8 * qr->isum[i];
                t[r][1] -= 8 * qr->isum[i];
            }
            acc[r][0] += d0 * qr->dx[i] * to_float(t[r][0]);
            acc[r][1] += d1 * qr->dx[i] * to_float(t[r][1]);
            if (fmt == QUANT_Q4_1) {
                acc[r][0] += m0 * qr->xsum[i];
                acc[r][1] += m1 * qr->xsum[i];
            }
        }
    }
    store_block(acc, rows, NULL, bias, y + row0 * n, n, col, cols);
}

/* All m rows against one panel: tiles of GGUF_MR rows, then the tail with a
 * constant row count, so that each tail is unrolled too. */
static inline __attribute__((always_inline)) void gguf_panel(
    int fmt, const quantized_rows *qr, int64_t m, int64_t k, const uint8_t *panel,
    const float *bias, float *y, int64_t n, int64_t col)
{
    const int64_t cols = n - col < LINEAR_NR ? n - col : LINEAR_NR;
    int64_t row = 0;
    for (; row + GGUF_MR <= m; row += GGUF_MR)
        gguf_tile(fmt, qr, row, k, panel, bias, y, n, col, cols, GGUF_MR);
    switch (m - row) {
    case 3: gguf_tile(fmt, qr, row, k, panel, bias, y, n, col, cols, 3); break;
    case 2: gguf_tile(fmt, qr, row, k, panel, bias, y, n, col, cols, 2); break;
    case 1: gguf_tile(fmt, qr, row, k, panel, bias, y, n, col, cols, 1); break;
    default: break;
    }
}

static int gguf_linear(int fmt, const float *x, const uint8_t *packed, const float *bias,
                       float *y, int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR, groups = k / QUANT_BLOCK;
    const int64_t panel_bytes = panel_bytes_of(fmt, k);
    /* One allocation: xq, then dx, xsum and isum (4 bytes each per block). */
    char *memory = malloc((size_t)(m * k) * sizeof(int16_t) + (size_t)(m * groups) * 12);
    if (memory == NULL)
        return -1;
    quantized_rows qr;
    qr.xq = (int16_t *)memory;
    qr.dx = (float *)(memory + m * k * sizeof(int16_t));
    qr.xsum = qr.dx + m * groups;
    qr.isum = (int32_t *)(qr.xsum + m * groups);
    quantize_rows(x, m, k, &qr);
#pragma omp parallel for schedule(static) if (m * n * k > PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *panel = packed + p * panel_bytes;
        /* A constant format in each case, so that each inner loop is
         * specialised (OpenMP outlines this region before inlining). */
        switch (fmt) {
        case QUANT_Q8_0: gguf_panel(QUANT_Q8_0, &qr, m, k, panel, bias, y, n, p * LINEAR_NR); break;
        case QUANT_Q4_0: gguf_panel(QUANT_Q4_0, &qr, m, k, panel, bias, y, n, p * LINEAR_NR); break;
        default: gguf_panel(QUANT_Q4_1, &qr, m, k, panel, bias, y, n, p * LINEAR_NR); break;
        }
    }
    free(memory);
    return 0;
}

int64_t inflight_panel_bytes(int64_t fmt, int64_t k)
{
    switch (fmt) {
    case QUANT_BF16: return panel_size(WEIGHTS_BF16, k);
    case QUANT_W8A8: return inflight_w8a8_panel_bytes(k);
    default: return panel_bytes_of(fmt, k);
    }
}

/* y[M, N] = x[M, K] . W^T (+ bias) for W packed in format fmt (scale: the
 * int8 and W8A8 column scales, padded to whole panels). Returns -1 if scratch
 * memory ran out, -2 for an unknown format. */
int inflight_quant_linear(int64_t fmt, const float *x, const uint8_t *packed, const float *scale,
                          const float *bias, float *y, int64_t m, int64_t n, int64_t k)
{
    switch (fmt) {
    case QUANT_INT8: return int8_linear(x, packed, scale, bias, y, m, n, k);
    case QUANT_Q8_0: case QUANT_Q4_0: case QUANT_Q4_1:
        return gguf_linear((int)fmt, x, packed, bias, y, m, n, k);
    case QUANT_BF16: return inflight_bf16_linear(x, packed, bias, y, m, n, k);
    case QUANT_W8A8: return inflight_w8a8_linear(x, packed, scale, bias, y, m, n, k);
    default: return -2;
    }
}

/* out[t, :] = row ids[t] of W (an embedding table stored as panels: its own, or
 * the output layer's it is tied to), each weight as the linear kernels use it
 * (int8 times its column's scale; d q + m, d (q - 8) or d q; bf16 widened). */
void inflight_quant_embedding(int64_t fmt, const int64_t *ids, int64_t num_tokens,
                              const uint8_t *packed, const float *scale, float *out, int64_t k)
{
#pragma omp parallel for if (num_tokens * k > PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t id = ids[t], c = id % LINEAR_NR;
        float *o = out + t * k;
        if (fmt == QUANT_BF16) {
            inflight_bf16_row(packed, k, id, o);
            continue;
        }
        if (fmt == QUANT_W8A8) {
            inflight_w8a8_row(packed, scale, k, id, o);
            continue;
        }
        const uint8_t *panel = packed + id / LINEAR_NR * panel_bytes_of(fmt, k);
        if (fmt == QUANT_INT8) {
            for (int64_t kk = 0; kk < k; kk++)
                o[kk] = (float)(int8_t)panel[kk * LINEAR_NR + c] * scale[id];
            continue;
        }
        for (int64_t g = 0; g < k / QUANT_BLOCK; g++) {
            const uint8_t *group = panel + g * group_bytes((int)fmt);
            const uint8_t *q = group + header_bytes((int)fmt);
            uint16_t bits;
            memcpy(&bits, group + 2 * c, 2);
            const float d = half_to_float(bits);
            float m = d * -8.0f;
            if (fmt == QUANT_Q4_1) {
                memcpy(&bits, group + 2 * (LINEAR_NR + c), 2);
                m = half_to_float(bits);
            }
            for (int64_t kk = 0; kk < QUANT_BLOCK; kk++) {
                /* byte of column c % 8, k kk, in pair kk / 2 */
                const int64_t at = kk / 2 * pair_bytes((int)fmt) + 2 * (c % 8) + kk % 2;
                float w;
                if (fmt == QUANT_Q8_0) {
                    w = (float)(int8_t)q[at + (c < 8 ? 0 : 16)] * d;
                } else {
                    const uint8_t byte = q[at];
                    w = (float)(c < 8 ? byte & 15 : byte >> 4) * d + m;
                }
                o[g * QUANT_BLOCK + kk] = w;
            }
        }
    }
}
