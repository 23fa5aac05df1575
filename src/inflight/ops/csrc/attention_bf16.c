/* Paged attention over a bf16 KV cache with bf16 dot products (vdpbf16ps):
 * one tile of inflight_paged_attention (csrc/cpu_kernels.c) when the build
 * has them (INFLIGHT_AVX512_BF16) and head_dim is a multiple of 32.
 *
 * Widening the cache to float32 (the other builds' way) costs as much as the
 * float32 products themselves; here the cache's elements go into the products
 * as they are, two products a lane, summed in float32:
 *  - scores: q rounded to bf16 once, s = scale * (sum over each 32 elements of
 *    q . k, by vdpbf16ps into 16 lanes, then the lanes added by one fixed
 *    tree, sum16_each);
 *  - the softmax in float32 (attention.h), its numerators p rounded to bf16;
 *  - out = (sum over keys in pairs of p_i v_i + p_j v_j, by vdpbf16ps on the
 *    two value rows' elements interleaved) / (sum of the float32 p).
 * So a bf16 cache gives what FlashAttention-style bf16 kernels give, not the
 * float32 path's bits; every query's arithmetic is the same whatever else is
 * in its tile or batch, so a row keeps its bits alone and batched.
 */
#include "attention.h"
#include "bf16.h"

int inflight_attention_bf16(int64_t head_dim)
{
#ifdef INFLIGHT_AVX512_BF16
    return head_dim % 32 == 0 && head_dim <= 256;
#else
    (void)head_dim;
    return 0;
#endif
}

#ifdef INFLIGHT_AVX512_BF16

typedef int32_t v16si __attribute__((vector_size(64)));
typedef uint16_t v32u16 __attribute__((vector_size(64), aligned(2), may_alias));
typedef int16_t v32si16 __attribute__((vector_size(64)));

/* Lane j: the sum of a[j]'s 16 lanes, for 16 vectors at once. Every lane's sum
 * takes the same tree (lane m with m + 8, then + 4, + 2, + 1), so a key's
 * score does not depend on which other keys share the call. */
static inline __attribute__((always_inline)) v16f sum16_each(const v16f a[16])
{
    const v16si lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16si lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16si lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16si lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    /* keys j, j + 8: 8 partial sums each */
    v16f c[8];
    for (int j = 0; j < 8; j++)
        c[j] = __builtin_shuffle(a[j], a[j + 8], lo1) + __builtin_shuffle(a[j], a[j + 8], lo1 + 8);
    /* keys j, j + 8, j + 4, j + 12: 4 each */
    v16f d[4];
    for (int j = 0; j < 4; j++)
        d[j] = __builtin_shuffle(c[j], c[j + 4], lo2) + __builtin_shuffle(c[j], c[j + 4], lo2 + 4);
    /* keys j, j + 8, j + 4, j + 12, j + 2, j + 10, j + 6, j + 14: 2 each */
    v16f e[2];
    for (int j = 0; j < 2; j++)
        e[j] = __builtin_shuffle(d[j], d[j + 2], lo3) + __builtin_shuffle(d[j], d[j + 2], lo3 + 2);
    /* lane L: key bit-reversed L */
    const v16f f = __builtin_shuffle(e[0], e[1], lo4) + __builtin_shuffle(e[0], e[1], lo4 + 1);
    const v16si reversed = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    return __builtin_shuffle(f, reversed);
}

/* scores[t] = scale * q . k_t for `count` keys, q as bf16 pairs (HD / 32
 * vectors). */
static inline __attribute__((always_inline)) void dot_keys_bf16(
    const v16i *q, const uint16_t *k, int64_t count, int64_t hd, float scale, float *scores)
{
    int64_t t0 = 0;
    for (; t0 + 16 <= count; t0 += 16) {
        v16f acc[16];
        for (int j = 0; j < 16; j++) {
            acc[j] = (v16f){0};
            for (int64_t s = 0; s < hd / 32; s++)
                acc[j] = dot_bf16_pairs(acc[j], q[s], *(const v16i *)(k + (t0 + j) * hd + 32 * s));
        }
        *(v16f *)(scores + t0) = sum16_each(acc) * scale;
    }
    if (t0 < count) {  /* the rest, the same sums beside zeros */
        v16f acc[16];
        for (int j = 0; j < 16; j++) {
            acc[j] = (v16f){0};
            if (t0 + j < count)
                for (int64_t s = 0; s < hd / 32; s++)
                    acc[j] = dot_bf16_pairs(acc[j], q[s],
                                            *(const v16i *)(k + (t0 + j) * hd + 32 * s));
        }
        const v16f sums = sum16_each(acc) * scale;
        for (int j = 0; t0 + j < count; j++)
            scores[t0 + j] = sums[j];
    }
}

/* Heads whose output sums stay in registers while a pair of value rows is
 * read once for all of them. */
#define HEADS_AT_ONCE(hd) ((hd) <= 64 ? 4 : (hd) <= 128 ? 2 : 1)

/* out[g] += sum over keys of p_g[t] v_t for heads g0 .. g0 + heads - 1 (at
 * most HEADS_AT_ONCE), `count` value rows; p as bf16 rows `p_stride` apart,
 * out in pair order (see unpermute). Keys go in pairs (t, t + 1) from the
 * first; an odd last key pairs with zeros. */
static inline __attribute__((always_inline)) void accumulate_values_bf16(
    const uint16_t *p, int64_t p_stride, const uint16_t *v, int64_t count, int64_t hd,
    float *out, int heads)
{
    enum { MAXH = 4, MAXV = 16 };
    const int64_t hv = hd / 16;  /* output vectors per head */
    v16f acc[MAXH][MAXV];
    for (int h = 0; h < MAXH && h < heads; h++)
        for (int c = 0; c < hv; c++)
            acc[h][c] = *(const v16f *)(out + h * hd + 16 * c);
    /* unpacklo/hi of 16-bit elements: (a, b) pairs of elements 8l + m, and of
     * 8l + 4 + m, for lanes l < 4 and m < 4 */
    const v32si16 lo = {0, 32, 1, 33, 2, 34, 3, 35, 8, 40, 9, 41, 10, 42, 11, 43,
                        16, 48, 17, 49, 18, 50, 19, 51, 24, 56, 25, 57, 26, 58, 27, 59};
    for (int64_t t = 0; t < count; t += 2) {
        const int pair = t + 1 < count;
        v16i pp[MAXH];
        for (int h = 0; h < MAXH && h < heads; h++) {
            uint32_t two = p[h * p_stride + t];
            if (pair)
                two |= (uint32_t)p[h * p_stride + t + 1] << 16;
            pp[h] = (v16i){0} + (int32_t)two;
        }
        for (int64_t s = 0; s < hd / 32; s++) {
            const v32u16 a = *(const v32u16 *)(v + t * hd + 32 * s);
            const v32u16 b = pair ? *(const v32u16 *)(v + (t + 1) * hd + 32 * s) : (v32u16){0};
            const v16i ab_lo = (v16i)__builtin_shuffle(a, b, lo);
            const v16i ab_hi = (v16i)__builtin_shuffle(a, b, lo + 4);
            for (int h = 0; h < MAXH && h < heads; h++) {
                acc[h][2 * s] = dot_bf16_pairs(acc[h][2 * s], ab_lo, pp[h]);
                acc[h][2 * s + 1] = dot_bf16_pairs(acc[h][2 * s + 1], ab_hi, pp[h]);
            }
        }
    }
    for (int h = 0; h < MAXH && h < heads; h++)
        for (int c = 0; c < hv; c++)
            *(v16f *)(out + h * hd + 16 * c) = acc[h][c];
}

/* A head's outputs from pair order to element order, times inv_sum: pair
 * order holds, per 32 elements, those of unpacklo (8l + m at 4l + m) and
 * then those of unpackhi (8l + 4 + m at 16 + 4l + m). */
static inline void unpermute(float *out, int64_t hd, float inv_sum)
{
    float tmp[256];
    for (int64_t s = 0; s < hd; s += 32)
        for (int l = 0; l < 4; l++)
            for (int m = 0; m < 4; m++) {
                tmp[s + 8 * l + m] = out[s + 4 * l + m];
                tmp[s + 8 * l + 4 + m] = out[s + 16 + 4 * l + m];
            }
    for (int64_t d = 0; d < hd; d++)
        out[d] = tmp[d] * inv_sum;
}

static inline __attribute__((always_inline)) void attend_tile_bf16(
    const float *const *qh, float *const *oh, const int64_t *first, const int64_t *lens,
    int count, const uint16_t *kh, const uint16_t *vh, const int64_t *table,
    int64_t block_size, int64_t block_stride, int64_t group, int64_t hd, float scale,
    float softcap, float *scores, uint16_t *scratch)
{
    const int64_t lo_all = first[0], hi_all = lens[count - 1], span = hi_all - lo_all;
    const int64_t first_block = lo_all / block_size, last_block = (hi_all - 1) / block_size;
    const int64_t lines = block_stride * 2 / 64, part_lines = parts_of(lines, group);
    const int64_t rows = count * group;
    uint16_t *qb = scratch, *pb = scratch + rows * hd;  /* q and p as bf16 */
    for (int i = 0; i < count; i++)
        floats_to_bf16(qh[i], qb + i * group * hd, group * hd);

    const int64_t blocks = last_block - first_block + 1;
#define NEXT_BLOCK(j) ((j) < blocks ? kh + table[first_block + (j)] * block_stride \
                       : vh + table[first_block + (j) - blocks] * block_stride)
    prefetch_part(NEXT_BLOCK(0), lines, lines, 0);
    for (int64_t b = first_block; b <= last_block; b++) {
        const int64_t base = b * block_size;
        const uint16_t *kb = kh + table[b] * block_stride;
        for (int i = 0; i < count; i++) {
            int64_t lo, hi;
            if (!keys_in_block(first[i], lens[i], base, block_size, &lo, &hi))
                continue;
            for (int64_t g = 0; g < group; g++) {
                if (i == count - 1)
                    prefetch_part(NEXT_BLOCK(b - first_block + 1), lines, part_lines, g);
                v16i q[8];
                for (int64_t s = 0; s < hd / 32; s++)
                    q[s] = *(const v16i *)(qb + (i * group + g) * hd + 32 * s);
                dot_keys_bf16(q, kb + (lo - base) * hd, hi - lo, hd, scale,
                              scores + (i * group + g) * span + (lo - lo_all));
            }
        }
    }
    float inv_sum[ATTENTION_TILE * 16];  /* group <= 16: checked by the caller */
    softmax_rows(scores, first, lens, count, group, span, softcap, inv_sum);
    for (int64_t r = 0; r < rows; r++) {
        const int i = (int)(r / group);
        const int64_t at = r * span + (first[i] - lo_all);
        floats_to_bf16(scores + at, pb + at, lens[i] - first[i]);
    }
    for (int i = 0; i < count; i++)
        memset(oh[i], 0, (size_t)(group * hd) * sizeof(float));

    const int at_once = HEADS_AT_ONCE(hd);
    for (int64_t b = first_block; b <= last_block; b++) {
        const int64_t base = b * block_size;
        const uint16_t *vb = vh + table[b] * block_stride;
        for (int i = 0; i < count; i++) {
            int64_t lo, hi;
            if (!keys_in_block(first[i], lens[i], base, block_size, &lo, &hi))
                continue;
            if (i == count - 1 && b < last_block)
                prefetch_part(NEXT_BLOCK(blocks + b - first_block + 1), lines, lines, 0);
            for (int64_t g = 0; g < group; g += at_once) {
                const int heads = group - g < at_once ? (int)(group - g) : at_once;
#define VALUES(h) accumulate_values_bf16(pb + (i * group + g) * span + (lo - lo_all), span, \
                                         vb + (lo - base) * hd, hi - lo, hd, oh[i] + g * hd, h)
                switch (heads) {
                case 4: VALUES(4); break;
                case 3: VALUES(3); break;
                case 2: VALUES(2); break;
                default: VALUES(1); break;
                }
#undef VALUES
            }
        }
    }
#undef NEXT_BLOCK
    for (int i = 0; i < count; i++)
        for (int64_t g = 0; g < group; g++)
            unpermute(oh[i] + g * hd, hd, inv_sum[i * group + g]);
}

void inflight_attend_tile_bf16(
    const float *const *qh, float *const *oh, const int64_t *first, const int64_t *lens,
    int count, const uint16_t *kh, const uint16_t *vh, const int64_t *table,
    int64_t block_size, int64_t block_stride, int64_t group, int64_t head_dim, float scale,
    float softcap, float *scores, uint16_t *scratch)
{
#define TILE(hd) attend_tile_bf16(qh, oh, first, lens, count, kh, vh, table, block_size, \
                                  block_stride, group, hd, scale, softcap, scores, scratch)
    if (head_dim == 64)
        TILE(64);
    else if (head_dim == 128)
        TILE(128);
    else
        TILE(head_dim);
#undef TILE
}

#endif
