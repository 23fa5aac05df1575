/* W8A8 linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias) with int8 weights
 * and int8 activations multiplied as integers.
 *
 * Weights: symmetric int8 per output column (w = scale[n] q, q in -127..127),
 * in panels of 16 columns, [Kp / 4][16][4]: each column's 4 consecutive k side
 * by side (64 bytes a step, the layout of vpdpbusd), Kp = K rounded up to 32,
 * zero-padded.
 * Activations: each row quantized when the layer runs, per block of 32 k (x =
 * dx a, dx = max |x| / 127, a in -127..127): one scale for a whole row lost
 * 3 % of the default model's perplexity, one per block of 32 under 1 %.
 * A block's 32 products of a row and a column add up exactly in int32, t;
 * then y = scale[n] (sum over blocks of dx t, in order, by FMA) + bias. So every
 * build with FMA (x86-64-v3 and up) gives the same bits, whichever
 * instructions summed the t:
 *  - AVX2: vpmaddubsw multiplies unsigned by signed bytes: |a| against the
 *    weights with a's sign moved onto them (vpsignb, zero where a is), pairs
 *    summed in int16 (at most 2 x 127 x 127 = 32258: no saturation), and
 *    vpmaddwd by ones sums each column's four in int32;
 *  - VNNI (INFLIGHT_AVX512_VNNI): vpdpbusd multiplies unsigned by signed bytes
 *    and adds each column's four into int32 directly: the weights are the
 *    unsigned side, offset by 128 (their sign bit flipped), and 128 times the
 *    block's sum of a comes off t;
 *  - generic: the same sums in plain C.
 * Each row is computed the same whatever the batch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "linear_kernel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define A8_BLOCK 32
#define A8_STEPS (A8_BLOCK / 4)              /* 64-byte steps per block */
#define A8_BLOCK_BYTES (A8_STEPS * LINEAR_STEP_BYTES)

/* Each row of x quantized per block: a (Kp per row) and, per block, dx, and
 * for the AVX2 kernel |a|, for the VNNI kernel 128 x sum(a). */
typedef struct {
    int8_t *a;
    uint8_t *abs_a;
    float *dx;
    int32_t *offset;
} a8_rows;

/* One block of 32 (zero-padded) to a = round(x 127 / max |x|); returns dx.
 * A NaN counts as 0 in the maximum. AVX-512 builds keep the block in two
 * registers (8 ns a block on Zen 4, against 26 for the loops, which took a
 * tenth of a W8A8 layer's time at 64 rows); the others use straight loops over
 * the block, so that they vectorise. Both give the same bytes. */
#if defined(__AVX512F__)
static inline float quantize_block(const float *xb, int8_t *a, uint8_t *abs_a, int32_t *sum)
{
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 zero = _mm512_setzero_ps();
    /* vmaxps gives its second operand where either is NaN. */
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(
        _mm512_max_ps(_mm512_abs_ps(x0), zero), _mm512_max_ps(_mm512_abs_ps(x1), zero)));
    const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    /* vcvtps2dq rounds to nearest even, as nearbyintf does. */
    const __m512i q0 = _mm512_min_epi32(_mm512_max_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), lo), hi);
    const __m512i q1 = _mm512_min_epi32(_mm512_max_epi32(
        _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)), lo), hi);
    _mm_storeu_si128((__m128i *)a, _mm512_cvtepi32_epi8(q0));
    _mm_storeu_si128((__m128i *)(a + 16), _mm512_cvtepi32_epi8(q1));
    if (abs_a) {
        _mm_storeu_si128((__m128i *)abs_a, _mm512_cvtepi32_epi8(_mm512_abs_epi32(q0)));
        _mm_storeu_si128((__m128i *)(abs_a + 16), _mm512_cvtepi32_epi8(_mm512_abs_epi32(q1)));
    }
    *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    return amax / 127.0f;
}
#else
static inline float quantize_block(const float *xb, int8_t *a, uint8_t *abs_a, int32_t *sum)
{
    float amax = 0.0f;
#pragma omp simd reduction(max:amax)
    for (int j = 0; j < A8_BLOCK; j++)
        amax = __builtin_fabsf(xb[j]) > amax ? __builtin_fabsf(xb[j]) : amax;
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    int32_t total = 0;
#pragma omp simd reduction(+:total)
    for (int j = 0; j < A8_BLOCK; j++) {
        float v = __builtin_nearbyintf(xb[j] * inv);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        a[j] = (int8_t)v;
        total += (int32_t)v;
    }
    if (abs_a) {
#pragma omp simd
        for (int j = 0; j < A8_BLOCK; j++)
            abs_a[j] = (uint8_t)(a[j] < 0 ? -a[j] : a[j]);
    }
    *sum = total;
    return amax / 127.0f;
}
#endif

static void quantize_rows(const float *x, int64_t m, int64_t k, int64_t kp, a8_rows *q)
{
    const int64_t blocks = kp / A8_BLOCK;
#pragma omp parallel for if (m * k > PARALLEL_MIN_WORK)
    for (int64_t i = 0; i < m * blocks; i++) {
        const int64_t r = i / blocks, start = i % blocks * A8_BLOCK;
        const float *xb = x + r * k + start;
        float tail[A8_BLOCK];
        if (k - start < A8_BLOCK) {  /* the last, partial block */
            memset(tail, 0, sizeof tail);
            memcpy(tail, xb, (size_t)(k - start) * sizeof(float));
            xb = tail;
        }
        int32_t sum;
        q->dx[i] = quantize_block(xb, q->a + r * kp + start,
                                  q->abs_a ? q->abs_a + r * kp + start : NULL, &sum);
        if (q->offset)
            q->offset[i] = 128 * sum;
    }
}

static inline int32_t quad(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if defined(INFLIGHT_AVX512_VNNI)

#define A8_TILE 12  /* rows x panels of a tile, at most */
/* Panels a unit of work takes from A8_ONE_PANEL_ROWS rows on, in tiles of
 * three or four rows: each step's three weight vectors serve four rows,
 * twelve dot products a step against eight with two panels, over which the
 * step's loads and loop work spread (two panels ran 3-7 % slower on Zen 4 at
 * 8-64 rows). On Zen 4 a broadcast from memory takes a load port only
 * (vpdpbusd kept its one a cycle with one beside each); what shares its pipes
 * is each block's conversion and FMA of the sums, about a tenth of a block's
 * time (12 FMAs beside 96 vpdpbusd). */
#define A8_WIDE_PANELS 3
#define A8_WIDE_ROWS 4
/* Rows of a one-panel tile, at most. */
#define A8_NARROW_ROWS 8
/* Fewer rows than this take units of one panel, all rows in one tile (as
 * BF16_ONE_PANEL_ROWS in bf16_kernels.c): on Zen 4 one to seven rows ran
 * 5-30 % faster in units of one panel, eight rows a fifth slower
 * (docs/benchmarks.md, "CPU: a few rows' products one panel at a time"). */
#define A8_ONE_PANEL_ROWS 8
_Static_assert(A8_ONE_PANEL_ROWS - 1 <= A8_NARROW_ROWS, "one tile holds a unit's rows");
/* From six rows on, ceil(m / 4) tiles of near-equal rows have three or four. */
_Static_assert(A8_ONE_PANEL_ROWS >= 6 && A8_WIDE_ROWS == 4, "wide tiles of 3 or 4 rows");

/* `rows` rows from row0 against `panels` adjacent panels from column col,
 * read once; every `spacing`-th 64-byte step also prefetches the next line of
 * each of `panels` panels from `prefetch` (or NULL). */
static inline __attribute__((always_inline)) void a8_tile(
    const a8_rows *q, int64_t row0, int64_t kp, const uint8_t *panel, int64_t panel_bytes,
    int panels, const float *scale, const float *bias, float *y, int64_t n, int64_t col,
    int rows, const uint8_t *prefetch, int64_t spacing)
{
    const int64_t blocks = kp / A8_BLOCK;
    v16f acc[A8_TILE];  /* row r, panel p at r * panels + p */
    for (int i = 0; i < A8_TILE; i++)
        acc[i] = (v16f){0};
    for (int64_t b = 0; b < blocks; b++) {
        /* Each sum starts at -128 x the block's sum of a (the weights' offset):
         * the same integers as subtracting it after, one instruction fewer. */
        v16i t[A8_TILE];
        for (int r = 0; r < rows; r++)
            for (int p = 0; p < panels; p++)
                t[r * panels + p] = (v16i){0} - q->offset[(row0 + r) * blocks + b];
        const uint8_t *wb = panel + b * A8_BLOCK_BYTES;
        const int8_t *ab = q->a + row0 * kp + b * A8_BLOCK;
#pragma GCC unroll 8
        for (int j = 0; j < A8_STEPS; j++) {
            prefetch_step(prefetch, panels, panel_bytes, b * A8_STEPS + j, spacing);
            for (int p = 0; p < panels; p++) {
                const v16i w = *(const v16i *)(wb + p * panel_bytes + j * LINEAR_STEP_BYTES)
                               ^ (int32_t)0x80808080;
                for (int r = 0; r < rows; r++) {
                    const int32_t a = quad(ab + r * kp + 4 * j);
                    t[r * panels + p] = dot_u8s8_quads(t[r * panels + p], w, (v16i){0} + a);
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            const float dx = q->dx[(row0 + r) * blocks + b];
            for (int p = 0; p < panels; p++)
                acc[r * panels + p] += dx * __builtin_convertvector(t[r * panels + p], v16f);
        }
    }
    for (int p = 0; p < panels; p++) {
        v8f out[A8_TILE][2];
        for (int r = 0; r < rows; r++)
            memcpy(out[r], &acc[r * panels + p], sizeof out[r]);
        const int64_t c = col + p * LINEAR_NR;
        store_block(out, rows, scale, bias, y + row0 * n, n, c,
                    n - c < LINEAR_NR ? n - c : LINEAR_NR);
    }
}

/* All m rows against `count` adjacent panels: A8_WIDE_PANELS panels (from
 * A8_ONE_PANEL_ROWS rows on) in tiles of three or four rows, each of which
 * prefetches its share of the `next` unit's panels (or NULL: none); else
 * (units of one panel, a matrix's last panels) tiles of up to A8_NARROW_ROWS
 * rows. */
static void a8_unit(const a8_rows *q, int64_t m, int64_t kp, const uint8_t *panel,
                    int64_t panel_bytes, int count, const float *scale, const float *bias,
                    float *y, int64_t n, int64_t col, const uint8_t *next)
{
    if (count == A8_WIDE_PANELS) {
        const int64_t tiles = (m + A8_WIDE_ROWS - 1) / A8_WIDE_ROWS;
        const int64_t steps = kp / 4, spacing = prefetch_spacing(tiles);
        int64_t row = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int rows = (int)(m / tiles + (t < m % tiles));
            const uint8_t *pf = prefetch_share(next, t, steps, spacing);
            /* The next tile's output lines, asked for ahead: a prompt's
             * thousands of rows store into lines that no cache holds, and
             * waiting for them had cost a tenth of the layer. */
            for (int64_t r = row + rows; r < row + 2 * rows && r < m; r++)
                for (int p = 0; p < A8_WIDE_PANELS; p++)
                    __builtin_prefetch(y + r * n + col + p * LINEAR_NR, 1, 3);
#define A8_WIDE(r) a8_tile(q, row, kp, panel, panel_bytes, A8_WIDE_PANELS, scale, bias, y, \
                           n, col, r, pf, spacing)
            if (rows == 4)
                A8_WIDE(4);
            else
                A8_WIDE(3);
#undef A8_WIDE
            row += rows;
        }
        return;
    }
    const int64_t tiles = (m + A8_NARROW_ROWS - 1) / A8_NARROW_ROWS;
    for (int p = 0; p < count; p++) {
        int64_t row = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int rows = (int)(m / tiles + (t < m % tiles));
            const uint8_t *pp = panel + p * panel_bytes;
            const int64_t c = col + p * LINEAR_NR;
#define A8_ROWS(r) a8_tile(q, row, kp, pp, panel_bytes, 1, scale, bias, y, n, c, r, NULL, 1)
            switch (rows) {
            case 8: A8_ROWS(8); break;
            case 7: A8_ROWS(7); break;
            case 6: A8_ROWS(6); break;
            case 5: A8_ROWS(5); break;
            case 4: A8_ROWS(4); break;
            case 3: A8_ROWS(3); break;
            case 2: A8_ROWS(2); break;
            default: A8_ROWS(1); break;
            }
#undef A8_ROWS
            row += rows;
        }
    }
}

#elif defined(__AVX2__)

#define A8_MR 4
/* Blocks ahead of use that a tile asks the memory for (as the GGUF kernels). */
#define A8_PREFETCH_BLOCKS 4

static inline __attribute__((always_inline)) void a8_tile(
    const a8_rows *q, int64_t row0, int64_t kp, const uint8_t *panel, const float *scale,
    const float *bias, float *y, int64_t n, int64_t col, int64_t cols, int rows)
{
    const int64_t blocks = kp / A8_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1);
    v8f acc[A8_MR][2];
    for (int r = 0; r < A8_MR; r++)
        acc[r][0] = acc[r][1] = (v8f){0};
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = panel + b * A8_BLOCK_BYTES;
        for (int64_t off = 0; off < A8_BLOCK_BYTES; off += 64)
            __builtin_prefetch(block + A8_PREFETCH_BLOCKS * A8_BLOCK_BYTES + off);
        __m256i t[A8_MR][2];
        for (int r = 0; r < A8_MR; r++)
            t[r][0] = t[r][1] = _mm256_setzero_si256();
        for (int j = 0; j < A8_STEPS; j++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(block + j * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(block + j * 64 + 32));
            for (int r = 0; r < rows; r++) {
                const int64_t at = (row0 + r) * kp + b * A8_BLOCK + 4 * j;
                const __m256i a = _mm256_set1_epi32(quad(q->a + at));
                const __m256i abs_a = _mm256_set1_epi32(quad(q->abs_a + at));
                t[r][0] = _mm256_add_epi32(t[r][0], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(abs_a, _mm256_sign_epi8(w0, a)), ones));
                t[r][1] = _mm256_add_epi32(t[r][1], _mm256_madd_epi16(
                    _mm256_maddubs_epi16(abs_a, _mm256_sign_epi8(w1, a)), ones));
            }
        }
        for (int r = 0; r < rows; r++) {
            const float dx = q->dx[(row0 + r) * blocks + b];
            acc[r][0] += dx * (v8f)_mm256_cvtepi32_ps(t[r][0]);
            acc[r][1] += dx * (v8f)_mm256_cvtepi32_ps(t[r][1]);
        }
    }
    store_block(acc, rows, scale, bias, y + row0 * n, n, col, cols);
}

#else

#define A8_MR 4

static inline void a8_tile(const a8_rows *q, int64_t row0, int64_t kp, const uint8_t *panel,
                           const float *scale, const float *bias, float *y, int64_t n,
                           int64_t col, int64_t cols, int rows)
{
    const int64_t blocks = kp / A8_BLOCK;
    v8f acc[A8_MR][2];
    for (int r = 0; r < rows; r++) {
        acc[r][0] = acc[r][1] = (v8f){0};
        for (int64_t b = 0; b < blocks; b++) {
            int32_t t[LINEAR_NR] = {0};
            const int8_t *a = q->a + (row0 + r) * kp + b * A8_BLOCK;
            for (int j = 0; j < A8_STEPS; j++) {
                const int8_t *w = (const int8_t *)panel + b * A8_BLOCK_BYTES +
                                  j * LINEAR_STEP_BYTES;
                for (int c = 0; c < LINEAR_NR; c++)
                    for (int i = 0; i < 4; i++)
                        t[c] += (int32_t)w[4 * c + i] * a[4 * j + i];
            }
            const float dx = q->dx[(row0 + r) * blocks + b];
            for (int c = 0; c < LINEAR_NR; c++)
                acc[r][c / 8][c % 8] += dx * (float)t[c];
        }
    }
    store_block(acc, rows, scale, bias, y + row0 * n, n, col, cols);
}

#endif

#ifndef INFLIGHT_AVX512_VNNI
_Static_assert(A8_MR == 4, "a8_panel's tail takes up to 3 rows");

/* All m rows against one panel: tiles of A8_MR rows, then the tail with a
 * constant row count. */
static void a8_panel(const a8_rows *q, int64_t m, int64_t kp, const uint8_t *panel,
                     const float *scale, const float *bias, float *y, int64_t n, int64_t col)
{
    const int64_t cols = n - col < LINEAR_NR ? n - col : LINEAR_NR;
    int64_t row = 0;
    for (; row + A8_MR <= m; row += A8_MR)
        a8_tile(q, row, kp, panel, scale, bias, y, n, col, cols, A8_MR);
    switch (m - row) {
    case 3: a8_tile(q, row, kp, panel, scale, bias, y, n, col, cols, 3); break;
    case 2: a8_tile(q, row, kp, panel, scale, bias, y, n, col, cols, 2); break;
    case 1: a8_tile(q, row, kp, panel, scale, bias, y, n, col, cols, 1); break;
    default: break;
    }
}
#endif

/* Kp: K rounded up to whole blocks. */
static inline int64_t padded_k(int64_t k)
{
    return (k + A8_BLOCK - 1) / A8_BLOCK * A8_BLOCK;
}

int64_t inflight_w8a8_panel_bytes(int64_t k)
{
    return padded_k(k) * LINEAR_NR;
}

int inflight_w8a8_linear(const float *x, const uint8_t *packed, const float *scale,
                         const float *bias, float *y, int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR, kp = padded_k(k);
    const int64_t blocks = kp / A8_BLOCK, panel_bytes = inflight_w8a8_panel_bytes(k);
#ifdef INFLIGHT_AVX512_VNNI
    const int abs_needed = 0, offset_needed = 1;
#elif defined(__AVX2__)
    const int abs_needed = 1, offset_needed = 0;
#else
    const int abs_needed = 0, offset_needed = 0;
#endif
    /* One allocation: a, |a|, dx, 128 sum(a). */
    const size_t row_bytes = (size_t)(m * kp);
    char *memory = malloc(row_bytes * (1 + abs_needed) + (size_t)(m * blocks) * 8);
    if (memory == NULL)
        return -1;
    a8_rows q = {.a = (int8_t *)memory,
                 .abs_a = abs_needed ? (uint8_t *)memory + row_bytes : NULL,
                 .dx = (float *)(memory + row_bytes * (1 + abs_needed)),
                 .offset = NULL};
    if (offset_needed)
        q.offset = (int32_t *)(q.dx + m * blocks);
    quantize_rows(x, m, k, kp, &q);
#ifdef INFLIGHT_AVX512_VNNI
    /* Panels per unit of work. */
    const int64_t width = m < A8_ONE_PANEL_ROWS ? 1 : A8_WIDE_PANELS;
    const int64_t units = (panels + width - 1) / width;
#pragma omp parallel for schedule(static) if (m * n * k > PARALLEL_MIN_WORK)
    for (int64_t u = 0; u < units; u++) {
        const int64_t first = u * width;
        const int count = (int)(panels - first < width ? panels - first : width);
        a8_unit(&q, m, kp, packed + first * panel_bytes, panel_bytes, count, scale, bias, y, n,
                first * LINEAR_NR,
                u + 1 < units ? packed + (first + width) * panel_bytes : NULL);
    }
#else
#pragma omp parallel for schedule(static) if (m * n * k > PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++)
        a8_panel(&q, m, kp, packed + p * panel_bytes, scale, bias, y, n, p * LINEAR_NR);
#endif
    free(memory);
    return 0;
}

/* Row `id` of W (column id of the panels) as floats: an embedding lookup. */
void inflight_w8a8_row(const uint8_t *packed, const float *scale, int64_t k, int64_t id,
                       float *out)
{
    const int8_t *panel = (const int8_t *)packed + id / LINEAR_NR * inflight_w8a8_panel_bytes(k);
    const int64_t c = id % LINEAR_NR;
    for (int64_t kk = 0; kk < k; kk++)
        out[kk] = (float)panel[kk / 4 * LINEAR_STEP_BYTES + 4 * c + kk % 4] * scale[id];
}
