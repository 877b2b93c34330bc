/* Whole rows of float16 and bfloat16 to and from float32: rows gathered
 * into scratch, 16-bit weights widened, 16-bit dweight/dbias narrowed.
 * The portable code is integer operations (halfconv.h) that vectorize at
 * every level (LNF_CLONES builds it for AVX2 and AVX-512 too); float16
 * rows go through F16C on x86-64 CPUs with it, and both types through
 * NEON on aarch64.  dispatch.c chooses; all give the same bits.  A strided
 * row (stride in bytes != 2) takes the portable code. */
#include "halfconv.h"
#include "kernels.h"
#include "lnfast_cpu.h"

#define LNF_DEFINE_ROW_CONVERSIONS(NAME, TO_F32, FROM_F32)                                \
    LNF_CLONES static void widen_##NAME(const char *src, ptrdiff_t stride, float *dst,    \
                                        ptrdiff_t n)                                      \
    {                                                                                     \
        if (stride == 2) {                                                                \
            const uint16_t *s = (const uint16_t *)(const void *)src;                      \
            for (ptrdiff_t i = 0; i < n; i++)                                             \
                dst[i] = TO_F32(s[i]);                                                    \
        } else {                                                                          \
            for (ptrdiff_t i = 0; i < n; i++)                                             \
                dst[i] = TO_F32(*(const uint16_t *)(const void *)(src + i * stride));     \
        }                                                                                 \
    }                                                                                     \
    LNF_CLONES static void narrow_##NAME(const float *src, char *dst, ptrdiff_t stride,   \
                                         ptrdiff_t n)                                     \
    {                                                                                     \
        if (stride == 2) {                                                                \
            uint16_t *d = (uint16_t *)(void *)dst;                                        \
            for (ptrdiff_t i = 0; i < n; i++)                                             \
                d[i] = FROM_F32(src[i]);                                                  \
        } else {                                                                          \
            for (ptrdiff_t i = 0; i < n; i++)                                             \
                *(uint16_t *)(void *)(dst + i * stride) = FROM_F32(src[i]);               \
        }                                                                                 \
    }                                                                                     \
    void lnf_widen_##NAME##_portable(const char *src, ptrdiff_t stride, float *dst,       \
                                     ptrdiff_t n)                                         \
    {                                                                                     \
        widen_##NAME(src, stride, dst, n);                                                \
    }                                                                                     \
    void lnf_narrow_##NAME##_portable(const float *src, char *dst, ptrdiff_t stride,      \
                                      ptrdiff_t n)                                        \
    {                                                                                     \
        narrow_##NAME(src, dst, stride, n);                                               \
    }
LNF_DEFINE_ROW_CONVERSIONS(f16, lnf_f16_to_f32, lnf_f32_to_f16)
LNF_DEFINE_ROW_CONVERSIONS(bf16, lnf_bf16_to_f32, lnf_f32_to_bf16)
#undef LNF_DEFINE_ROW_CONVERSIONS

#if LNF_CPU_DISPATCH
#include <cpuid.h>
#include <immintrin.h>

/* F16C: 8 values per instruction; the scalar tail uses the portable code. */
__attribute__((target("avx,f16c"))) void lnf_widen_f16_f16c(const char *src, ptrdiff_t stride,
                                                             float *dst, ptrdiff_t n)
{
    if (stride != 2) {
        lnf_widen_f16_portable(src, stride, dst, n);
        return;
    }
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    for (; i < n; i++)
        dst[i] = lnf_f16_to_f32(((const uint16_t *)(const void *)src)[i]);
}

__attribute__((target("avx,f16c"))) void lnf_narrow_f16_f16c(const float *src, char *dst,
                                                              ptrdiff_t stride, ptrdiff_t n)
{
    if (stride != 2) {
        lnf_narrow_f16_portable(src, dst, stride, n);
        return;
    }
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        ((uint16_t *)(void *)dst)[i] = lnf_f32_to_f16(src[i]);
}

/* F16C and AVX present, and AVX state enabled by the OS (cpuid leaf 1 and
 * xgetbv; __builtin_cpu_supports("f16c") is missing from older clang). */
int lnf_has_f16c(void)
{
    static int known = -1;              /* idempotent: a race writes the same value */
    if (known < 0) {
        unsigned a, b, c, d, lo, hi;
        int ok = 0;
        if (__get_cpuid(1, &a, &b, &c, &d) && (c >> 27 & 1) && (c >> 28 & 1) && (c >> 29 & 1)) {
            __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            ok = (lo & 6u) == 6u;       /* XMM and YMM state saved by the OS */
        }
        known = ok;
    }
    return known;
}
#else
int lnf_has_f16c(void) { return 0; }
#endif

#if LNF_NEON_UNITS
/* Rows of contiguous values four at a time, with the portable code's
 * scalar tail. */
#define LNF_NEON_ROW_CONVERSIONS(NAME)                                                   \
    void lnf_widen_##NAME##_neon(const char *src, ptrdiff_t stride, float *dst,          \
                                 ptrdiff_t n)                                            \
    {                                                                                    \
        if (stride != 2) {                                                               \
            lnf_widen_##NAME##_portable(src, stride, dst, n);                            \
            return;                                                                      \
        }                                                                                \
        const uint16_t *s = (const uint16_t *)(const void *)src;                         \
        ptrdiff_t i = 0;                                                                 \
        for (; i + 4 <= n; i += 4)                                                       \
            vst1q_f32(dst + i, lnf_widen4_##NAME(vld1_u16(s + i)));                      \
        for (; i < n; i++)                                                               \
            dst[i] = lnf_##NAME##_to_f32(s[i]);                                          \
    }                                                                                    \
    void lnf_narrow_##NAME##_neon(const float *src, char *dst, ptrdiff_t stride,         \
                                  ptrdiff_t n)                                           \
    {                                                                                    \
        if (stride != 2) {                                                               \
            lnf_narrow_##NAME##_portable(src, dst, stride, n);                           \
            return;                                                                      \
        }                                                                                \
        uint16_t *d = (uint16_t *)(void *)dst;                                           \
        ptrdiff_t i = 0;                                                                 \
        for (; i + 4 <= n; i += 4)                                                       \
            vst1_u16(d + i, lnf_narrow4_##NAME(vld1q_f32(src + i)));                     \
        for (; i < n; i++)                                                               \
            d[i] = lnf_f32_to_##NAME(src[i]);                                            \
    }
LNF_NEON_ROW_CONVERSIONS(f16)
LNF_NEON_ROW_CONVERSIONS(bf16)
#undef LNF_NEON_ROW_CONVERSIONS
#endif

/* lnf_f64_to_f32_odd of n values, with selects for the branches so that
 * it vectorizes: the backward's float64 sums of 16-bit dweight/dbias on
 * their way to the row narrowing (a branch per value went either way at
 * random, docs/performance.md). */
LNF_CLONES static void f64_to_f32_odd_row(const double *__restrict src, float *__restrict dst,
                                          ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        double v = src[i];
        float f = (float)v;
        uint32_t inexact = ((double)f != v) & (f == f);
        uint32_t away = __builtin_fabs((double)f) > __builtin_fabs(v);
        dst[i] = lnf_float((lnf_bits(f) - (inexact & away)) | inexact);
    }
}

void lnf_f64_to_f32_odd_row(const double *src, float *dst, ptrdiff_t n)
{
    f64_to_f32_odd_row(src, dst, n);
}
