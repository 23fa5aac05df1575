/* bfloat16: the high half of a float32 (its sign, exponent and 7 fraction
 * bits). Widening is exact (a 16-bit shift); narrowing rounds to nearest
 * even, as PyTorch does, so that a cache the kernels write holds what
 * Tensor.to(torch.bfloat16) would. */
#ifndef INFLIGHT_BF16_H
#define INFLIGHT_BF16_H

#include <stdint.h>

#include "isa.h"

typedef uint16_t v8u16 __attribute__((vector_size(16), aligned(2), may_alias));

static inline uint16_t bf16_from_float(float f)
{
    union { float f; uint32_t u; } v = { .f = f };
    if (f != f)
        return 0x7fc0;  /* a quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float bf16_to_float(uint16_t h)
{
    union { uint32_t u; float f; } v = { .u = (uint32_t)h << 16 };
    return v.f;
}

/* 8 bf16 at p as floats. */
static inline __attribute__((always_inline)) v8f bf16x8_to_float(const uint16_t *p)
{
    return (v8f)(__builtin_convertvector(*(const v8u16 *)p, v8u) << 16);
}

/* n floats to bf16. */
static inline void floats_to_bf16(const float *x, uint16_t *out, int64_t n)
{
#pragma omp simd
    for (int64_t i = 0; i < n; i++)
        out[i] = bf16_from_float(x[i]);
}

#endif
