/* CPU kernels for float32 activations: linear layers, paged attention over a
 * float32 or bfloat16 KV cache, and the small fused ops of a decoder layer
 * (rotary embedding, residual add + RMSNorm, SiLU-and-multiply).
 *
 * PyTorch would run each of these as several separate operators whose fixed
 * cost dominates at decode batch sizes; here each is one pass over the data.
 * Loops are parallelised with OpenMP; loaded into a Python process that has
 * imported torch, they share PyTorch's OpenMP runtime, so torch.set_num_threads
 * governs them too. All tensors are contiguous, row-major.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "bf16.h"
#include "kernels.h"
#include "linear_kernel.h"

/* The target this build is for (ops/cpu_isa.py). */
const char *inflight_isa(void)
{
    return INFLIGHT_ISA_NAME;
}

/* Lane j: hsum8(a[j]), added in the same order, for 8 vectors at once (the
 * halves of each added first, then pairs, as hsum8 does). */
static inline __attribute__((always_inline)) v8f hsum8_each(const v8f a[8])
{
    const v8i lo = {0, 1, 2, 3, 8, 9, 10, 11}, hi = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8i even = {0, 2, 8, 10, 4, 6, 12, 14}, odd = {1, 3, 9, 11, 5, 7, 13, 15};
    v8f h[4];  /* h[j] = [a[j] halves added | a[j + 4] halves added] */
    for (int j = 0; j < 4; j++)
        h[j] = __builtin_shuffle(a[j], a[j + 4], lo) + __builtin_shuffle(a[j], a[j + 4], hi);
    /* pairs within each half: [h0 pairs, h1 pairs | h4 pairs, h5 pairs], ... */
    const v8f p01 = __builtin_shuffle(h[0], h[1], even) + __builtin_shuffle(h[0], h[1], odd);
    const v8f p23 = __builtin_shuffle(h[2], h[3], even) + __builtin_shuffle(h[2], h[3], odd);
    return __builtin_shuffle(p01, p23, even) + __builtin_shuffle(p01, p23, odd);
}

/* The cache's elements: float32, or bf16 when kv16 (a constant wherever these
 * are inlined, so each kernel is compiled once per element type). */
static inline __attribute__((always_inline)) const void *kv_at(const void *base, int64_t i,
                                                               int kv16)
{
    return (const char *)base + i * (kv16 ? 2 : 4);
}

/* scores[i * stride] = scale * q . k_i for `count` keys `head_dim` elements
 * apart. Eight keys at a time keep eight independent multiply-add chains in
 * flight; each key's dot product is computed the same way wherever it falls. */
static inline __attribute__((always_inline)) void dot_keys(
    const float *q, const float *k, int64_t count, int64_t head_dim, float scale,
    float *scores, int64_t stride)
{
    int64_t i = 0;
    if (head_dim % 8 == 0) {
        for (; i + 8 <= count; i += 8) {
            v8f a[8] = {{0}};
            for (int64_t d = 0; d < head_dim; d += 8) {
                const v8f qv = *(const v8f *)(q + d);
                for (int j = 0; j < 8; j++)
                    a[j] += qv * *(const v8f *)(k + (i + j) * head_dim + d);
            }
            const v8f sums = hsum8_each(a) * scale;
            for (int j = 0; j < 8; j++)
                scores[(i + j) * stride] = sums[j];
        }
        /* The rest one key at a time, with the same arithmetic per key: a
         * key's score never depends on how many keys were asked for. */
        for (; i < count; i++) {
            v8f a = {0};
            for (int64_t d = 0; d < head_dim; d += 8)
                a += *(const v8f *)(q + d) * *(const v8f *)(k + i * head_dim + d);
            scores[i * stride] = hsum8(a) * scale;
        }
    }
    for (; i < count; i++) {
        float dot = 0.0f;
#pragma omp simd reduction(+:dot)
        for (int64_t d = 0; d < head_dim; d++)
            dot += q[d] * k[i * head_dim + d];
        scores[i * stride] = dot * scale;
    }
}

/* out += sum_i p[i * stride] * v_i over `count` value rows. */
static inline __attribute__((always_inline)) void accumulate_values(
    const float *p, int64_t stride, const float *v, int64_t count, int64_t head_dim,
    float *out)
{
    if (head_dim % 8 == 0 && head_dim <= 256) {
        v8f acc[32];
        const int64_t chunks = head_dim / 8;
        for (int64_t c = 0; c < chunks; c++)
            acc[c] = *(const v8f *)(out + 8 * c);
        for (int64_t i = 0; i < count; i++) {
            const float w = p[i * stride];
            for (int64_t c = 0; c < chunks; c++)
                acc[c] += w * *(const v8f *)(v + i * head_dim + 8 * c);
        }
        for (int64_t c = 0; c < chunks; c++)
            *(v8f *)(out + 8 * c) = acc[c];
        return;
    }
    for (int64_t i = 0; i < count; i++) {
        const float w = p[i * stride];
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++)
            out[d] += w * v[i * head_dim + d];
    }
}

/* A cache block's elements as float32: the block itself when the cache is
 * float32, else its rows [lo, hi) (those a tile reads; positions lo_all ..
 * hi_all - 1 of the sequence) widened into `wide` at their places. */
static inline __attribute__((always_inline)) const float *widened_rows(
    const void *block, int kv16, int64_t base, int64_t lo_all, int64_t hi_all,
    int64_t block_size, int64_t head_dim, float *wide)
{
    if (!kv16)
        return block;
    const int64_t lo = (lo_all > base ? lo_all : base) - base;
    const int64_t hi = (hi_all < base + block_size ? hi_all : base + block_size) - base;
    const uint16_t *src = block;
    int64_t i = lo * head_dim;
    for (; i + 8 <= hi * head_dim; i += 8)
        *(v8f *)(wide + i) = bf16x8_to_float(src + i);
    for (; i < hi * head_dim; i++)
        wide[i] = bf16_to_float(src[i]);
    return wide;
}

/* Tile of `count` query tokens x `group` heads of one sequence against one KV
 * head. Query i (qh[i], out oh[i]) sees keys first[i] .. lens[i] - 1. Every
 * query's scores, softmax and weighted sum of values are computed in the same
 * order as they would be alone (a tile of one), so results do not depend on
 * the tiling. `scores` holds count * group * span floats, span = lens[count-1]
 * - first[0]: one row per (query, head). Inlined with a constant head_dim for
 * the common sizes, so the vector loops fully unroll, and a constant kv16 (the
 * cache's elements bf16: the rows of a block the tile reads are widened to
 * float32 once into `wide`, block_stride floats, and every query and head of
 * the tile reads them there; widening is exact, so the results are those of a
 * float32 cache holding the same values). */
static inline __attribute__((always_inline)) void attend_tile(
    const float *const *qh, float *const *oh, const int64_t *first, const int64_t *lens,
    int count, const void *kh, const void *vh, int kv16, const int64_t *table,
    int64_t block_size, int64_t block_stride, int64_t group, int64_t head_dim, float scale,
    float softcap, float *scores, float *wide)
{
    const int64_t lo_all = first[0], hi_all = lens[count - 1], span = hi_all - lo_all;
    const int64_t first_block = lo_all / block_size, last_block = (hi_all - 1) / block_size;
    const int64_t lines = block_stride * (kv16 ? 2 : 4) / 64, part_lines = parts_of(lines, group);

    /* The tile reads its K blocks, then its V blocks: while on one, it asks
     * for the next (the last query sees every block of the tile). */
    const int64_t blocks = last_block - first_block + 1;
#define NEXT_BLOCK(j) ((j) < blocks ? kv_at(kh, table[first_block + (j)] * block_stride, kv16) \
                       : kv_at(vh, table[first_block + (j) - blocks] * block_stride, kv16))
    prefetch_part(NEXT_BLOCK(0), lines, lines, 0);

    /* scores of each (query, head) for the keys it sees, in its own row */
    for (int64_t b = first_block; b <= last_block; b++) {
        const int64_t base = b * block_size;
        const float *kb = widened_rows(kv_at(kh, table[b] * block_stride, kv16), kv16, base,
                                       lo_all, hi_all, block_size, head_dim, wide);
        for (int i = 0; i < count; i++) {
            int64_t lo, hi;
            if (!keys_in_block(first[i], lens[i], base, block_size, &lo, &hi))
                continue;
            for (int64_t g = 0; g < group; g++) {
                if (i == count - 1)
                    prefetch_part(NEXT_BLOCK(b - first_block + 1), lines, part_lines, g);
                dot_keys(qh[i] + g * head_dim, kb + (lo - base) * head_dim, hi - lo,
                         head_dim, scale, scores + (i * group + g) * span + (lo - lo_all), 1);
            }
        }
    }
    float inv_sum[ATTENTION_TILE * 16];  /* group <= 16: checked by the caller */
    softmax_rows(scores, first, lens, count, group, span, softcap, inv_sum);
    for (int i = 0; i < count; i++)
        memset(oh[i], 0, (size_t)(group * head_dim) * sizeof(float));
    for (int64_t b = first_block; b <= last_block; b++) {
        const int64_t base = b * block_size;
        const float *vb = widened_rows(kv_at(vh, table[b] * block_stride, kv16), kv16, base,
                                       lo_all, hi_all, block_size, head_dim, wide);
        for (int i = 0; i < count; i++) {
            int64_t lo, hi;
            if (!keys_in_block(first[i], lens[i], base, block_size, &lo, &hi))
                continue;
            for (int64_t g = 0; g < group; g++) {
                if (i == count - 1 && b < last_block)
                    prefetch_part(NEXT_BLOCK(blocks + b - first_block + 1), lines, part_lines,
                                  g);
                accumulate_values(scores + (i * group + g) * span + (lo - lo_all), 1,
                                  vb + (lo - base) * head_dim, hi - lo, head_dim,
                                  oh[i] + g * head_dim);
            }
        }
    }
#undef NEXT_BLOCK
    for (int i = 0; i < count; i++)
        for (int64_t g = 0; g < group; g++)
            for (int64_t d = 0; d < head_dim; d++)
                oh[i][g * head_dim + d] *= inv_sum[i * group + g];
}

/* Attention of query tokens over the paged KV cache.
 *
 * Query s is row s of q (and of out), each row laid out as [num_heads,
 * head_dim] (rows q_stride and out_stride floats apart); it attends to the
 * first seq_lens[s] positions of its sequence (the last `window` of them when
 * window > 0), whose K/V live in blocks block_tables[row_tables[s], :] of
 * k_cache/v_cache [num_kv_heads, num_blocks, block_size, head_dim] (float32,
 * or bf16 when kv_bf16: with bf16 dot products where the build has them and
 * head_dim is a multiple of 32 up to 256 (csrc/attention_bf16.c), else each
 * element widened exactly, so that the outputs are those of a float32 cache
 * holding the same values). Query head
 * j reads KV head j / (num_heads / num_kv_heads). K and V are read in place,
 * block by block: nothing is gathered or padded. A prompt's tokens are queries
 * with increasing seq_lens (causal attention); up to ATTENTION_TILE
 * consecutive ones of a sequence share each block load, and each is computed
 * exactly as its decode would be. With softcap > 0 each scaled score s
 * becomes softcap * tanh(s / softcap) before the softmax (0: none). Returns
 * -1 if scratch memory ran out, -2 for more than 16 query heads per KV head.
 */
int inflight_paged_attention(
    const float *q, int64_t q_stride, float *out, int64_t out_stride, int64_t num_queries,
    const void *k_cache, const void *v_cache, int64_t kv_bf16, int64_t num_blocks,
    int64_t block_size,
    const int64_t *block_tables, const int64_t *row_tables, int64_t max_blocks,
    const int64_t *seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, float softcap)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    const int64_t block_stride = block_size * head_dim;
    if (group > 16)
        return -2;
    /* Tiles: runs of consecutive queries of one sequence, one key apart. */
    int64_t *tile_start = malloc((size_t)(num_queries + 1) * sizeof(int64_t));
    if (tile_start == NULL)
        return -1;
    int64_t num_tiles = 0;
    for (int64_t s = 0; s < num_queries; s++) {
        const int joins = num_tiles > 0 && window <= 0 && s - tile_start[num_tiles - 1] <
            ATTENTION_TILE && row_tables[s] == row_tables[s - 1] &&
            seq_lens[s] == seq_lens[s - 1] + 1;
        if (!joins)
            tile_start[num_tiles++] = s;
    }
    tile_start[num_tiles] = num_queries;
    int failed = 0;
    const int dot16 = kv_bf16 && inflight_attention_bf16(head_dim);

#pragma omp parallel if (num_tiles * num_kv_heads > 1)
    {
        float *scores = NULL;
        int64_t capacity = 0;
        /* One block's elements widened from a bf16 cache. */
        float *wide = kv_bf16 && !dot16 ? malloc((size_t)block_stride * sizeof(float)) : NULL;
        if (kv_bf16 && !dot16 && wide == NULL) {
#pragma omp atomic write
            failed = 1;
        }

#pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tiles; t++) {
            for (int64_t h = 0; h < num_kv_heads; h++) {
                const int64_t s0 = tile_start[t];
                const int count = (int)(tile_start[t + 1] - s0);
                const float *qh[ATTENTION_TILE];
                float *oh[ATTENTION_TILE];
                int64_t first[ATTENTION_TILE], lens[ATTENTION_TILE];
                for (int i = 0; i < count; i++) {
                    lens[i] = seq_lens[s0 + i];
                    first[i] = (window > 0 && lens[i] > window) ? lens[i] - window : 0;
                    qh[i] = q + (s0 + i) * q_stride + h * group * head_dim;
                    oh[i] = out + (s0 + i) * out_stride + h * group * head_dim;
                }
                const int64_t span = lens[count - 1] - first[0];
                /* the scores, then a bf16 tile's q and p */
                const int64_t need = count * group * span +
                    (dot16 ? attention_bf16_scratch(count, group, span, head_dim) : 0);
                if (kv_bf16 && !dot16 && wide == NULL)
                    continue;
                if (need > capacity) {
                    float *grown = realloc(scores, (size_t)need * sizeof(float));
                    if (grown == NULL) {
#pragma omp atomic write
                        failed = 1;
                        continue;
                    }
                    scores = grown;
                    capacity = need;
                }
                const int64_t *table = block_tables + row_tables[s0] * max_blocks;
                const int kv16 = kv_bf16 != 0;
                const void *kh = kv_at(k_cache, h * head_stride, kv16);
                const void *vh = kv_at(v_cache, h * head_stride, kv16);
#define ATTEND(kv16_, head_dim_) attend_tile(qh, oh, first, lens, count, kh, vh, kv16_, table, \
                                             block_size, block_stride, group, head_dim_, scale, \
                                             softcap, scores, wide)
#ifdef INFLIGHT_AVX512_BF16
                if (dot16) {
                    inflight_attend_tile_bf16(qh, oh, first, lens, count, kh, vh, table,
                                              block_size, block_stride, group, head_dim, scale,
                                              softcap, scores,
                                              (uint16_t *)(scores + count * group * span));
                    continue;
                }
#endif
                if (kv16) {
                    if (head_dim == 64)
                        ATTEND(1, 64);
                    else if (head_dim == 128)
                        ATTEND(1, 128);
                    else
                        ATTEND(1, head_dim);
                } else if (head_dim == 64) {
                    ATTEND(0, 64);
                } else if (head_dim == 128) {
                    ATTEND(0, 128);
                } else {
                    ATTEND(0, head_dim);
                }
#undef ATTEND
            }
        }
        free(scores);
        free(wide);
    }
    free(tile_start);
    return failed ? -1 : 0;
}

/* ---- Linear layers: y[M, N] = x[M, K] . W[N, K]^T (+ bias) ----
 *
 * W is packed once into panels of LINEAR_NR output columns (see
 * linear_kernel.h), k-major inside a panel ([ceil(N / NR)][K][NR],
 * zero-padded), so the microkernel streams it contiguously. Threads split the
 * panels. */
void inflight_pack_weight_f32(const float *w, float *packed, int64_t n, int64_t k)
{
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * k * LINEAR_NR;
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < LINEAR_NR; j++) {
                const int64_t col = p * LINEAR_NR + j;
                dst[kk * LINEAR_NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
    }
}

void inflight_linear_f32(const float *x, const float *packed, const float *bias, float *y,
                         int64_t m, int64_t n, int64_t k)
{
    const int64_t panels = (n + LINEAR_NR - 1) / LINEAR_NR;
#pragma omp parallel for schedule(static) if (m * n * k > PARALLEL_MIN_WORK)
    for (int64_t p = 0; p < panels; p++) {
        const int64_t col = p * LINEAR_NR;
        linear_panel(x, m, k, packed + p * k * LINEAR_NR, WEIGHTS_F32, NULL, bias, y, n, col,
                     n - col < LINEAR_NR ? n - col : LINEAR_NR,
                     p + 1 < panels ? packed + (p + 1) * k * LINEAR_NR : NULL);
    }
}

/* Store each token's K and V rows (rows k_stride / v_stride floats apart, each
 * [num_kv_heads, head_dim]) at its slot in the head-major caches [num_kv_heads,
 * num_slots, head_dim]: float32, or bf16 (rounded to nearest even) when
 * kv_bf16. */
void inflight_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       void *k_cache, void *v_cache, int64_t kv_bf16, const int64_t *slots,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t num_slots,
                       int64_t head_dim)
{
    const size_t row = (size_t)head_dim * sizeof(float);
#pragma omp parallel for if (num_tokens * num_kv_heads * head_dim > PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < num_tokens; t++) {
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = (h * num_slots + slots[t]) * head_dim;
            const float *kt = k + t * k_stride + h * head_dim;
            const float *vt = v + t * v_stride + h * head_dim;
            if (kv_bf16) {
                floats_to_bf16(kt, (uint16_t *)k_cache + dst, head_dim);
                floats_to_bf16(vt, (uint16_t *)v_cache + dst, head_dim);
            } else {
                memcpy((float *)k_cache + dst, kt, row);
                memcpy((float *)v_cache + dst, vt, row);
            }
        }
    }
}

/* Rotary position embedding in place, "rotate half" convention: in each of the
 * first num_heads heads of every row of x [num_tokens, row_stride], element i
 * pairs with i + head_dim/2. cos/sin are [max_positions, head_dim/2]. */
void inflight_rotary_f32(float *x, int64_t num_tokens, int64_t row_stride, int64_t num_heads,
                         int64_t head_dim, const int64_t *positions, const float *cos,
                         const float *sin)
{
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (num_tokens * num_heads * head_dim > PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *c = cos + positions[t] * half;
        const float *s = sin + positions[t] * half;
        for (int64_t h = 0; h < num_heads; h++) {
            float *x1 = x + t * row_stride + h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* residual += x, then out = residual / rms(residual) * weight, per row. */
void inflight_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                               int64_t num_tokens, int64_t hidden, float eps)
{
#pragma omp parallel for if (num_tokens * hidden > PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *xt = x + t * hidden;
        float *rt = residual + t * hidden;
        float *ot = out + t * hidden;
        float sum = 0.0f;
#pragma omp simd reduction(+:sum)
        for (int64_t i = 0; i < hidden; i++) {
            const float r = rt[i] + xt[i];
            rt[i] = r;
            sum += r * r;
        }
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; i++)
            ot[i] = rt[i] * inv * weight[i];
    }
}

/* out[t, i] = silu(x[t, i]) * x[t, size + i] for x [num_tokens, 2 * size]. */
void inflight_silu_and_mul_f32(const float *x, float *out, int64_t num_tokens, int64_t size)
{
#pragma omp parallel for if (num_tokens * size > PARALLEL_MIN_WORK)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *gate = x + t * 2 * size;
        const float *up = gate + size;
        float *ot = out + t * size;
#pragma omp simd
        for (int64_t i = 0; i < size; i++) {
            /* sigmoid from exp(-|g|), which cannot overflow; libm's expf
             * would be a scalar call per element (most of a batched step's
             * time outside the matrix products). */
            const float g = gate[i], e = exp_nonpositive(-fabsf(g));
            const float sigmoid = (g >= 0.0f ? 1.0f : e) / (1.0f + e);
            ot[i] = g * sigmoid * up[i];
        }
    }
}
