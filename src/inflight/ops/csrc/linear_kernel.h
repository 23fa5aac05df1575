/* The register-blocked linear-layer microkernel shared by the float32, bf16
 * and weight-quantized kernels: y[M, N] = x[M, K] . W[N, K]^T (* scale) (+ bias).
 *
 * W comes in panels of LINEAR_NR output columns, in 64-byte steps:
 *   WEIGHTS_F32   one k per step: [K][16] floats;
 *   WEIGHTS_BF16  a pair of k per step: [ceil(K / 2)][16][2] bf16, each
 *                 column's (k, k + 1) side by side (the layout of vdpbf16ps,
 *                 csrc/bf16_kernels.c; K odd: a zero pads the last pair).
 * The microkernel keeps a LINEAR_MR x 16 block of y in twelve vector registers
 * and, for each k, broadcasts MR x values against the panel's two weight
 * vectors (bf16 widened to float32 in registers by a 16-bit shift: four
 * weight vectors a step, so at most LINEAR_MR_BF16 rows, whose sums and
 * weights fit AVX2's sixteen registers). Each output is summed over k in the
 * same order whatever M is, so a row's result does not depend on the rest of
 * the batch; and bf16 weights give the bits float32 weights of the same values
 * would.
 */
#ifndef INFLIGHT_LINEAR_KERNEL_H
#define INFLIGHT_LINEAR_KERNEL_H

#include <stdint.h>

#include "isa.h"

/* Parallelise only loops with at least this many elements of work. */
#define PARALLEL_MIN_WORK 32768

#define LINEAR_NR 16
#define LINEAR_MR 6
#define LINEAR_MR_BF16 4
/* Rows from which a panel's tiles prefetch the next panel (see linear_panel). */
#define LINEAR_PREFETCH_ROWS 4
#define LINEAR_STEP_BYTES 64

enum { WEIGHTS_F32, WEIGHTS_BF16 };

/* Whole 64-byte steps of a panel over k. */
static inline int64_t panel_steps(int wfmt, int64_t k)
{
    return wfmt == WEIGHTS_F32 ? k : (k + 1) / 2;
}

/* The bytes of a panel over k. */
static inline int64_t panel_size(int wfmt, int64_t k)
{
    return panel_steps(wfmt, k) * LINEAR_STEP_BYTES;
}

static inline float hsum8(v8f v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* Store `rows` rows of accumulated outputs for columns col..col+cols of y
 * (rows n floats apart): acc * scale + bias, either of them optional (NULL). */
static inline __attribute__((always_inline)) void store_block(
    v8f acc[][2], int rows, const float *scale, const float *bias, float *y, int64_t n,
    int64_t col, int64_t cols)
{
    for (int r = 0; r < rows; r++) {
        float *yr = y + r * n + col;
        if (cols == LINEAR_NR) {
            v8f a0 = acc[r][0], a1 = acc[r][1];
            if (scale) {
                a0 *= *(const v8f *)(scale + col);
                a1 *= *(const v8f *)(scale + col + 8);
            }
            if (bias) {
                a0 += *(const v8f *)(bias + col);
                a1 += *(const v8f *)(bias + col + 8);
            }
            *(v8f *)yr = a0;
            *(v8f *)(yr + 8) = a1;
        } else {
            for (int64_t j = 0; j < cols; j++) {
                float a = j < 8 ? acc[r][0][j] : acc[r][1][j - 8];
                if (scale)
                    a *= scale[col + j];
                yr[j] = a + (bias ? bias[col + j] : 0.0f);
            }
        }
    }
}

/* acc[r] += x[r][kk] * (w0, w1) for `rows` rows (x rows k floats apart). */
static inline __attribute__((always_inline)) void multiply_add_rows(
    v8f acc[][2], const float *x, int64_t k, int64_t kk, v8f w0, v8f w1, int rows)
{
    for (int r = 0; r < rows; r++) {
        const float xv = x[r * k + kk];
        acc[r][0] += xv * w0;
        acc[r][1] += xv * w1;
    }
}

/* Step s of a tile that prefetches: every `spacing`-th step (a power of two:
 * a shift, not a division, finds the line) asks for the next line of each of
 * `panels` panels (panel_bytes apart) from `prefetch`; none where it is NULL. */
static inline __attribute__((always_inline)) void prefetch_step(
    const void *prefetch, int panels, int64_t panel_bytes, int64_t s, int64_t spacing)
{
    if (prefetch && (s & (spacing - 1)) == 0)
        for (int p = 0; p < panels; p++)
            __builtin_prefetch((const char *)prefetch + p * panel_bytes +
                               (s >> __builtin_ctzll((uint64_t)spacing)) * LINEAR_STEP_BYTES,
                               0, 3);
}

/* Rows 0..rows-1 of x (K floats each) against one panel in format wfmt; every
 * `spacing`-th step also prefetches the next line from `prefetch` (or NULL). */
static inline __attribute__((always_inline)) void linear_block(
    const float *x, int64_t k, const void *panel, int wfmt, const float *scale,
    const float *bias, float *y, int64_t n, int64_t col, int64_t cols, int rows,
    const char *prefetch, int64_t spacing)
{
    v8f acc[LINEAR_MR][2];
    for (int r = 0; r < LINEAR_MR; r++)
        acc[r][0] = acc[r][1] = (v8f){0};
    const int64_t whole = wfmt == WEIGHTS_F32 ? k : k / 2;
    for (int64_t s = 0; s < whole; s++) {
        prefetch_step(prefetch, 1, 0, s, spacing);
        const char *step = (const char *)panel + s * LINEAR_STEP_BYTES;
        if (wfmt == WEIGHTS_F32) {
            multiply_add_rows(acc, x, k, s, *(const v8f *)step, *(const v8f *)(step + 32),
                              rows);
        } else {
            /* lane c: column c's bf16 of k (low half) and k + 1 (high half) */
            const v8u lo = *(const v8u *)step, hi = *(const v8u *)(step + 32);
            multiply_add_rows(acc, x, k, 2 * s, (v8f)(lo << 16), (v8f)(hi << 16), rows);
            multiply_add_rows(acc, x, k, 2 * s + 1, (v8f)(lo & 0xffff0000u),
                              (v8f)(hi & 0xffff0000u), rows);
        }
    }
    if (wfmt == WEIGHTS_BF16 && (k & 1)) {  /* the last k, alone in its pair */
        const char *step = (const char *)panel + whole * LINEAR_STEP_BYTES;
        const v8u lo = *(const v8u *)step, hi = *(const v8u *)(step + 32);
        multiply_add_rows(acc, x, k, k - 1, (v8f)(lo << 16), (v8f)(hi << 16), rows);
    }
    store_block(acc, rows, scale, bias, y, n, col, cols);
}

/* Steps between a tile's prefetches when `tiles` tiles share the next
 * panel's: a power of two >= tiles, so each asks for at most its share. */
static inline int64_t prefetch_spacing(int64_t tiles)
{
    int64_t spacing = 1;
    while (spacing < tiles)
        spacing *= 2;
    return spacing;
}

/* Tile t's share of the `next` panels (`steps` steps each; NULL: none). */
static inline const void *prefetch_share(const void *next, int64_t t, int64_t steps,
                                         int64_t spacing)
{
    return next ? (const char *)next + t * (steps / spacing) * LINEAR_STEP_BYTES : NULL;
}

/* All M rows against one panel, in ceil(M / LINEAR_MR) tiles of near-equal row
 * counts (8 rows: 4 + 4, not 6 + 2: a tile of one or two rows is bound by its
 * weight loads; bf16: LINEAR_MR_BF16), each row count a constant so that its
 * loop is unrolled.
 *
 * `next` (or NULL) is the panel the thread takes next: from
 * LINEAR_PREFETCH_ROWS rows on, each tile prefetches its share of it, so that
 * memory keeps streaming while the arithmetic runs (without it, a dozen rows
 * cost the memory time plus the arithmetic, not the larger of the two). With
 * fewer rows the arithmetic is short and the panels go by as one contiguous
 * stream; asked for as well, one row's weights read about a tenth slower. */
static inline __attribute__((always_inline)) void linear_panel(
    const float *x, int64_t m, int64_t k, const void *panel, int wfmt, const float *scale,
    const float *bias, float *y, int64_t n, int64_t col, int64_t cols, const void *next)
{
    const int64_t mr = wfmt == WEIGHTS_F32 ? LINEAR_MR : LINEAR_MR_BF16;
    const int64_t tiles = (m + mr - 1) / mr, steps = panel_steps(wfmt, k);
    if (m < LINEAR_PREFETCH_ROWS)
        next = NULL;
    const int64_t spacing = prefetch_spacing(tiles);
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int rows = (int)(m / tiles + (t < m % tiles));
        const float *xr = x + row * k;
        const char *pf = prefetch_share(next, t, steps, spacing);
        float *yr = y + row * n;
#define LINEAR_ROWS(r) linear_block(xr, k, panel, wfmt, scale, bias, yr, n, col, cols, r, pf, \
                                    spacing)
        switch (rows) {
        case 6: LINEAR_ROWS(6); break;
        case 5: LINEAR_ROWS(5); break;
        case 4: LINEAR_ROWS(4); break;
        case 3: LINEAR_ROWS(3); break;
        case 2: LINEAR_ROWS(2); break;
        default: LINEAR_ROWS(1); break;
        }
#undef LINEAR_ROWS
        row += rows;
    }
}

#endif
