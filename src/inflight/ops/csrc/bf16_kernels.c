/* Linear layers on bf16 weights: y[M, N] = x[M, K] . W[N, K]^T (+ bias), x and
 * y float32, W in panels of linear_kernel.h's WEIGHTS_BF16 layout (16 columns,
 * each pair of k side by side: 64 bytes a step).
 *
 * Two ways, by build:
 *  - widened (every build but INFLIGHT_AVX512_BF16): each weight widened to
 *    float32 (a 16-bit shift) and multiplied by float32 x with FMA, the float32
 *    kernel's arithmetic, bit for bit: a few rows (decode) widen in registers
 *    and read half the bytes (what a decode step is bound by); from
 *    BF16_SCRATCH_MIN_ROWS rows on each panel is widened once into a float32
 *    scratch panel in L2 and the float32 kernel runs over it (widened in
 *    registers, four more vector registers a step cost AVX2 its six-row tiles:
 *    half float32's speed at 64 rows);
 *  - dot products (INFLIGHT_AVX512_BF16): each row of x rounded to bf16 once
 *    per call, then vdpbf16ps adds each pair of k's two products into a
 *    float32 sum per column: one instruction for 16 columns x 2 k, twice the
 *    multiply-adds of a float32 FMA's.
 * Either way each row is computed the same whatever the batch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "linear_kernel.h"

#ifdef INFLIGHT_AVX512_BF16

/* Rows x panels of a tile, at most: as many float32 sums in flight (of 32
 * vector registers; the rest hold the step's weights and broadcast x). */
#define BF16_TILE 16
/* Panels a unit of work takes from BF16_ONE_PANEL_ROWS rows on, in tiles of
 * three or four rows: each step's four weight vectors serve up to four rows
 * (eight loads for sixteen dot products, against nine for eight with one panel
 * of eight rows). */
#define BF16_WIDE_PANELS 4
#define BF16_WIDE_ROWS 4
/* Rows of a one-panel tile, at most: the most rows of any tile. */
#define BF16_NARROW_ROWS 8
/* Fewer rows than this take units of one panel, all rows in one tile: each
 * thread reads its panels once, one after another, as a single stream. Units
 * of four panels read four streams at once and, from five rows on (two
 * tiles), each panel twice. On Zen 4, with the weights on 2 MiB pages, one to
 * seven rows ran up to a quarter faster in units of one panel (four rows
 * level), eight rows level (docs/benchmarks.md, "CPU: a few rows' products
 * one panel at a time"). */
#define BF16_ONE_PANEL_ROWS 8
_Static_assert(BF16_ONE_PANEL_ROWS - 1 <= BF16_NARROW_ROWS, "one tile holds a unit's rows");
/* From six rows on, ceil(m / 4) tiles of near-equal rows have three or four. */
_Static_assert(BF16_ONE_PANEL_ROWS >= 6 && BF16_WIDE_ROWS == 4, "wide tiles of 3 or 4 rows");

/* `rows` rows of bf16 pairs (xb, `pairs` per row) against `panels` adjacent
 * panels from column col, read once; every `spacing`-th step also prefetches
 * the next line of each of `panels` panels from `prefetch` (or NULL). */
static inline __attribute__((always_inline)) void dot_tile(
    const uint32_t *xb, int64_t pairs, const uint8_t *panel, int64_t panel_bytes, int panels,
    const float *bias, float *y, int64_t n, int64_t col, int rows, const uint8_t *prefetch,
    int64_t spacing)
{
    v16f acc[BF16_TILE];  /* row r, panel p at r * panels + p */
    for (int i = 0; i < BF16_TILE; i++)
        acc[i] = (v16f){0};
    for (int64_t s = 0; s < pairs; s++) {
        prefetch_step(prefetch, panels, panel_bytes, s, spacing);
        for (int p = 0; p < panels; p++) {
            const v16i w = *(const v16i *)(panel + p * panel_bytes + s * LINEAR_STEP_BYTES);
            for (int r = 0; r < rows; r++)
                acc[r * panels + p] = dot_bf16_pairs(acc[r * panels + p], w,
                                                     (v16i){0} + (int32_t)xb[r * pairs + s]);
        }
    }
    for (int p = 0; p < panels; p++) {
        v8f out[BF16_NARROW_ROWS][2];
        for (int r = 0; r < rows; r++)
            memcpy(out[r], &acc[r * panels + p], sizeof out[r]);
        const int64_t c = col + p * LINEAR_NR;
        store_block(out, rows, NULL, bias, y, n, c, n - c < LINEAR_NR ? n - c : LINEAR_NR);
    }
}

/* All m rows against `count` adjacent panels: BF16_WIDE_PANELS panels (from
 * BF16_ONE_PANEL_ROWS rows on) in tiles of three or four rows, each of which
 * prefetches its share of the `next` unit's panels (or NULL: none); else
 * (units of one panel, the last panels of a matrix) per panel tiles of up to
 * BF16_NARROW_ROWS rows. */
static void dot_unit(const uint32_t *xb, int64_t pairs, int64_t m, const uint8_t *panel,
                     int64_t panel_bytes, int count, const float *bias, float *y, int64_t n,
                     int64_t col, const uint8_t *next)
{
    if (count == BF16_WIDE_PANELS) {
        const int64_t tiles = (m + BF16_WIDE_ROWS - 1) / BF16_WIDE_ROWS;
        const int64_t spacing = prefetch_spacing(tiles);
        int64_t row = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int rows = (int)(m / tiles + (t < m % tiles));
            const uint32_t *xr = xb + row * pairs;
            float *yr = y + row * n;
            const uint8_t *pf = prefetch_share(next, t, pairs, spacing);
#define WIDE_ROWS(r) dot_tile(xr, pairs, panel, panel_bytes, BF16_WIDE_PANELS, bias, yr, n, \
                              col, r, pf, spacing)
            if (rows == 4)
                WIDE_ROWS(4);
            else
                WIDE_ROWS(3);
#undef WIDE_ROWS
            row += rows;
        }
        return;
    }
    const int64_t tiles = (m + BF16_NARROW_ROWS - 1) / BF16_NARROW_ROWS;
    for (int p = 0; p < count; p++) {
        int64_t row = 0;
        for (int64_t t = 0; t < tiles; t++) {
            const int rows = (int)(m / tiles + (t < m % tiles));
            const uint32_t *xr = xb + row * pairs;
            const uint8_t *pp = panel + p * panel_bytes;
            float *yr = y + row * n;
            const int64_t c = col + p * LINEAR_NR;
#define DOT_ROWS(r) dot_tile(xr, pairs, pp, panel_bytes, 1, bias, yr, n, c, r, NULL, 1)
            switch (rows) {
            case 8: DOT_ROWS(8); break;
            case 7: DOT_ROWS(7); break;
            case 6: DOT_ROWS(6); break;
            case 5: DOT_ROWS(5); break;
            case 4: DOT_ROWS(4); break;
            case 3: DOT_ROWS(3); break;
            case 2: DOT_ROWS(2); break;
            default: DOT_ROWS(1); break;
            }
#undef DOT_ROWS
            row += rows;
        }
    }
}

int inflight_bf16_linear(const float *x, const uint8_t *packed, const float *bias, float *y,
                         int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR, pairs = (k + 1) / 2;
    const int64_t panel_bytes = pairs * LINEAR_STEP_BYTES;
    /* x as bf16 pairs, each row's (k, k + 1) in one 32-bit word, k odd: 0 last */
    uint32_t *xb = malloc((size_t)(m * pairs) * sizeof(uint32_t));
    if (xb == NULL)
        return -1;
#pragma omp parallel for if (m * k > PARALLEL_MIN_WORK)
    for (int64_t r = 0; r < m; r++) {
        /* a pair's first element in its word's low half: the row as bf16 */
        uint16_t *row = (uint16_t *)(xb + r * pairs);
        floats_to_bf16(x + r * k, row, k);
        if (k & 1)
            row[k] = 0;
    }
    /* Panels per unit of work. */
    const int64_t width = m < BF16_ONE_PANEL_ROWS ? 1 : BF16_WIDE_PANELS;
    const int64_t units = (panels + width - 1) / width;
#pragma omp parallel for schedule(static) if (m * n * k > PARALLEL_MIN_WORK)
    for (int64_t u = 0; u < units; u++) {
        const int64_t first = u * width;
        const int count = (int)(panels - first < width ? panels - first : width);
        dot_unit(xb, pairs, m, packed + first * panel_bytes, panel_bytes, count, bias, y, n,
                 first * LINEAR_NR,
                 u + 1 < units ? packed + (first + width) * panel_bytes : NULL);
    }
    free(xb);
    return 0;
}

#else

#define BF16_SCRATCH_MIN_ROWS 16

/* A bf16 panel as float32 [K][16] (the float32 kernel's layout). */
static void widen_panel(const uint8_t *panel, int64_t k, float *wide)
{
    for (int64_t s = 0; s < k / 2; s++) {
        const v8u lo = *(const v8u *)(panel + s * LINEAR_STEP_BYTES);
        const v8u hi = *(const v8u *)(panel + s * LINEAR_STEP_BYTES + 32);
        float *w = wide + 2 * s * LINEAR_NR;
        *(v8f *)w = (v8f)(lo << 16);
        *(v8f *)(w + 8) = (v8f)(hi << 16);
        *(v8f *)(w + LINEAR_NR) = (v8f)(lo & 0xffff0000u);
        *(v8f *)(w + LINEAR_NR + 8) = (v8f)(hi & 0xffff0000u);
    }
    if (k & 1) {
        const uint8_t *last = panel + k / 2 * LINEAR_STEP_BYTES;
        *(v8f *)(wide + (k - 1) * LINEAR_NR) = (v8f)(*(const v8u *)last << 16);
        *(v8f *)(wide + (k - 1) * LINEAR_NR + 8) = (v8f)(*(const v8u *)(last + 32) << 16);
    }
}

int inflight_bf16_linear(const float *x, const uint8_t *packed, const float *bias, float *y,
                         int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR;
    const int64_t panel_bytes = panel_size(WEIGHTS_BF16, k);
    const int scratch = m >= BF16_SCRATCH_MIN_ROWS;
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
        for (int64_t p = 0; p < panels; p++) {
            const int64_t col = p * LINEAR_NR, cols = n - col < LINEAR_NR ? n - col : LINEAR_NR;
            const uint8_t *panel = packed + p * panel_bytes;
            if (!scratch) {
                linear_panel(x, m, k, panel, WEIGHTS_BF16, NULL, bias, y, n, col, cols,
                             p + 1 < panels ? panel + panel_bytes : NULL);
            } else if (wide != NULL) {
                widen_panel(panel, k, wide);
                linear_panel(x, m, k, wide, WEIGHTS_F32, NULL, bias, y, n, col, cols, NULL);
            }
        }
        free(wide);
    }
    return failed ? -1 : 0;
}

#endif

/* Row `id` of W (column id of the panels) as floats: an embedding lookup. */
void inflight_bf16_row(const uint8_t *packed, int64_t k, int64_t id, float *out)
{
    const uint16_t *panel = (const uint16_t *)(packed + id / LINEAR_NR *
                                               panel_size(WEIGHTS_BF16, k));
    const int64_t c = id % LINEAR_NR;
    for (int64_t kk = 0; kk < k; kk++)
        out[kk] = bf16_to_float(panel[kk / 2 * 2 * LINEAR_NR + 2 * c + kk % 2]);
}
