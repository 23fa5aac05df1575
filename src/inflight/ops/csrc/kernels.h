/* The kernels one C source calls in another (all exported for ctypes too). */
#ifndef INFLIGHT_KERNELS_H
#define INFLIGHT_KERNELS_H

#include <stdint.h>

int inflight_paged_attention_f32(
    const float *q, int64_t q_stride, float *out, int64_t out_stride, int64_t num_queries,
    const float *k_cache, const float *v_cache, int64_t num_blocks, int64_t block_size,
    const int64_t *block_tables, const int64_t *row_tables, int64_t max_blocks,
    const int64_t *seq_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    float scale, int64_t window);
void inflight_linear_f32(const float *x, const float *packed, const float *bias, float *y,
                         int64_t m, int64_t n, int64_t k);
void inflight_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                           float *k_cache, float *v_cache, const int64_t *slots,
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

#endif
