/* Linear layers and embedding lookups on weight-quantized matrices, computed
 * in float32 from the quantized values without a float32 copy of the weights.
 *
 * Formats (QUANT_* below): int8 with one float32 scale per output column, and
 * three GGUF block formats over blocks of 32 weights along K, each block with
 * a float16 scale d (and for Q4_1 a float16 minimum m):
 *   Q8_0: w = d * q,        q int8
 *   Q4_0: w = d * (q - 8),  q in 0..15
 *   Q4_1: w = d * q + m,    q in 0..15
 *
 * Weights are repacked at load (not dequantized) into panels of LINEAR_NR = 16
 * output columns, like the float32 path's: int8 panels are [K][16] int8. A
 * GGUF panel is a run of groups, one per block of 32 k: the 16 columns' d
 * (float16), for Q4_1 their 16 m, then the quants: Q8_0 [32][16] int8; Q4_0
 * and Q4_1 [32][8] bytes, byte j holding column j in its low nibble and column
 * j + 8 in its high one.
 *
 * Each k's 16 quants are widened to two float vectors in registers and
 * multiplied by x unscaled; the scales apply to sums. int8: y = scale *
 * sum_k x q. GGUF: per block, t = sum_k x q over its 32 k, then y += d * t +
 * m * sum_k x (m: Q4_1's minimum, -8 d for Q4_0, none for Q8_0), which leaves
 * two multiply-adds per k instead of four.
 *
 * Few rows (decode) read the panel once, in tiles of rows x panels that keep
 * enough independent sums in flight; many rows (prompt chunks) widen each
 * panel once into a float32 scratch panel and run a register-blocked kernel
 * over it. Both compute each output in the same order, so results do not
 * depend on the path or the batch.
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

enum { QUANT_INT8 = 0, QUANT_Q8_0 = 1, QUANT_Q4_0 = 2, QUANT_Q4_1 = 3 };

#define QUANT_BLOCK 32
/* From this many rows on, widen each panel once into scratch. */
#define QUANT_SCRATCH_MIN_ROWS 8

typedef int32_t v8i __attribute__((vector_size(32), aligned(4), may_alias));

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

/* ---- panel layout ---- */

static inline int64_t header_bytes(int fmt)
{
    return fmt == QUANT_Q4_1 ? 4 * LINEAR_NR : 2 * LINEAR_NR;
}

static inline int64_t group_bytes(int fmt)
{
    return header_bytes(fmt) + QUANT_BLOCK * (fmt == QUANT_Q8_0 ? LINEAR_NR : LINEAR_NR / 2);
}

static inline int64_t panel_bytes_of(int64_t fmt, int64_t k)
{
    return fmt == QUANT_INT8 ? k * LINEAR_NR : k / QUANT_BLOCK * group_bytes((int)fmt);
}

/* A group's scales for the panel's 16 columns (d0/m0 columns 0-7, d1/m1 8-15);
 * m multiplies the block's sum of x (Q4_0: -8 d, exactly; Q8_0: unused). */
typedef struct { v8f d0, d1, m0, m1; } group_scales;

static inline __attribute__((always_inline)) group_scales load_scales(int fmt, const uint8_t *g)
{
    group_scales s;
    s.d0 = halves_to_float(g);
    s.d1 = halves_to_float(g + 16);
    if (fmt == QUANT_Q4_1) {
        s.m0 = halves_to_float(g + 32);
        s.m1 = halves_to_float(g + 48);
    } else {
        s.m0 = s.d0 * -8.0f;
        s.m1 = s.d1 * -8.0f;
    }
    return s;
}

/* The 16 quants of row kk (of a group's quants, or of an int8 panel) as floats. */
static inline __attribute__((always_inline)) void widen_quants(
    int fmt, const uint8_t *q, int64_t kk, v8f *w0, v8f *w1)
{
    if (fmt == QUANT_INT8 || fmt == QUANT_Q8_0) {
        *w0 = to_float(widen_bytes(q + kk * LINEAR_NR, 1));
        *w1 = to_float(widen_bytes(q + kk * LINEAR_NR + 8, 1));
    } else {
        const v8i v = widen_bytes(q + kk * (LINEAR_NR / 2), 0);
        *w0 = to_float(v & 15);
        *w1 = to_float(v >> 4);
    }
}

/* acc += d * t (+ m * xsum): a block's sums into an output row's. */
static inline __attribute__((always_inline)) void add_block(
    int fmt, v8f acc[2], const v8f t[2], const group_scales *s, float xsum)
{
    acc[0] += t[0] * s->d0;
    acc[1] += t[1] * s->d1;
    if (fmt != QUANT_Q8_0) {
        acc[0] += s->m0 * xsum;
        acc[1] += s->m1 * xsum;
    }
}

/* ---- direct path: a tile of rows x panels, read once ---- */

#define INT8_TILE 4  /* rows x panels of a tile, at most */

/* A tile's outputs (row r, panel p at acc[r * panels + p]) into y. */
static inline __attribute__((always_inline)) void store_tile(
    v8f acc[][2], int rows, int panels, const float *scale, const float *bias, float *y,
    int64_t n, int64_t col)
{
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

/* int8: `rows` rows against `panels` adjacent panels (rows * panels <= 4). */
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
            widen_quants(QUANT_INT8, panel + p * panel_bytes, kk, &w0, &w1);
            for (int r = 0; r < rows; r++) {
                const float xv = x[r * k + kk];
                acc[r * panels + p][0] += xv * w0;
                acc[r * panels + p][1] += xv * w1;
            }
        }
    }
    store_tile(acc, rows, panels, scale, bias, y, n, col);
}

/* GGUF: `rows` rows against `panels` adjacent panels (rows * panels <= 3);
 * xsum[r * groups + g]: row r's sum of x over block g. */
#define GGUF_TILE 3

static inline __attribute__((always_inline)) void gguf_tile(
    int fmt, const float *x, int64_t k, const float *xsum, const uint8_t *panel,
    int64_t panel_bytes, int panels, const float *bias, float *y, int64_t n, int64_t col,
    int rows)
{
    const int64_t groups = k / QUANT_BLOCK, stride = group_bytes(fmt);
    v8f acc[GGUF_TILE][2];  /* row r, panel p at r * panels + p */
    for (int i = 0; i < GGUF_TILE; i++)
        acc[i][0] = acc[i][1] = (v8f){0};
    for (int64_t g = 0; g < groups; g++) {
        v8f t[GGUF_TILE][2];
        for (int i = 0; i < GGUF_TILE; i++)
            t[i][0] = t[i][1] = (v8f){0};
        const float *xg = x + g * QUANT_BLOCK;
        for (int64_t kk = 0; kk < QUANT_BLOCK; kk++) {
            for (int p = 0; p < panels; p++) {
                v8f w0, w1;
                widen_quants(fmt, panel + p * panel_bytes + g * stride + header_bytes(fmt), kk,
                             &w0, &w1);
                for (int r = 0; r < rows; r++) {
                    const float xv = xg[r * k + kk];
                    t[r * panels + p][0] += xv * w0;
                    t[r * panels + p][1] += xv * w1;
                }
            }
        }
        for (int p = 0; p < panels; p++) {
            const group_scales s = load_scales(fmt, panel + p * panel_bytes + g * stride);
            for (int r = 0; r < rows; r++)
                add_block(fmt, acc[r * panels + p], t[r * panels + p], &s,
                          xsum[r * groups + g]);
        }
    }
    store_tile(acc, rows, panels, NULL, bias, y, n, col);
}

/* ---- scratch path: a panel's quants widened once to float32 [K][16] ---- */

static inline __attribute__((always_inline)) void widen_panel(
    int fmt, const uint8_t *panel, int64_t k, float *out)
{
    if (fmt == QUANT_INT8) {
        for (int64_t kk = 0; kk < k; kk++)
            widen_quants(fmt, panel, kk, (v8f *)(out + kk * LINEAR_NR),
                         (v8f *)(out + kk * LINEAR_NR + 8));
        return;
    }
    const int64_t stride = group_bytes(fmt);
    for (int64_t g = 0; g < k / QUANT_BLOCK; g++) {
        const uint8_t *q = panel + g * stride + header_bytes(fmt);
        float *o = out + g * QUANT_BLOCK * LINEAR_NR;
        for (int64_t kk = 0; kk < QUANT_BLOCK; kk++)
            widen_quants(fmt, q, kk, (v8f *)(o + kk * LINEAR_NR), (v8f *)(o + kk * LINEAR_NR + 8));
    }
}

/* GGUF rows against a widened panel: gguf_tile's arithmetic, quants from
 * `wide`, up to GGUF_TILE rows at a time. */
static inline __attribute__((always_inline)) void gguf_wide_block(
    int fmt, const float *x, int64_t k, const float *xsum, const float *wide,
    const uint8_t *panel, const float *bias, float *y, int64_t n, int64_t col, int64_t cols,
    int rows)
{
    const int64_t groups = k / QUANT_BLOCK, stride = group_bytes(fmt);
    v8f acc[GGUF_TILE][2];
    for (int i = 0; i < GGUF_TILE; i++)
        acc[i][0] = acc[i][1] = (v8f){0};
    for (int64_t g = 0; g < groups; g++) {
        v8f t[GGUF_TILE][2];
        for (int i = 0; i < GGUF_TILE; i++)
            t[i][0] = t[i][1] = (v8f){0};
        const float *xg = x + g * QUANT_BLOCK;
        const float *wg = wide + g * QUANT_BLOCK * LINEAR_NR;
        for (int64_t kk = 0; kk < QUANT_BLOCK; kk++) {
            const v8f w0 = *(const v8f *)(wg + kk * LINEAR_NR);
            const v8f w1 = *(const v8f *)(wg + kk * LINEAR_NR + 8);
            for (int r = 0; r < rows; r++) {
                const float xv = xg[r * k + kk];
                t[r][0] += xv * w0;
                t[r][1] += xv * w1;
            }
        }
        const group_scales s = load_scales(fmt, panel + g * stride);
        for (int r = 0; r < rows; r++)
            add_block(fmt, acc[r], t[r], &s, xsum[r * groups + g]);
    }
    store_block(acc, rows, NULL, bias, y, n, col, cols);
}

/* One unit of work: `count` adjacent panels from column col on the direct
 * path, or one panel through the scratch panel `wide`. */
static inline __attribute__((always_inline)) void quant_unit(
    int fmt, const float *x, const float *xsum, int64_t m, int64_t k, const uint8_t *panel,
    int64_t panel_bytes, int count, const float *scale, const float *bias, float *y, int64_t n,
    int64_t col, float *wide)
{
    const int64_t groups = k / QUANT_BLOCK;
    if (wide != NULL) {
        widen_panel(fmt, panel, k, wide);
        const int64_t cols = n - col < LINEAR_NR ? n - col : LINEAR_NR;
        if (fmt == QUANT_INT8) {
            linear_panel(x, m, k, wide, scale, bias, y, n, col, cols);
            return;
        }
        int64_t row = 0;
        for (; row + GGUF_TILE <= m; row += GGUF_TILE)
            gguf_wide_block(fmt, x + row * k, k, xsum + row * groups, wide, panel, bias,
                            y + row * n, n, col, cols, GGUF_TILE);
        const float *xr = x + row * k, *sr = xsum + row * groups;
        float *yr = y + row * n;
        switch (m - row) {  /* constant row counts, so each tail is unrolled too */
        case 2: gguf_wide_block(fmt, xr, k, sr, wide, panel, bias, yr, n, col, cols, 2); break;
        case 1: gguf_wide_block(fmt, xr, k, sr, wide, panel, bias, yr, n, col, cols, 1); break;
        default: break;
        }
        return;
    }
    if (fmt == QUANT_INT8) {
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
            switch (m - row) {
            case 3: int8_tile(xr, k, pp, panel_bytes, 1, scale, bias, yr, n, c, 3); break;
            case 2: int8_tile(xr, k, pp, panel_bytes, 1, scale, bias, yr, n, c, 2); break;
            case 1: int8_tile(xr, k, pp, panel_bytes, 1, scale, bias, yr, n, c, 1); break;
            default: break;
            }
        }
        return;
    }
    if (m == 1 && count == 2) {
        gguf_tile(fmt, x, k, xsum, panel, panel_bytes, 2, bias, y, n, col, 1);
        return;
    }
    for (int p = 0; p < count; p++) {
        const uint8_t *pp = panel + p * panel_bytes;
        const int64_t c = col + p * LINEAR_NR;
        int64_t row = 0;
        for (; row + GGUF_TILE <= m; row += GGUF_TILE)
            gguf_tile(fmt, x + row * k, k, xsum + row * groups, pp, panel_bytes, 1, bias,
                      y + row * n, n, c, GGUF_TILE);
        const float *xr = x + row * k, *sr = xsum + row * groups;
        float *yr = y + row * n;
        switch (m - row) {
        case 2: gguf_tile(fmt, xr, k, sr, pp, panel_bytes, 1, bias, yr, n, c, 2); break;
        case 1: gguf_tile(fmt, xr, k, sr, pp, panel_bytes, 1, bias, yr, n, c, 1); break;
        default: break;
        }
    }
}

/* y[M, N] = x[M, K] . W^T (+ bias) for W packed as described above (scale: the
 * int8 column scales, padded to whole panels). Returns -1 if scratch memory
 * ran out. */
int inflight_quant_linear(int64_t fmt, const float *x, const uint8_t *packed, const float *scale,
                          const float *bias, float *y, int64_t m, int64_t n, int64_t k)
{
    if (fmt < QUANT_INT8 || fmt > QUANT_Q4_1)
        return -2;
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR;
    const int64_t panel_bytes = panel_bytes_of(fmt, k);
    const int scratch = m >= QUANT_SCRATCH_MIN_ROWS;
    /* Panels per unit of work: a decode tile's, or one. */
    const int64_t width = scratch ? 1 : m == 1 ? (fmt == QUANT_INT8 ? 4 : 2)
                                      : m == 2 && fmt == QUANT_INT8 ? 2 : 1;
    const int64_t units = (panels + width - 1) / width;
    /* Each row's sum of x over each block (GGUF), in one fixed order. */
    const int64_t groups = k / QUANT_BLOCK;
    float *xsum = NULL;
    if (fmt != QUANT_INT8) {
        xsum = malloc((size_t)(m * groups) * sizeof(float));
        if (xsum == NULL)
            return -1;
        for (int64_t r = 0; r < m; r++)
            for (int64_t g = 0; g < groups; g++) {
                float sum = 0.0f;
                for (int64_t kk = 0; kk < QUANT_BLOCK; kk++)
                    sum += x[r * k + g * QUANT_BLOCK + kk];
                xsum[r * groups + g] = sum;
            }
    }
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
            const uint8_t *panel = packed + first * panel_bytes;
            const int count = (int)(panels - first < width ? panels - first : width);
            const int64_t col = first * LINEAR_NR;
            /* A constant format in each case, so that each inner loop is
             * specialised (OpenMP outlines this region before inlining). */
            switch (fmt) {
            case QUANT_INT8:
                quant_unit(QUANT_INT8, x, xsum, m, k, panel, panel_bytes, count, scale, bias, y,
                           n, col, wide);
                break;
            case QUANT_Q8_0:
                quant_unit(QUANT_Q8_0, x, xsum, m, k, panel, panel_bytes, count, scale, bias, y,
                           n, col, wide);
                break;
            case QUANT_Q4_0:
                quant_unit(QUANT_Q4_0, x, xsum, m, k, panel, panel_bytes, count, scale, bias, y,
                           n, col, wide);
                break;
            default:
                quant_unit(QUANT_Q4_1, x, xsum, m, k, panel, panel_bytes, count, scale, bias, y,
                           n, col, wide);
                break;
            }
        }
        free(wide);
    }
    free(xsum);
    return failed ? -1 : 0;
}

/* out[t, :] = row ids[t] of W (an embedding table stored as the panels of the
 * output layer it is tied to), each weight as the linear kernels compute it
 * (int8 times its column's scale). */
void inflight_quant_embedding(int64_t fmt, const int64_t *ids, int64_t num_tokens,
                              const uint8_t *packed, const float *scale, float *out, int64_t k)
{
    const int64_t panel_bytes = panel_bytes_of(fmt, k);
#pragma omp parallel for if (num_tokens * k > PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t id = ids[t], c = id % LINEAR_NR;
        const uint8_t *panel = packed + id / LINEAR_NR * panel_bytes;
        float *o = out + t * k;
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
                float w;
                if (fmt == QUANT_Q8_0) {
                    w = (float)(int8_t)q[kk * LINEAR_NR + c] * d;
                } else {
                    const uint8_t byte = q[kk * (LINEAR_NR / 2) + c % 8];
                    w = (float)(c < 8 ? byte & 15 : byte >> 4) * d + m;
                }
                o[g * QUANT_BLOCK + kk] = w;
            }
        }
    }
}
