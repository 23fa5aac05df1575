/* The register-blocked linear-layer microkernel shared by the float32 and the
 * weight-quantized kernels: y[M, N] = x[M, K] . W[N, K]^T (* scale) (+ bias).
 *
 * W comes in panels of LINEAR_NR output columns, k-major inside a panel
 * ([K][NR]). The microkernel keeps a LINEAR_MR x 16 block of y in twelve
 * vector registers and, for each k, broadcasts MR x values against the panel's
 * two weight vectors. Each output is summed over k in the same order whatever
 * M is, so a row's result does not depend on the rest of the batch.
 */
#ifndef INFLIGHT_LINEAR_KERNEL_H
#define INFLIGHT_LINEAR_KERNEL_H

#include <stdint.h>

/* Parallelise only loops with at least this many elements of work. */
#define PARALLEL_MIN_WORK 32768

#define LINEAR_NR 16
#define LINEAR_MR 6
/* Rows from which a panel's tiles prefetch the next panel (see linear_panel). */
#define LINEAR_PREFETCH_ROWS 4

/* 8 floats; loads and stores through it may be unaligned. */
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));

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

/* Rows 0..rows-1 of x (K floats each) against one float32 panel; every
 * `spacing`-th k also prefetches the next line from `prefetch` (or NULL). */
static inline __attribute__((always_inline)) void linear_block(
    const float *x, int64_t k, const float *panel, const float *scale, const float *bias,
    float *y, int64_t n, int64_t col, int64_t cols, int rows, const float *prefetch,
    int64_t spacing)
{
    v8f acc[LINEAR_MR][2];
    for (int r = 0; r < LINEAR_MR; r++)
        acc[r][0] = acc[r][1] = (v8f){0};
    for (int64_t kk = 0; kk < k; kk++) {
        if (prefetch && (kk & (spacing - 1)) == 0)
            __builtin_prefetch(prefetch + (kk / spacing) * LINEAR_NR, 0, 3);
        const v8f w0 = *(const v8f *)(panel + kk * LINEAR_NR);
        const v8f w1 = *(const v8f *)(panel + kk * LINEAR_NR + 8);
        for (int r = 0; r < rows; r++) {
            const float xv = x[r * k + kk];
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
        }
    }
    store_block(acc, rows, scale, bias, y, n, col, cols);
}

/* All M rows against one float32 panel, in ceil(M / LINEAR_MR) tiles of
 * near-equal row counts (8 rows: 4 + 4, not 6 + 2: a tile of one or two rows
 * is bound by its weight loads), each row count a constant so that its loop is
 * unrolled.
 *
 * `next` (or NULL) is the panel the thread takes next: from
 * LINEAR_PREFETCH_ROWS rows on, each tile prefetches its share of it, so that
 * memory keeps streaming while the arithmetic runs (without it, a dozen rows
 * cost the memory time plus the arithmetic, not the larger of the two). With
 * fewer rows the arithmetic is short and the panels go by as one contiguous
 * stream; asked for as well, one row's weights read about a tenth slower. */
static inline __attribute__((always_inline)) void linear_panel(
    const float *x, int64_t m, int64_t k, const float *panel, const float *scale,
    const float *bias, float *y, int64_t n, int64_t col, int64_t cols, const float *next)
{
    const int64_t tiles = (m + LINEAR_MR - 1) / LINEAR_MR;
    if (m < LINEAR_PREFETCH_ROWS)
        next = NULL;
    int64_t spacing = 1;  /* iterations between prefetches: a power of two >= tiles */
    while (spacing < tiles)
        spacing *= 2;
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const int rows = (int)(m / tiles + (t < m % tiles));
        const float *xr = x + row * k, *pf = next ? next + t * (k / spacing) * LINEAR_NR : NULL;
        float *yr = y + row * n;
        switch (rows) {
        case 6: linear_block(xr, k, panel, scale, bias, yr, n, col, cols, 6, pf, spacing); break;
        case 5: linear_block(xr, k, panel, scale, bias, yr, n, col, cols, 5, pf, spacing); break;
        case 4: linear_block(xr, k, panel, scale, bias, yr, n, col, cols, 4, pf, spacing); break;
        case 3: linear_block(xr, k, panel, scale, bias, yr, n, col, cols, 3, pf, spacing); break;
        case 2: linear_block(xr, k, panel, scale, bias, yr, n, col, cols, 2, pf, spacing); break;
        default: linear_block(xr, k, panel, scale, bias, yr, n, col, cols, 1, pf, spacing); break;
        }
        row += rows;
    }
}

#endif
