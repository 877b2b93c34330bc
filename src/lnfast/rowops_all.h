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
#include <stdint.h>
#include <string.h>

/* Independent float64 accumulators per sum: two vectors of 8. */
#define LNF_LANES 16
/* Terms per lane summed in the element type before widening (rowops.h). */
#define LNF_BLOCK 4

#if defined(__GNUC__) && (defined(__clang__) ? __clang_major__ >= 10 : __GNUC__ >= 9) \
    && !defined(LNFAST_NO_VECTOR)    /* (the plain C path, for tests) */
#define LNF_VECTOR 1
/* 64-byte vectors: one AVX-512 register, split by the compiler below. */
typedef double lnf_vd __attribute__((vector_size(64)));
typedef double lnf_vd2 __attribute__((vector_size(128)));    /* two of them */
typedef float lnf_vf __attribute__((vector_size(64)));        /* 16 float32 */
typedef uint32_t lnf_vu32 __attribute__((vector_size(64)));   /* their bits */
typedef uint16_t lnf_vu16 __attribute__((vector_size(32)));   /* 16 float16/bfloat16 */
typedef uint16_t lnf_vu16x32 __attribute__((vector_size(64))); /* 32 of them */
/* Half k (0 or 1) of an lnf_vd2.  Converting 16 floats to an lnf_vd2 and
 * taking halves compiles to two full-width conversions; converting halves
 * of the floats does not (GCC 12). */
#if defined(__clang__) || __GNUC__ >= 12
#define LNF_HALF(v, k) __builtin_shufflevector((v), (v), 8 * (k), 8 * (k) + 1, 8 * (k) + 2, \
                                               8 * (k) + 3, 8 * (k) + 4, 8 * (k) + 5,     \
                                               8 * (k) + 6, 8 * (k) + 7)
#else
#define LNF_HALF(v, k) ({ lnf_vd h_; memcpy(&h_, (const double *)&(v) + 8 * (k), sizeof h_); h_; })
#endif
#else
#define LNF_VECTOR 0
#endif

#if defined(__GNUC__) && defined(__x86_64__) && defined(__GLIBC__) && defined(__ELF__) \
    && !defined(LNFAST_NO_DISPATCH) && (defined(__clang__) ? __clang_major__ >= 14 : __GNUC__ >= 8)
#define LNF_DISPATCH __attribute__((target_clones("avx512f", "avx2", "default")))
#define LNF_HAVE_DISPATCH 1
/* The AVX512-BF16 conversion instruction (its target attribute and
 * __builtin_cpu_supports name are safe from GCC 11; clang is 14 here). */
#if LNF_VECTOR && (defined(__clang__) || __GNUC__ >= 11)
#define LNF_BF16_SWEEPS 1
#else
#define LNF_BF16_SWEEPS 0
#endif
#else
#define LNF_BF16_SWEEPS 0
#define LNF_DISPATCH
#define LNF_HAVE_DISPATCH 0
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

#include "halfconv.h"

/* Row data is stored as LNF_S and computed in LNF_T.  16-bit rows
 * (LNF_STORAGE16) are converted inside the sweeps; their sweeps are also
 * built for AVX-512 and AVX2 with the conversion instructions (F16C for
 * float16), which target_clones cannot pick (F16C is not part of "avx2"),
 * and chosen at run time below; on aarch64, for its NEON conversions. */
#define LNF_T float
#define LNF_NV 1        /* 64-byte vectors per LNF_LANES elements */
#define LNF_S float
#define LNF_STORAGE16 0
#define LNF_ATTR LNF_DISPATCH
#define LNF_SUFFIX f32
#include "rowops.h"
#undef LNF_S
#undef LNF_STORAGE16

#define LNF_S uint16_t
#define LNF_STORAGE16 1
#define LNF_X86_SWEEPS (LNF_HAVE_DISPATCH && LNF_VECTOR)

#define LNF_TO_F32 lnf_f16_to_f32
#define LNF_FROM_F32 lnf_f32_to_f16
#define LNF_ATTR LNF_DISPATCH
#define LNF_SUFFIX f16p
#define LNF_VWIDEN lnf_vwiden_f16
#define LNF_VNARROW lnf_vnarrow_f16
#include "rowops.h"
#if LNF_X86_SWEEPS
#define LNF_ATTR __attribute__((target("avx512f,f16c")))
#define LNF_SUFFIX f16x512
#define LNF_VWIDEN lnf_vwiden_f16c512
#define LNF_VNARROW lnf_vnarrow_f16c512
#include "rowops.h"
#define LNF_ATTR __attribute__((target("avx2,f16c")))
#define LNF_SUFFIX f16x256
#define LNF_VWIDEN lnf_vwiden_f16c256
#define LNF_VNARROW lnf_vnarrow_f16c256
#include "rowops.h"
#endif
#if LNF_A64_SWEEPS
#define LNF_ATTR
#define LNF_SUFFIX f16a64
#define LNF_VWIDEN lnf_vwiden_f16a64
#define LNF_VNARROW lnf_vnarrow_f16a64
#include "rowops.h"
#endif
#undef LNF_TO_F32
#undef LNF_FROM_F32

#define LNF_TO_F32 lnf_bf16_to_f32
#define LNF_FROM_F32 lnf_f32_to_bf16
#define LNF_ATTR LNF_DISPATCH
#define LNF_SUFFIX bf16p
#define LNF_VWIDEN lnf_vwiden_bf16
#define LNF_VNARROW lnf_vnarrow_bf16
#include "rowops.h"
#if LNF_X86_SWEEPS
#define LNF_ATTR __attribute__((target("avx512f")))
#define LNF_SUFFIX bf16x512
#define LNF_VWIDEN lnf_vwiden_bf16x512
#define LNF_VNARROW lnf_vnarrow_bf16x512
#include "rowops.h"
#if LNF_BF16_SWEEPS
#define LNF_ATTR __attribute__((target("avx512f,avx512dq,avx512bw,avx512bf16")))
#define LNF_SUFFIX bf16b512
#define LNF_VWIDEN lnf_vwiden_bf16b512
#define LNF_VNARROW lnf_vnarrow_bf16b512
#define LNF_VNARROW2 lnf_vnarrow2_bf16b512
#include "rowops.h"
#endif
#define LNF_ATTR __attribute__((target("avx2")))
#define LNF_SUFFIX bf16x256
#define LNF_VWIDEN lnf_vwiden_bf16x256
#define LNF_VNARROW lnf_vnarrow_bf16x256
#include "rowops.h"
#endif
#if LNF_A64_SWEEPS
#define LNF_ATTR
#define LNF_SUFFIX bf16a64
#define LNF_VWIDEN lnf_vwiden_bf16a64
#define LNF_VNARROW lnf_vnarrow_bf16a64
#include "rowops.h"
#endif
#undef LNF_TO_F32
#undef LNF_FROM_F32
#undef LNF_T
#undef LNF_NV
#undef LNF_S
#undef LNF_STORAGE16

#define LNF_T double
#define LNF_NV 2
#define LNF_S double
#define LNF_STORAGE16 0
#define LNF_ATTR LNF_DISPATCH
#define LNF_SUFFIX f64
#include "rowops.h"
#undef LNF_T
#undef LNF_NV
#undef LNF_S
#undef LNF_STORAGE16

/* The 16-bit sweeps in use: AVX-512 (with its BF16 instructions for
 * bfloat16) or AVX2 builds where the CPU has them (and F16C for float16),
 * or on aarch64 the NEON conversions, unless tests asked for less
 * (lnf_half_path); all give the same bits. */
#if LNF_X86_SWEEPS
#define LNF_PICK(name, kind, f16c, ...)                                      \
    do {                                                                     \
        if (lnf_half_path < 3 && (!(f16c) || lnf_has_f16c())) {            \
            if (lnf_half_path < 2 && __builtin_cpu_supports("avx512f")) {    \
                LNF_BEST512_##kind(name, __VA_ARGS__);                       \
                return;                                                      \
            }                                                                \
            if (__builtin_cpu_supports("avx2")) {                            \
                name##_##kind##x256(__VA_ARGS__);                            \
                return;                                                      \
            }                                                                \
        }                                                                    \
        name##_##kind##p(__VA_ARGS__);                                       \
    } while (0)
#define LNF_BEST512_f16(name, ...) name##_f16x512(__VA_ARGS__)
#if LNF_BF16_SWEEPS
#define LNF_BEST512_bf16(name, ...)                                              \
    (lnf_half_path < 1 && __builtin_cpu_supports("avx512bf16")                   \
             && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw")   \
         ? name##_bf16b512(__VA_ARGS__)                                          \
         : name##_bf16x512(__VA_ARGS__))
#else
#define LNF_BEST512_bf16(name, ...) name##_bf16x512(__VA_ARGS__)
#endif
#elif LNF_A64_SWEEPS
/* aarch64: the NEON conversions, unless tests asked for the portable code. */
#define LNF_PICK(name, kind, f16c, ...)                                      \
    do {                                                                     \
        if (lnf_half_path < 3)                                               \
            name##_##kind##a64(__VA_ARGS__);                                 \
        else                                                                 \
            name##_##kind##p(__VA_ARGS__);                                   \
    } while (0)
#else
#define LNF_PICK(name, kind, f16c, ...) name##_##kind##p(__VA_ARGS__)
#endif

#define LNF_DEFINE_PICKED_SWEEPS(kind, f16c)                                                \
    static void lnf_row_pipe_##kind(const uint16_t *x, uint16_t *y, const float *w,          \
                                    const float *b, float hi, float lo, float rs,            \
                                    const uint16_t *xn, const uint16_t *rn, uint16_t *zn,    \
                                    int centered, double *s, ptrdiff_t n,                    \
                                    const uint16_t *xf, const uint16_t *rf, int stream)      \
    {                                                                                        \
        LNF_PICK(lnf_row_pipe, kind, f16c, x, y, w, b, hi, lo, rs, xn, rn, zn, centered, s, \
                 n, xf, rf, stream);                                                         \
    }                                                                                        \
    static void lnf_row_grad_pipe_##kind(const uint16_t *x, const uint16_t *dy,              \
                                         const uint16_t *dz, uint16_t *dx, const float *k,   \
                                         float *dw, float *db, const uint16_t *xn,           \
                                         const uint16_t *dyn, float mean_n, double *out,     \
                                         const float *w, ptrdiff_t n, const uint16_t *xf,    \
                                         const uint16_t *dyf, int stream)                    \
    {                                                                                        \
        LNF_PICK(lnf_row_grad_pipe, kind, f16c, x, dy, dz, dx, k, dw, db, xn, dyn, mean_n,  \
                 out, w, n, xf, dyf, stream);                                                \
    }
LNF_DEFINE_PICKED_SWEEPS(f16, 1)
LNF_DEFINE_PICKED_SWEEPS(bf16, 0)
#undef LNF_DEFINE_PICKED_SWEEPS
#undef LNF_PICK
#undef LNF_BEST512_f16
#undef LNF_BEST512_bf16

#endif
