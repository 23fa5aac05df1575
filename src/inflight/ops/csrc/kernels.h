/* The kernels one C source calls in another (exported: ctypes calls some too). */
#ifndef INFLIGHT_KERNELS_H
#define INFLIGHT_KERNELS_H

#include <stdint.h>

int inflight_paged_attention(
    const float *q, int64_t q_stride, float *out, int64_t out_stride, int64_t num_queries,
    const void *k_cache, const void *v_cache, int64_t kv_bf16, int64_t num_blocks,
    int64_t block_size,
    const int64_t *block_tables, const int64_t *row_tables, int64_t max_blocks,
    const int64_t *seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window, float softcap);
void inflight_linear_f32(const float *x, const float *packed, const float *bias, float *y,
                         int64_t m, int64_t n, int64_t k);
void inflight_write_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                       void *k_cache, void *v_cache, int64_t kv_bf16, const int64_t *slots,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t num_slots,
                       int64_t head_dim);
void inflight_rotary_f32(float *x, int64_t num_tokens, int64_t row_stride, int64_t num_heads,
                         int64_t head_dim, const int64_t *positions, const float *cos,
                         const float *sin);
void inflight_add_rms_norm_f32(const float *x, float *residual, const float *weight, float *out,
                               int64_t num_tokens, int64_t hidden, float eps);
void inflight_silu_and_mul_f32(const float *x, float *out, int64_t num_tokens, int64_t size);
int inflight_quant_linear(int64_t fmt, const float *x, const uint8_t *packed, const float *scale,
                          const float *bias, float *y, int64_t m, int64_t n, int64_t k);
void inflight_quant_embedding(int64_t fmt, const int64_t *ids, int64_t num_tokens,
                              const uint8_t *packed, const float *scale, float *out, int64_t k);
/* bf16_kernels.c: bf16 panels (linear_kernel.h); int8_kernels.c: W8A8 panels.
 * The linear layers return 0, or -1 if scratch memory ran out; a row is an
 * embedding lookup (row id of W, as floats). */
int inflight_bf16_linear(const float *x, const uint8_t *packed, const float *bias, float *y,
                         int64_t m, int64_t n, int64_t k);
void inflight_bf16_row(const uint8_t *packed, int64_t k, int64_t id, float *out);
int inflight_w8a8_linear(const float *x, const uint8_t *packed, const float *scale,
                         const float *bias, float *y, int64_t m, int64_t n, int64_t k);
void inflight_w8a8_row(const uint8_t *packed, const float *scale, int64_t k, int64_t id,
                       float *out);
int64_t inflight_w8a8_panel_bytes(int64_t k);
/* quant_kernels.c: the bytes of one panel (16 output columns) of a weight of K
 * inputs in format fmt (a QUANT_* code). */
int64_t inflight_panel_bytes(int64_t fmt, int64_t k);
/* greedy_head.c: each row's greedy token of x W^T + bias (the first index of
 * its largest value) and whether all its values were finite, without writing
 * them out; fmt a QUANT_* code, or GREEDY_F32 for float32 panels. 0, -1 if
 * scratch memory ran out, or -2 for an unknown format. */
#define GREEDY_F32 -1
int inflight_greedy_linear(int64_t fmt, const float *x, const uint8_t *packed, const float *scale,
                           const float *bias, int64_t m, int64_t n, int64_t k, int64_t *tokens,
                           uint8_t *finite);

#endif
