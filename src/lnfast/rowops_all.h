/* Instantiates rowops.h for every storage type, after the settings it shares.
 *
 * Runtime dispatch: on x86-64 Linux the row sweeps are built for AVX-512,
 * AVX2 and the SSE2 baseline, each with vectors of its own width, and
 * picked at run time (below); with glibc the small row helpers here are
 * compiled the same three ways by target_clones (LNF_DISPATCH).  Elsewhere
 * the baseline is used.  A build never needs -march=native, and
 * -ffp-contract=off keeps every version's rounding the same (no fused
 * multiply-add).
 */
#ifndef LNFAST_ROWOPS_ALL_H
#define LNFAST_ROWOPS_ALL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Independent float64 accumulators per sum: two vectors of 8. */
#define LNF_LANES 16
/* Terms per lane summed in the element type before widening (rowops.h). */
#define LNF_BLOCK 4

#if defined(__GNUC__) && (defined(__clang__) ? __clang_major__ >= 10 : __GNUC__ >= 9) \
    && !defined(LNFAST_NO_VECTOR)    /* (the plain C path, for tests) */
#define LNF_VECTOR 1
/* Vectors of each instance's own width (LNF_VB, below): 64 bytes for the
 * AVX-512 sweeps, 32 for AVX2, 16 at the baseline (SSE2, NEON).  A vector
 * wider than the target's registers is split by GCC through the stack
 * (AVX2 float32 forward at 512x1024: twice the time, docs/performance.md).
 * lnf_vfN: N float32; lnf_vhN: N float16/bfloat16 bits. */
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
 * Linux allows (glibc and musl).  target_clones (LNF_DISPATCH, for the
 * small row helpers) also needs glibc's ifunc. */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) \
    && !defined(LNFAST_NO_DISPATCH) && (defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 8)
#define LNF_CPU_DISPATCH 1
#else
#define LNF_CPU_DISPATCH 0
#endif
#if LNF_CPU_DISPATCH && defined(__GLIBC__) && defined(__ELF__)
#define LNF_DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LNF_DISPATCH
#endif
/* The row sweeps per instruction set (below), and those with the
 * AVX512-BF16 conversion instruction (its target attribute and
 * __builtin_cpu_supports name are safe from GCC 11; clang is 14 here). */
#define LNF_X86_SWEEPS (LNF_CPU_DISPATCH && LNF_VECTOR)
#if LNF_X86_SWEEPS && (defined(__clang__) || __GNUC__ >= 11)
#define LNF_BF16_SWEEPS 1
#else
#define LNF_BF16_SWEEPS 0
#endif

/* Streaming (non-temporal) stores of the sweeps' outputs, for long rows
 * (the drivers decide, _cpu.pyx STREAM_ROW_BYTES): SSE2's, part of every
 * x86-64 CPU, 16 bytes at a time; plain stores elsewhere. */
#if LNF_VECTOR && (defined(__x86_64__) || defined(_M_X64))
#include <emmintrin.h>
#define LNF_CAN_STREAM 1
typedef long long lnf_vi128 __attribute__((vector_size(16)));
#else
#define LNF_CAN_STREAM 0
#endif

/* Orders the streaming stores before what follows (another thread may read
 * them after a barrier): for sweeps told to leave the fence to their
 * caller (LNF_STREAM_NOFENCE), whose per-call fence would wait on every
 * column block's stores to drain. */
#define LNF_STREAM_NOFENCE 2
static inline void lnf_stream_fence(void)
{
#if LNF_CAN_STREAM
    _mm_sfence();
#endif
}

/* How far ahead of its reads a sweep prefetches the row it sums, running
 * on into the row after it: the hardware prefetchers stop at each 4 KiB
 * page, which is every row for D = 1024 float32. */
#ifndef LNF_PREFETCH_BYTES
#define LNF_PREFETCH_BYTES 2048
#endif
#if defined(__GNUC__)
#define LNF_PREFETCH(p) __builtin_prefetch((p), 0, 3)
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

/* dw[j] += g[j], then g[j] = 0, for j < n: the backward's float32 runs of
 * dweight/dbias terms added into its float64 partial rows (_cpu.pyx,
 * RUN_ROWS).  A chunk's first run (first != 0) adds to 0.0 instead of
 * reading dw, so its rows need no zeroing.
 * Element by element: the same bits on every path. */
LNF_DISPATCH static void lnf_add_run(double *__restrict dw, float *__restrict g, ptrdiff_t n,
                                     int first)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        dw[j] = (first ? 0.0 : dw[j]) + g[j];
        g[j] = 0.0f;
    }
}

#include "halfconv.h"

/* Row data is stored as LNF_S and computed in LNF_T.  On x86-64 Linux
 * (LNF_CPU_DISPATCH) each family is built three times, each with vectors
 * of its target's width (LNF_VB bytes): for AVX-512, for AVX2 and for the
 * SSE2 baseline; the wrappers below pick one at run time.  The
 * 16-bit families use the conversion instructions there (F16C for float16,
 * which target_clones cannot request).  Elsewhere the baseline is built
 * (NEON on aarch64, with NEON conversions for 16-bit rows).  All give the
 * same bits. */
#define LNF_AVX512 __attribute__((target("avx512f")))
#define LNF_AVX2 __attribute__((target("avx2")))

#define LNF_T float
#define LNF_DOUBLE 0
#define LNF_S float
#define LNF_STORAGE16 0
#define LNF_ATTR
#define LNF_SUFFIX f32p
#define LNF_VB 16
#include "rowops.h"
#if LNF_X86_SWEEPS
#define LNF_ATTR LNF_AVX512
#define LNF_SUFFIX f32x512
#define LNF_VB 64
#include "rowops.h"
#define LNF_ATTR LNF_AVX2
#define LNF_SUFFIX f32x256
#define LNF_VB 32
#include "rowops.h"
#endif
#undef LNF_S
#undef LNF_STORAGE16

#define LNF_S uint16_t
#define LNF_STORAGE16 1

#define LNF_TO_F32 lnf_f16_to_f32
#define LNF_FROM_F32 lnf_f32_to_f16
#define LNF_ATTR
#define LNF_SUFFIX f16p
#define LNF_VB 16
#define LNF_VWIDEN lnf_vwiden_f16
#define LNF_VNARROW lnf_vnarrow_f16
#include "rowops.h"
#if LNF_X86_SWEEPS
#define LNF_ATTR __attribute__((target("avx512f,f16c")))
#define LNF_SUFFIX f16x512
#define LNF_VB 64
#define LNF_VWIDEN lnf_vwiden_f16c512
#define LNF_VNARROW lnf_vnarrow_f16c512
#include "rowops.h"
#define LNF_ATTR __attribute__((target("avx2,f16c")))
#define LNF_SUFFIX f16x256
#define LNF_VB 32
#define LNF_VWIDEN lnf_vwiden_f16c256
#define LNF_VNARROW lnf_vnarrow_f16c256
#include "rowops.h"
#endif
#if LNF_A64_SWEEPS
#define LNF_ATTR
#define LNF_SUFFIX f16a64
#define LNF_VB 16
#define LNF_VWIDEN lnf_vwiden_f16a64
#define LNF_VNARROW lnf_vnarrow_f16a64
#include "rowops.h"
#endif
#undef LNF_TO_F32
#undef LNF_FROM_F32

#define LNF_TO_F32 lnf_bf16_to_f32
#define LNF_FROM_F32 lnf_f32_to_bf16
#define LNF_ATTR
#define LNF_SUFFIX bf16p
#define LNF_VB 16
#define LNF_VWIDEN lnf_vwiden_bf16
#define LNF_VNARROW lnf_vnarrow_bf16
#include "rowops.h"
#if LNF_X86_SWEEPS
#define LNF_ATTR LNF_AVX512
#define LNF_SUFFIX bf16x512
#define LNF_VB 64
#define LNF_VWIDEN lnf_vwiden_bf16x512
#define LNF_VNARROW lnf_vnarrow_bf16x512
#include "rowops.h"
#if LNF_BF16_SWEEPS
#define LNF_ATTR __attribute__((target("avx512f,avx512dq,avx512bw,avx512bf16")))
#define LNF_SUFFIX bf16b512
#define LNF_VB 64
#define LNF_VWIDEN lnf_vwiden_bf16b512
#define LNF_VNARROW lnf_vnarrow_bf16b512
#define LNF_VNARROW2 lnf_vnarrow2_bf16b512
#include "rowops.h"
#endif
#define LNF_ATTR LNF_AVX2
#define LNF_SUFFIX bf16x256
#define LNF_VB 32
#define LNF_VWIDEN lnf_vwiden_bf16x256
#define LNF_VNARROW lnf_vnarrow_bf16x256
#include "rowops.h"
#endif
#if LNF_A64_SWEEPS
#define LNF_ATTR
#define LNF_SUFFIX bf16a64
#define LNF_VB 16
#define LNF_VWIDEN lnf_vwiden_bf16a64
#define LNF_VNARROW lnf_vnarrow_bf16a64
#include "rowops.h"
#endif
#undef LNF_TO_F32
#undef LNF_FROM_F32
#undef LNF_T
#undef LNF_DOUBLE
#undef LNF_S
#undef LNF_STORAGE16

#define LNF_T double
#define LNF_DOUBLE 1
#define LNF_S double
#define LNF_STORAGE16 0
#define LNF_ATTR
#define LNF_SUFFIX f64p
#define LNF_VB 16
#include "rowops.h"
#if LNF_X86_SWEEPS
#define LNF_ATTR LNF_AVX512
#define LNF_SUFFIX f64x512
#define LNF_VB 64
#include "rowops.h"
#define LNF_ATTR LNF_AVX2
#define LNF_SUFFIX f64x256
#define LNF_VB 32
#include "rowops.h"
#endif
#undef LNF_T
#undef LNF_DOUBLE
#undef LNF_S
#undef LNF_STORAGE16
#undef LNF_AVX512
#undef LNF_AVX2

/* The sweeps in use: the AVX-512 build (with its BF16 instructions for
 * bfloat16) or the AVX2 build where the CPU has them (and F16C for
 * float16), else the baseline; on aarch64 the NEON conversions for 16-bit
 * rows.  Tests ask for less through lnf_simd_path; all give the same bits. */
/* The sweeps' level for rows of a type (f16c: the type needs F16C): 2 the
 * AVX-512 build, 1 AVX2, 0 the baseline. */
static inline int lnf_sweep_level(int f16c)
{
#if LNF_X86_SWEEPS
    if (lnf_simd_path < 3 && (!f16c || lnf_has_f16c())) {
        if (lnf_simd_path < 2 && __builtin_cpu_supports("avx512f"))
            return 2;
        if (__builtin_cpu_supports("avx2"))
            return 1;
    }
#else
    (void)f16c;
#endif
    return 0;
}

/* The instruction set the row sweeps run with here (for float32 rows). */
static inline const char *lnf_simd_runtime(void)
{
#if LNF_X86_SWEEPS
    static const char *const names[] = {"SSE2 (runtime dispatch)", "AVX2 (runtime dispatch)",
                                        "AVX-512 (runtime dispatch)"};
    return names[lnf_sweep_level(0)];
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

#if LNF_X86_SWEEPS
#define LNF_PICK(name, kind, f16c, ...)                                      \
    do {                                                                     \
        int level_ = lnf_sweep_level(f16c);                                  \
        if (level_ == 2)                                                     \
            LNF_BEST512_##kind(name, __VA_ARGS__);                           \
        else if (level_ == 1)                                                \
            name##_##kind##x256(__VA_ARGS__);                                \
        else                                                                 \
            name##_##kind##p(__VA_ARGS__);                                   \
    } while (0)
#define LNF_BEST512_f32(name, ...) name##_f32x512(__VA_ARGS__)
#define LNF_BEST512_f64(name, ...) name##_f64x512(__VA_ARGS__)
#define LNF_BEST512_f16(name, ...) name##_f16x512(__VA_ARGS__)
#if LNF_BF16_SWEEPS
#define LNF_BEST512_bf16(name, ...)                                              \
    (lnf_simd_path < 1 && __builtin_cpu_supports("avx512bf16")                   \
             && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw")   \
         ? name##_bf16b512(__VA_ARGS__)                                          \
         : name##_bf16x512(__VA_ARGS__))
#else
#define LNF_BEST512_bf16(name, ...) name##_bf16x512(__VA_ARGS__)
#endif
#elif LNF_A64_SWEEPS
/* aarch64: the NEON conversions for 16-bit rows, unless tests asked for
 * the portable code. */
#define LNF_PICK(name, kind, f16c, ...) LNF_A64_##kind(name, __VA_ARGS__)
#define LNF_A64_f32(name, ...) name##_f32p(__VA_ARGS__)
#define LNF_A64_f64(name, ...) name##_f64p(__VA_ARGS__)
#define LNF_A64_f16(name, ...) \
    (lnf_simd_path < 3 ? name##_f16a64(__VA_ARGS__) : name##_f16p(__VA_ARGS__))
#define LNF_A64_bf16(name, ...) \
    (lnf_simd_path < 3 ? name##_bf16a64(__VA_ARGS__) : name##_bf16p(__VA_ARGS__))
#else
#define LNF_PICK(name, kind, f16c, ...) name##_##kind##p(__VA_ARGS__)
#endif

#define LNF_DEFINE_PICKED_SWEEPS(kind, f16c, S, T)                                          \
    static void lnf_row_pipe_##kind(const S *x, S *y, const T *w, const T *b, T hi, T lo,     \
                                    T rs, const S *xn, const S *rn, S *zn, int centered,     \
                                    double *s, ptrdiff_t n, const S *xf, const S *rf,        \
                                    int stream)                                              \
    {                                                                                        \
        LNF_PICK(lnf_row_pipe, kind, f16c, x, y, w, b, hi, lo, rs, xn, rn, zn, centered, s, \
                 n, xf, rf, stream);                                                         \
    }                                                                                        \
    static void lnf_row_grad_pipe_##kind(const S *x, const S *dy, const S *dz, S *dx,        \
                                         const T *k, T *dw, T *db, const S *xn,              \
                                         const S *dyn, T mean_n, double *out, const T *w,    \
                                         ptrdiff_t n, const S *xf, const S *dyf, int stream) \
    {                                                                                        \
        LNF_PICK(lnf_row_grad_pipe, kind, f16c, x, dy, dz, dx, k, dw, db, xn, dyn, mean_n,  \
                 out, w, n, xf, dyf, stream);                                                \
    }
LNF_DEFINE_PICKED_SWEEPS(f32, 0, float, float)
LNF_DEFINE_PICKED_SWEEPS(f64, 0, double, double)
LNF_DEFINE_PICKED_SWEEPS(f16, 1, uint16_t, float)
LNF_DEFINE_PICKED_SWEEPS(bf16, 0, uint16_t, float)
#undef LNF_DEFINE_PICKED_SWEEPS
#undef LNF_PICK
#undef LNF_BEST512_f32
#undef LNF_BEST512_f64
#undef LNF_BEST512_f16
#undef LNF_BEST512_bf16
#undef LNF_A64_f32
#undef LNF_A64_f64
#undef LNF_A64_f16
#undef LNF_A64_bf16

#endif
