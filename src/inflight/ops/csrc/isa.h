/* The vector types every kernel source uses, and the instruction-set paths
 * this build takes. ops/cpu_isa.py builds the kernels once per target, with
 * the target's -m flags and these macros:
 *   INFLIGHT_AVX512_VNNI  int8 dot products with vpdpbusd on 512-bit vectors
 *   INFLIGHT_AVX512_BF16  bf16 dot products with vdpbf16ps on 512-bit vectors
 *   INFLIGHT_SIMDE        those two instructions from SIMDe's portable
 *                         implementations (a test build for AVX2 machines:
 *                         the AVX-512 kernels' logic, run where AVX-512 is not)
 * The AVX2 paths follow the compiler's own __AVX2__; everything else is GCC
 * vector extensions, compiled to whatever the flags allow (a generic build
 * runs on any CPU). INFLIGHT_ISA_NAME names the build.
 */
#ifndef INFLIGHT_ISA_H
#define INFLIGHT_ISA_H

#include <stdint.h>

#ifndef INFLIGHT_ISA_NAME
#define INFLIGHT_ISA_NAME "unnamed"
#endif

/* Loads and stores through these may be unaligned. */
typedef float v8f __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t v8i __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint32_t v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef float v16f __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4), may_alias));

#if defined(INFLIGHT_AVX512_VNNI) || defined(INFLIGHT_AVX512_BF16)
#ifdef INFLIGHT_SIMDE
#include <simde/x86/avx512/dpbf16.h>
#include <simde/x86/avx512/dpbusd.h>
#define ISA512(fn) simde_##fn
/* Not inlined: SIMDe's long emulations at every call site made the build
 * minutes long; speed is not what this build is for. */
#define DOT512 static __attribute__((noinline))
typedef simde__m512 m512;
typedef simde__m512i m512i;
typedef simde__m512bh m512bh;
#else
#if (defined(INFLIGHT_AVX512_VNNI) && !defined(__AVX512VNNI__)) || \
    (defined(INFLIGHT_AVX512_BF16) && !defined(__AVX512BF16__))
#error "the AVX-512 paths need their -m flags (or INFLIGHT_SIMDE)"
#endif
#include <immintrin.h>
#define ISA512(fn) _##fn
#define DOT512 static inline __attribute__((always_inline))
typedef __m512 m512;
typedef __m512i m512i;
typedef __m512bh m512bh;
#endif
#endif

#ifdef INFLIGHT_AVX512_BF16
/* Lane j: acc[j] + a[2j] b[2j] + a[2j+1] b[2j+1], a and b 32 bf16 each. */
DOT512 v16f dot_bf16_pairs(v16f acc, v16i a, v16i b)
{
    return (v16f)ISA512(mm512_dpbf16_ps)((m512)acc, (m512bh)a, (m512bh)b);
}
#endif

#ifdef INFLIGHT_AVX512_VNNI
/* Lane j: acc[j] + the sum over i < 4 of u[4j + i] s[4j + i], u unsigned bytes,
 * s signed ones, in int32 without saturation. */
DOT512 v16i dot_u8s8_quads(v16i acc, v16i u, v16i s)
{
    return (v16i)ISA512(mm512_dpbusd_epi32)((m512i)acc, (m512i)u, (m512i)s);
}
#endif

#endif
