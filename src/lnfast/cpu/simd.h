/* What the compiler and target allow: vector extensions, the instruction
 * sets built for run-time dispatch, streaming stores, prefetches.
 *
 * On x86-64 Linux the row operations are built for AVX-512, AVX2 and the
 * SSE2 baseline, each in units of their own (rows_*.c), and one is chosen
 * once per storage type (lnf_select, dispatch.c).  Elsewhere the baseline is
 * built (NEON on aarch64, with NEON conversions for 16-bit rows).  A build
 * never needs -march=native, and -ffp-contract=off keeps every version's
 * rounding the same (no fused multiply-add).
 */
#ifndef LNFAST_CPU_SIMD_H
#define LNFAST_CPU_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "config.h"

#if defined(__GNUC__) && (defined(__clang__) ? __clang_major__ >= 10 : __GNUC__ >= 9) \
    && !defined(LNFAST_NO_VECTOR)    /* (the plain C path, for tests) */
#define LNF_VECTOR 1
/* lnf_vfN: N float32; lnf_vhN: N float16/bfloat16 bits. */
typedef float lnf_vf16 __attribute__((vector_size(64)));
typedef uint16_t lnf_vh16 __attribute__((vector_size(32)));
typedef uint16_t lnf_vh32 __attribute__((vector_size(64)));
typedef float lnf_vf8 __attribute__((vector_size(32)));
typedef uint16_t lnf_vh8 __attribute__((vector_size(16)));
typedef float lnf_vf4 __attribute__((vector_size(16)));
typedef uint32_t lnf_vu32x4 __attribute__((vector_size(16)));
typedef uint16_t lnf_vh4 __attribute__((vector_size(8)));
#else
#define LNF_VECTOR 0
#endif

/* Code built for AVX-512 or AVX2 and chosen at run time: target
 * attributes and __builtin_cpu_supports, which any C library on x86-64
 * Linux allows (glibc and musl).  target_clones (LNF_CLONES, for the
 * element-wise helpers of convert.c and backward.c and the tiles' row
 * statistics in forward_rows.h and backward_rows.h) also needs glibc's
 * ifunc, and goes on static functions only: clang (14 to 16) names an
 * external function's clones `name.ifunc`, which calls from other files
 * do not link to. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) \
    && !defined(LNFAST_NO_DISPATCH) && (defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 8)
#define LNF_CPU_DISPATCH 1
#else
#define LNF_CPU_DISPATCH 0
#endif
#if LNF_CPU_DISPATCH && defined(__GLIBC__) && defined(__ELF__)
#define LNF_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LNF_CLONES
#endif
/* The row-operation units per instruction set, and those with the
 * AVX512-BF16 conversion instruction (its target attribute and
 * __builtin_cpu_supports name are safe from GCC 11; clang is 14 here). */
#define LNF_X86_UNITS (LNF_CPU_DISPATCH && LNF_VECTOR)
#if LNF_X86_UNITS && (defined(__clang__) || __GNUC__ >= 11)
#define LNF_BF16_UNITS 1
#else
#define LNF_BF16_UNITS 0
#endif
/* aarch64: NEON conversions for 16-bit rows (halfconv.h). */
#if LNF_VECTOR && defined(__aarch64__)
#define LNF_NEON_UNITS 1
#else
#define LNF_NEON_UNITS 0
#endif

/* Streaming (non-temporal) stores of the outputs of long rows: SSE2's,
 * part of every x86-64 CPU, 16 bytes at a time; plain stores elsewhere. */
#if LNF_VECTOR && (defined(__x86_64__) || defined(_M_X64))
#include <emmintrin.h>
#define LNF_CAN_STREAM 1
typedef long long lnf_vi128 __attribute__((vector_size(16)));
#else
#define LNF_CAN_STREAM 0
#endif

/* Row operations told to leave the fence after their streaming stores to
 * the caller (stream flag LNF_STREAMED | LNF_STREAM_NOFENCE), whose per-call
 * fence would wait on every column block's stores to drain. */
#define LNF_STREAMED 1
#define LNF_STREAM_NOFENCE 2
static inline void lnf_stream_fence(void)
{
#if LNF_CAN_STREAM
    _mm_sfence();
#endif
}

#if defined(__GNUC__)
#define LNF_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#define LNF_PREFETCH_L2(p) __builtin_prefetch((p), 0, 1)
#define LNF_PREFETCHW(p) __builtin_prefetch((p), 1, 3)
#define LNF_INLINE static inline __attribute__((always_inline))
#else
#define LNF_PREFETCH(p) ((void)(p))
#define LNF_PREFETCH_L2(p) ((void)(p))
#define LNF_PREFETCHW(p) ((void)(p))
#define LNF_INLINE static inline
#endif

#endif
