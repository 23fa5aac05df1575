/* What the paged-attention kernels share: the float32 path over any cache
 * (csrc/cpu_kernels.c) and the bf16 dot-product path over a bf16 cache
 * (csrc/attention_bf16.c): the softmax's exp, the soft cap, which keys of a
 * block a query sees, prefetching, and one tile's softmax. */
#ifndef INFLIGHT_ATTENTION_H
#define INFLIGHT_ATTENTION_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "isa.h"

/* exp(x) for x <= 0 (softmax numerators), relative error below 2e-7. Plain
 * arithmetic, so loops over it vectorise (libm's expf is a scalar call). */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = __builtin_floorf(x * 1.44269504f + 0.5f);  /* x = n ln2 + r */
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n = { .i = ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

/* row[t] = cap * tanh(row[t] / cap) for n scores (Gemma 2's attention-logit
 * soft cap), tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) from
 * exp_nonpositive, so the loop vectorises; absolute error about 2e-7 cap. */
static inline void soft_cap(float *row, int64_t n, float cap)
{
#pragma omp simd
    for (int64_t t = 0; t < n; t++) {
        const float x = row[t] / cap, e = exp_nonpositive(-2.0f * fabsf(x));
        row[t] = cap * copysignf((1.0f - e) / (1.0f + e), x);
    }
}

/* Ask for part `part` of a cache block's `lines` 64-byte lines ahead of use,
 * `part_lines` a part (parts_of: no division in the loops): blocks are
 * scattered in memory, so the hardware prefetcher, which follows one address
 * stream, loses the trail at every block boundary. A block asked for in
 * parts, one before each head's pass over the block in hand, keeps the misses
 * in flight to what the core can track: asked for at once (a 4 KiB block is
 * 64 lines), it stalled on a full miss queue and read about a fifth slower. */
static inline void prefetch_part(const void *block, int64_t lines, int64_t part_lines,
                                 int64_t part)
{
    const int64_t lo = part * part_lines;
    const int64_t hi = lo + part_lines < lines ? lo + part_lines : lines;
    for (int64_t i = lo; i < hi; i++)
        __builtin_prefetch((const char *)block + 64 * i);
}

/* Lines a part of `lines` split into `parts`. */
static inline int64_t parts_of(int64_t lines, int64_t parts)
{
    return (lines + parts - 1) / parts;
}

/* Queries attended together: consecutive tokens of one sequence share each
 * K/V block load (a prompt chunk, a run of drafts). */
#define ATTENTION_TILE 8

/* The positions [lo, hi) of the block starting at `base` that a query seeing
 * keys first .. len - 1 attends to; 0 if none. */
static inline int keys_in_block(int64_t first, int64_t len, int64_t base, int64_t block_size,
                                int64_t *lo, int64_t *hi)
{
    *lo = first > base ? first : base;
    *hi = len < base + block_size ? len : base + block_size;
    return *hi > *lo;
}

/* row[0] + ... + row[n - 1] in an order that depends on n alone (eight
 * lanes, then the tail), so that a row's sum has the same bits in any tile. */
static inline float row_sum(const float *row, int64_t n)
{
    v8f acc = {0};
    int64_t t = 0;
    for (; t + 8 <= n; t += 8)
        acc += *(const v8f *)(row + t);
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; t < n; t++)
        sum += row[t];
    return sum;
}

/* Each (query, head) row of a tile's scores to its softmax numerators,
 * exp(s - max) (after the soft cap, if any), and inv_sum[row] = 1 / their sum.
 * Row (i, g) lies at scores + (i * group + g) * span, its query's keys from
 * first[i] - lo_all on. Every row is computed as it would be alone. */
static inline void softmax_rows(float *scores, const int64_t *first, const int64_t *lens,
                                int count, int64_t group, int64_t span, float softcap,
                                float *inv_sum)
{
    const int64_t lo_all = first[0];
    for (int i = 0; i < count; i++) {
        const int64_t n = lens[i] - first[i];
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + (i * group + g) * span + (first[i] - lo_all);
            if (softcap > 0.0f)
                soft_cap(row, n, softcap);
            float max = -INFINITY;  /* the same whatever the order: vectorised */
#pragma omp simd reduction(max:max)
            for (int64_t t = 0; t < n; t++)
                max = row[t] > max ? row[t] : max;
#pragma omp simd
            for (int64_t t = 0; t < n; t++)
                row[t] = exp_nonpositive(row[t] - max);
        }
        for (int64_t g = 0; g < group; g++)
            inv_sum[i * group + g] = 1.0f / row_sum(scores + (i * group + g) * span +
                                                    (first[i] - lo_all), n);
    }
}

/* Whether attention over a bf16 cache with `head_dim` takes bf16 dot products
 * in this build (csrc/attention_bf16.c) rather than widening the cache to
 * float32; exported, so that Python asks the library rather than repeat it. */
int inflight_attention_bf16(int64_t head_dim);

/* Floats of scratch a bf16 tile needs after its scores: q and p as bf16. */
static inline int64_t attention_bf16_scratch(int64_t count, int64_t group, int64_t span,
                                             int64_t head_dim)
{
    return (count * group * (head_dim + span) + 1) / 2;
}

#ifdef INFLIGHT_AVX512_BF16
/* A tile of inflight_paged_attention over a bf16 cache with bf16 dot products,
 * where inflight_attention_bf16(head_dim). `scratch` holds
 * attention_bf16_scratch(count, group, span, head_dim) floats. */
void inflight_attend_tile_bf16(
    const float *const *qh, float *const *oh, const int64_t *first, const int64_t *lens,
    int count, const uint16_t *kh, const uint16_t *vh, const int64_t *table,
    int64_t block_size, int64_t block_stride, int64_t group, int64_t head_dim, float scale,
    float softcap, float *scores, uint16_t *scratch);
#endif

#endif
