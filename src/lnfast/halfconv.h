/* float16 and bfloat16 rows to and from float32, exact when widening and
 * rounded to nearest even when narrowing (overflow to infinity, subnormals
 * kept, NaN stays NaN).
 *
 * The portable versions use integer operations only, so they vectorize at
 * every SIMD level (and LNF_DISPATCH compiles them for AVX2 and AVX-512).
 * On x86-64 CPUs with F16C the float16 rows go through the conversion
 * instructions instead, chosen once at run time; both give the same bits.
 * A strided row (stride in bytes != 2) takes the scalar path.
 */
#ifndef LNFAST_HALFCONV_H
#define LNFAST_HALFCONV_H

#include <stdint.h>
#include <string.h>

static inline uint32_t lnf_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float lnf_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float16 -> float32: move exponent and mantissa, rebias; subnormals are
 * normalized by a float subtraction, which is exact. */
static inline float lnf_f16_to_f32(uint16_t h)
{
    const uint32_t exp_mask = 0x7c00u << 13;
    uint32_t o = ((uint32_t)h & 0x7fffu) << 13;
    uint32_t exp = o & exp_mask;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == exp_mask)                         /* Inf or NaN */
        o += (uint32_t)(128 - 16) << 23;
    else if (exp == 0)                           /* zero or subnormal */
        o = lnf_bits(lnf_float(o + (1u << 23)) - lnf_float(113u << 23));
    return lnf_float(o | ((uint32_t)(h & 0x8000u) << 16));
}

/* float32 -> float16, round to nearest even. */
static inline uint16_t lnf_f32_to_f16(float v)
{
    const uint32_t f16_overflow = (uint32_t)(127 + 16) << 23;
    const uint32_t denorm_magic = (uint32_t)((127 - 15) + (23 - 10) + 1) << 23;
    uint32_t f = lnf_bits(v), sign = f & 0x80000000u, o;
    f ^= sign;
    if (f >= f16_overflow)                        /* Inf, NaN or too large */
        o = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
    else if (f < (113u << 23))                    /* subnormal or zero result */
        o = lnf_bits(lnf_float(f) + lnf_float(denorm_magic)) - denorm_magic;
    else                                          /* normal: round the 13 dropped bits */
        o = (f + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
    return (uint16_t)(o | (sign >> 16));
}

static inline float lnf_bf16_to_f32(uint16_t h)
{
    return lnf_float((uint32_t)h << 16);
}

/* float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t lnf_f32_to_bf16(float v)
{
    uint32_t u = lnf_bits(v);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if LNF_VECTOR
/* The same conversions on 16 values at once, for the row sweeps. */
#define LNF_VSPLAT(u) ((lnf_vu32){0} + (uint32_t)(u))
#define LNF_VSELECT(m, a, b) (((m) & (a)) | (~(m) & (b)))

static inline __attribute__((always_inline)) lnf_vf lnf_vwiden_bf16(lnf_vu16 h)
{
    return (lnf_vf)(__builtin_convertvector(h, lnf_vu32) << 16);
}

static inline __attribute__((always_inline)) lnf_vu16 lnf_vnarrow_bf16(lnf_vf v)
{
    lnf_vu32 u = (lnf_vu32)v;
    lnf_vu32 nan = (lnf_vu32)((u & 0x7fffffffu) > 0x7f800000u);
    lnf_vu32 r = LNF_VSELECT(nan, (u >> 16) | 0x40u, (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return __builtin_convertvector(r, lnf_vu16);
}

static inline __attribute__((always_inline)) lnf_vf lnf_vwiden_f16(lnf_vu16 h16)
{
    const uint32_t exp_mask = 0x7c00u << 13;
    lnf_vu32 h = __builtin_convertvector(h16, lnf_vu32);
    lnf_vu32 o = (h & 0x7fffu) << 13, exp = o & exp_mask;
    o += (uint32_t)(127 - 15) << 23;
    o += (lnf_vu32)(exp == exp_mask) & ((uint32_t)(128 - 16) << 23);
    lnf_vu32 sub = (lnf_vu32)((lnf_vf)(o + (1u << 23)) - (lnf_vf)LNF_VSPLAT(113u << 23));
    o = LNF_VSELECT((lnf_vu32)(exp == 0), sub, o);
    return (lnf_vf)(o | ((h & 0x8000u) << 16));
}

static inline __attribute__((always_inline)) lnf_vu16 lnf_vnarrow_f16(lnf_vf v)
{
    const uint32_t f16_overflow = (uint32_t)(127 + 16) << 23;
    const uint32_t denorm_magic = (uint32_t)((127 - 15) + (23 - 10) + 1) << 23;
    lnf_vu32 f = (lnf_vu32)v, sign = f & 0x80000000u;
    f ^= sign;
    lnf_vu32 big = 0x7c00u | ((lnf_vu32)(f > 0x7f800000u) & 0x0200u);
    lnf_vu32 small = (lnf_vu32)((lnf_vf)f + (lnf_vf)LNF_VSPLAT(denorm_magic)) - denorm_magic;
    lnf_vu32 normal = (f + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
    lnf_vu32 o = LNF_VSELECT((lnf_vu32)(f >= f16_overflow), big,
                             LNF_VSELECT((lnf_vu32)(f < (113u << 23)), small, normal));
    return __builtin_convertvector(o | (sign >> 16), lnf_vu16);
}
#undef LNF_VSPLAT
#undef LNF_VSELECT
#endif

/* Row conversions: src or dst rows of 16-bit values with a byte stride. */
#define LNF_DEFINE_ROW_CONVERSIONS(NAME, TO_F32, FROM_F32)                              \
    LNF_DISPATCH static void lnf_widen_##NAME##_portable(const char *src, ptrdiff_t stride, \
                                                         float *__restrict dst,          \
                                                         ptrdiff_t n)                    \
    {                                                                                    \
        if (stride == 2) {                                                               \
            const uint16_t *s = (const uint16_t *)src;                                   \
            for (ptrdiff_t i = 0; i < n; i++)                                            \
                dst[i] = TO_F32(s[i]);                                                   \
        } else {                                                                         \
            for (ptrdiff_t i = 0; i < n; i++)                                            \
                dst[i] = TO_F32(*(const uint16_t *)(src + i * stride));                  \
        }                                                                                \
    }                                                                                    \
    LNF_DISPATCH static void lnf_narrow_##NAME##_portable(const float *__restrict src,     \
                                                          char *dst, ptrdiff_t stride,   \
                                                          ptrdiff_t n)                   \
    {                                                                                    \
        if (stride == 2) {                                                               \
            uint16_t *d = (uint16_t *)dst;                                               \
            for (ptrdiff_t i = 0; i < n; i++)                                            \
                d[i] = FROM_F32(src[i]);                                                 \
        } else {                                                                         \
            for (ptrdiff_t i = 0; i < n; i++)                                            \
                *(uint16_t *)(dst + i * stride) = FROM_F32(src[i]);                      \
        }                                                                                \
    }

LNF_DEFINE_ROW_CONVERSIONS(f16, lnf_f16_to_f32, lnf_f32_to_f16)
LNF_DEFINE_ROW_CONVERSIONS(bf16, lnf_bf16_to_f32, lnf_f32_to_bf16)

#if LNF_HAVE_DISPATCH
#include <cpuid.h>
#include <immintrin.h>

/* F16C: 8 values per instruction; the scalar tail uses the portable code. */
__attribute__((target("avx,f16c"))) static void lnf_widen_f16_f16c(const char *src,
                                                                    float *__restrict dst,
                                                                    ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
    for (; i < n; i++)
        dst[i] = lnf_f16_to_f32(((const uint16_t *)src)[i]);
}

__attribute__((target("avx,f16c"))) static void lnf_narrow_f16_f16c(const float *__restrict src,
                                                                     char *dst, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + 2 * i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        ((uint16_t *)dst)[i] = lnf_f32_to_f16(src[i]);
}

/* F16C and AVX present, and AVX state enabled by the OS (cpuid leaf 1 and
 * xgetbv; __builtin_cpu_supports("f16c") is missing from older clang). */
static int lnf_has_f16c(void)
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
static int lnf_has_f16c(void) { return 0; }
#endif

/* lnf_force_portable: tests set it to check the portable path here too. */
static int lnf_force_portable = 0;

static void lnf_widen_f16(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n)
{
#if LNF_HAVE_DISPATCH
    if (stride == 2 && !lnf_force_portable && lnf_has_f16c()) {
        lnf_widen_f16_f16c(src, dst, n);
        return;
    }
#endif
    lnf_widen_f16_portable(src, stride, dst, n);
}

static void lnf_narrow_f16(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n)
{
#if LNF_HAVE_DISPATCH
    if (stride == 2 && !lnf_force_portable && lnf_has_f16c()) {
        lnf_narrow_f16_f16c(src, dst, n);
        return;
    }
#endif
    lnf_narrow_f16_portable(src, dst, stride, n);
}

static void lnf_widen_bf16(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n)
{
    lnf_widen_bf16_portable(src, stride, dst, n);
}

static void lnf_narrow_bf16(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n)
{
    lnf_narrow_bf16_portable(src, dst, stride, n);
}

#endif
