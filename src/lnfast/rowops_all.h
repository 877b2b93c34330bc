/* Instantiates rowops.h for float and double, after the settings it shares.
 *
 * Runtime dispatch: on x86-64 Linux (glibc ifunc) each row primitive is
 * compiled for AVX-512, AVX2 and the SSE2 baseline, and the loader picks the
 * best the CPU has.  Elsewhere the baseline is used.  A build never needs
 * -march=native, and -ffp-contract=off keeps every version's rounding the
 * same (no fused multiply-add).
 */
#ifndef LNFAST_ROWOPS_ALL_H
#define LNFAST_ROWOPS_ALL_H

#include <stddef.h>
#include <string.h>

/* Independent float64 accumulators per sum; a multiple of 8. */
#define LNF_LANES 16

#if defined(__GNUC__) && (defined(__clang__) ? __clang_major__ >= 10 : __GNUC__ >= 9)
#define LNF_VECTOR 1
typedef double lnf_vd __attribute__((vector_size(8 * sizeof(double))));
#else
#define LNF_VECTOR 0
#endif

#if defined(__GNUC__) && defined(__x86_64__) && defined(__GLIBC__) && defined(__ELF__) \
    && !defined(LNFAST_NO_DISPATCH) && (defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 8)
#define LNF_DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
#define LNF_HAVE_DISPATCH 1
#else
#define LNF_DISPATCH
#define LNF_HAVE_DISPATCH 0
#endif

#if defined(__clang__)
#define LNF_IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define LNF_IVDEP _Pragma("GCC ivdep")
#else
#define LNF_IVDEP
#endif

#if defined(__GNUC__)
#define LNF_PREFETCH(p) __builtin_prefetch((p), 0, 2)
#else
#define LNF_PREFETCH(p) ((void)(p))
#endif

/* Pairwise fold of the lanes: halves added in place, in a fixed order. */
static inline double lnf_fold(double *s)
{
    for (int h = LNF_LANES / 2; h > 0; h /= 2)
        for (int k = 0; k < h; k++)
            s[k] += s[k + h];
    return s[0];
}

/* The instruction set the dispatched row primitives run with here. */
static inline const char *lnf_simd_runtime(void)
{
#if LNF_HAVE_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        return "AVX-512 (runtime dispatch)";
    if (__builtin_cpu_supports("avx2"))
        return "AVX2 (runtime dispatch)";
    return "SSE2 (runtime dispatch)";
#elif defined(__AVX512F__)
    return "AVX-512";
#elif defined(__AVX2__)
    return "AVX2";
#elif defined(__SSE2__) || defined(_M_X64)
    return "SSE2";
#elif defined(__ARM_NEON) || defined(_M_ARM64)
    return "NEON";
#else
    return "none";
#endif
}

#define LNF_T float
#define LNF_SUFFIX f32
#include "rowops.h"
#undef LNF_T
#undef LNF_SUFFIX

#define LNF_T double
#define LNF_SUFFIX f64
#include "rowops.h"
#undef LNF_T
#undef LNF_SUFFIX

#include "halfconv.h"

#endif
