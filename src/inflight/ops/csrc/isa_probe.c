/* What this CPU and its operating system let a process run: built with no
 * instruction-set flags (it runs anywhere), loaded before the kernels, so
 * that ops/cpu_isa.py can pick the build of the kernels to load.
 *
 * A feature counts only if the CPU has it (CPUID) and the operating system
 * saves its registers across context switches (XCR0, read with XGETBV): the
 * 256-bit state for AVX and its successors, the opmask and 512-bit states
 * for AVX-512. Names follow Linux's /proc/cpuinfo flags.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

/* XCR0 bits: SSE and AVX state (1, 2); opmask, ZMM0-15 upper halves, ZMM16-31 (5-7). */
#define XCR0_AVX 0x06u
#define XCR0_AVX512 0xe6u

static uint64_t xcr0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static void add(char *out, size_t size, int present, const char *name)
{
    if (!present)
        return;
    if (out[0] != '\0')
        strncat(out, " ", size - strlen(out) - 1);
    strncat(out, name, size - strlen(out) - 1);
}

/* Space-separated feature names (a static buffer, filled on the first call). */
const char *inflight_cpu_features(void)
{
    static char names[256];
    if (names[0] != '\0')
        return names;
    uint32_t a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return names;
    const int osxsave = (c >> 27) & 1;
    const uint64_t xcr = osxsave ? xcr0() : 0;
    const int os_avx = (xcr & XCR0_AVX) == XCR0_AVX;
    const int os_avx512 = os_avx && (xcr & XCR0_AVX512) == XCR0_AVX512;
    add(names, sizeof names, os_avx && ((c >> 28) & 1), "avx");
    add(names, sizeof names, os_avx && ((c >> 12) & 1), "fma");
    add(names, sizeof names, os_avx && ((c >> 29) & 1), "f16c");
    uint32_t max_sub = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        max_sub = a;
        add(names, sizeof names, os_avx && ((b >> 5) & 1), "avx2");
        add(names, sizeof names, os_avx512 && ((b >> 16) & 1), "avx512f");
        add(names, sizeof names, os_avx512 && ((b >> 17) & 1), "avx512dq");
        add(names, sizeof names, os_avx512 && ((b >> 28) & 1), "avx512cd");
        add(names, sizeof names, os_avx512 && ((b >> 30) & 1), "avx512bw");
        add(names, sizeof names, os_avx512 && ((b >> 31) & 1), "avx512vl");
        add(names, sizeof names, os_avx512 && ((c >> 11) & 1), "avx512_vnni");
    }
    if (max_sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d))
        add(names, sizeof names, os_avx512 && ((a >> 5) & 1), "avx512_bf16");
    return names;
}

#else

const char *inflight_cpu_features(void)
{
    return "";
}

#endif
