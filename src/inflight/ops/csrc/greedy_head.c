/* The greedy token of each row of a linear layer's output (the output layer's
 * logits), without writing the logits out: each thread computes a block of
 * columns into a scratch buffer that stays in its L2 cache (up to 1,024 rows),
 * with the format's own kernel, and keeps each row's largest value, where it
 * first occurs, and the sum of its values (finite or not: the sampler's test
 * of a numerical fault, summed in another order). With a 49,152-token
 * vocabulary the logits of 64 rows are 12.6 MB, written and read twice more
 * (the sampler's finiteness check, then its argmax) where this reads the
 * weights alone.
 *
 * Each column gets the same arithmetic, in the same order, as in the whole
 * product (the kernels' results depend on neither the batch nor the columns
 * around them, though a block's last columns may take another tile shape), so
 * the token is the first index of the logits' maximum, as NumPy's argmax
 * finds it.
 *
 * Where the kernels run on one thread because the engine process gave its
 * other cores up (worker.cpu_share) and the spare core is lent
 * (spare_core.c), the blocks are narrower and a helper thread claims some
 * whenever it gets a core: the output layer is most of a small model's step.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "linear_kernel.h"
#include "spare_core.h"

/* A block's logits at most (floats, per thread): 256 KiB, within L2. */
#define GREEDY_SCRATCH_FLOATS 65536
/* Columns of a block: a multiple of this (whole panels). */
#define GREEDY_COLUMN_STEP 64
/* Blocks at least, on one thread with the spare core lent (for it to claim). */
#define GREEDY_SPARE_BLOCKS 16

/* Row `cols` logits y (columns col0 + j): the largest, where it first is, and
 * their sum. */
static void scan_row(const float *y, int64_t cols, int64_t col0, float *best, int64_t *where,
                     float *sum)
{
    v16f top = (v16f){0} - __builtin_inff(), partial = {0};
    v16i at = {0};
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t j = 0;
    for (; j + 16 <= cols; j += 16) {
        v16f v;
        memcpy(&v, y + j, sizeof v);
        const v16i greater = v > top;  /* (NaN: never) */
        top = (v16f)(((v16i)v & greater) | ((v16i)top & ~greater));
        at = ((lane + (int32_t)j) & greater) | (at & ~greater);
        partial += v;
    }
    float b = -__builtin_inff(), total = 0.0f;
    int64_t w = 0;
    for (int l = 0; l < 16; l++) {
        if (top[l] > b || (top[l] == b && at[l] < w)) {
            b = top[l];
            w = at[l];
        }
        total += partial[l];
    }
    for (; j < cols; j++) {
        if (y[j] > b) {
            b = y[j];
            w = j;
        }
        total += y[j];
    }
    *best = b;
    *where = col0 + w;
    *sum = total;
}

/* Columns [col, col + cols) of x W^T + bias into y (rows `cols` apart), by
 * the format's kernel on this thread; 0, or the kernel's error. */
static int block_product(int64_t fmt, const float *x, const uint8_t *packed,
                         int64_t panel_bytes, const float *scale, const float *bias, float *y,
                         int64_t m, int64_t col, int64_t cols, int64_t k)
{
    const uint8_t *panels = packed + col / LINEAR_NR * panel_bytes;
    const float *b = bias ? bias + col : NULL;
    if (fmt == GREEDY_F32) {
        inflight_linear_f32(x, (const float *)panels, b, y, m, cols, k);
        return 0;
    }
    return inflight_quant_linear(fmt, x, panels, scale ? scale + col : NULL, b, y, m, cols, k);
}

/* One call's product, cut into blocks of `width` columns, and each block's
 * per-row results (best, where, sum: `m` apiece). */
typedef struct {
    int64_t fmt, panel_bytes, m, n, k, width;
    const float *x, *scale, *bias;
    const uint8_t *packed;
    float *best, *sum;
    int64_t *where;
    float *scratch[2]; /* spare_core_run's two workers' */
    int failed;
} greedy_job;

/* Block `blk` of the job, its logits in y (m * width floats). */
static void greedy_block(greedy_job *job, int64_t blk, float *y)
{
    const int64_t m = job->m, col = blk * job->width;
    const int64_t cols = job->n - col < job->width ? job->n - col : job->width;
    const int status = y == NULL ? -1 : block_product(job->fmt, job->x, job->packed,
                                                      job->panel_bytes, job->scale, job->bias,
                                                      y, m, col, cols, job->k);
    if (status != 0) {
        __atomic_store_n(&job->failed, status, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t r = 0; r < m; r++)
        scan_row(y + r * cols, cols, col, job->best + blk * m + r, job->where + blk * m + r,
                 job->sum + blk * m + r);
}

static void spare_block(void *ctx, int64_t blk, int worker)
{
    greedy_job *job = ctx;
    greedy_block(job, blk, job->scratch[worker]);
}

int inflight_greedy_linear(int64_t fmt, const float *x, const uint8_t *packed, const float *scale,
                           const float *bias, int64_t m, int64_t n, int64_t k, int64_t *tokens,
                           uint8_t *finite)
{
    if (m <= 0 || n <= 0)
        return 0;
    greedy_job job = {.fmt = fmt, .m = m, .n = n, .k = k, .x = x, .scale = scale, .bias = bias,
                      .packed = packed};
    job.panel_bytes = fmt == GREEDY_F32 ? panel_size(WEIGHTS_F32, k)
                                        : inflight_panel_bytes(fmt, k);
    const int parallel = m * n * k > PARALLEL_MIN_WORK;
    const int64_t threads = parallel ? omp_get_max_threads() : 1;
    /* On one thread with the spare core lent: blocks for it to claim. */
    const int spare = parallel && threads == 1 && spare_core_on();
    /* Blocks as wide as the scratch holds, and at least one a thread. */
    const int64_t share = spare ? (n + GREEDY_SPARE_BLOCKS - 1) / GREEDY_SPARE_BLOCKS
                                : (n + threads - 1) / threads;
    int64_t width = GREEDY_SCRATCH_FLOATS / m;
    width = share < width ? share : width;
    width = width < 1 ? 1 : width;
    job.width = (width + GREEDY_COLUMN_STEP - 1) / GREEDY_COLUMN_STEP * GREEDY_COLUMN_STEP;
    const int64_t blocks = (n + job.width - 1) / job.width;
    job.best = malloc((size_t)(blocks * m) * sizeof(float));
    job.where = malloc((size_t)(blocks * m) * sizeof(int64_t));
    job.sum = malloc((size_t)(blocks * m) * sizeof(float));
    job.failed = job.best == NULL || job.where == NULL || job.sum == NULL ? -1 : 0;
    if (!job.failed && spare) {
        for (int w = 0; w < 2; w++)
            job.scratch[w] = malloc((size_t)(m * job.width) * sizeof(float));
        spare_core_run(blocks, spare_block, &job);
        for (int w = 0; w < 2; w++)
            free(job.scratch[w]);
    } else if (!job.failed) {
#pragma omp parallel if (parallel)
        {
            /* The kernels' own parallel loops run on this thread alone. */
            omp_set_num_threads(1);
            float *y = malloc((size_t)(m * job.width) * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t blk = 0; blk < blocks; blk++)
                greedy_block(&job, blk, y);
            free(y);
        }
    }
    if (!job.failed) {
        for (int64_t r = 0; r < m; r++) {
            float b = job.best[r];
            int64_t w = job.where[r];
            float total = job.sum[r];
            for (int64_t blk = 1; blk < blocks; blk++) {
                if (job.best[blk * m + r] > b) {  /* (a tie keeps the earlier block's) */
                    b = job.best[blk * m + r];
                    w = job.where[blk * m + r];
                }
                total += job.sum[blk * m + r];
            }
            tokens[r] = w;
            finite[r] = (uint8_t)(total - total == 0);  /* inf - inf and NaN - NaN are NaN */
        }
    }
    free(job.best);
    free(job.where);
    free(job.sum);
    return job.failed;
}
