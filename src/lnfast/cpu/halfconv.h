/* float16 and bfloat16 rows to and from float32, exact when widening and
 * rounded to nearest even when narrowing (overflow to infinity, subnormals
 * kept, NaN stays NaN: quieted, its payload truncated, as the F16C
 * instructions do, so every path gives the same bits).
 *
 * One value at a time (the scalar code, which every other path matches),
 * and one vector at a time for the row operations of each instruction set
 * (rows_*.c): integer operations at the baseline, F16C instructions for
 * float16 with AVX2 and AVX-512, AVX-512 and AVX2 integer instructions or
 * AVX512-BF16 for bfloat16, NEON on aarch64.  Whole rows: convert.c.
 * All give the same bits.
 */
#ifndef LNFAST_HALFCONV_H
#define LNFAST_HALFCONV_H

#include "simd.h"

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
        o = f > 0x7f800000u ? 0x7e00u | (f >> 13 & 0x3ffu) : 0x7c00u;
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

/* float64 -> float32 rounded to odd: toward zero, with the last bit set
 * when inexact (NaN as is).  float32 keeps more than two bits beyond
 * float16 and bfloat16 at every magnitude they reach, so rounding this to
 * nearest even rounds the float64 value once; a plain cast through float32
 * rounds twice and can land on the wrong side of a tie. */
static inline float lnf_f64_to_f32_odd(double v)
{
    float f = (float)v;
    if ((double)f != v && f == f) {
        uint32_t u = lnf_bits(f);
        if (((double)f < 0 ? -(double)f : (double)f) > (v < 0 ? -v : v))
            u -= 1;                                 /* toward zero */
        f = lnf_float(u | 1u);
    }
    return f;
}

#if LNF_VECTOR
/* The same conversions on 4 values at once, for the baseline row sweeps
 * (SSE2; NEON when tests ask for the portable code). */
#define LNF_VSPLAT(u) ((lnf_vu32x4){0} + (uint32_t)(u))
#define LNF_VSELECT(m, a, b) (((m) & (a)) | (~(m) & (b)))

static inline __attribute__((always_inline)) lnf_vf4 lnf_vwiden_bf16(lnf_vh4 h)
{
    return (lnf_vf4)(__builtin_convertvector(h, lnf_vu32x4) << 16);
}

static inline __attribute__((always_inline)) lnf_vh4 lnf_vnarrow_bf16(lnf_vf4 v)
{
    lnf_vu32x4 u = (lnf_vu32x4)v;
    lnf_vu32x4 nan = (lnf_vu32x4)((u & 0x7fffffffu) > 0x7f800000u);
    lnf_vu32x4 r = LNF_VSELECT(nan, (u >> 16) | 0x40u, (u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return __builtin_convertvector(r, lnf_vh4);
}

static inline __attribute__((always_inline)) lnf_vf4 lnf_vwiden_f16(lnf_vh4 h16)
{
    const uint32_t exp_mask = 0x7c00u << 13;
    lnf_vu32x4 h = __builtin_convertvector(h16, lnf_vu32x4);
    lnf_vu32x4 o = (h & 0x7fffu) << 13, exp = o & exp_mask;
    o += (uint32_t)(127 - 15) << 23;
    o += (lnf_vu32x4)(exp == exp_mask) & ((uint32_t)(128 - 16) << 23);
    lnf_vu32x4 sub = (lnf_vu32x4)((lnf_vf4)(o + (1u << 23)) - (lnf_vf4)LNF_VSPLAT(113u << 23));
    o = LNF_VSELECT((lnf_vu32x4)(exp == 0), sub, o);
    return (lnf_vf4)(o | ((h & 0x8000u) << 16));
}

static inline __attribute__((always_inline)) lnf_vh4 lnf_vnarrow_f16(lnf_vf4 v)
{
    const uint32_t f16_overflow = (uint32_t)(127 + 16) << 23;
    const uint32_t denorm_magic = (uint32_t)((127 - 15) + (23 - 10) + 1) << 23;
    lnf_vu32x4 f = (lnf_vu32x4)v, sign = f & 0x80000000u;
    f ^= sign;
    lnf_vu32x4 big = 0x7c00u | ((lnf_vu32x4)(f > 0x7f800000u) & (0x0200u | (f >> 13 & 0x3ffu)));
    lnf_vu32x4 small = (lnf_vu32x4)((lnf_vf4)f + (lnf_vf4)LNF_VSPLAT(denorm_magic)) - denorm_magic;
    lnf_vu32x4 normal = (f + ((uint32_t)(15 - 127) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
    lnf_vu32x4 o = LNF_VSELECT((lnf_vu32x4)(f >= f16_overflow), big,
                               LNF_VSELECT((lnf_vu32x4)(f < (113u << 23)), small, normal));
    return __builtin_convertvector(o | (sign >> 16), lnf_vh4);
}
#undef LNF_VSPLAT
#undef LNF_VSELECT

#if LNF_NEON_UNITS
/* aarch64: NEON code for both types, four values at a time.  float16 uses
 * the conversion instructions (fcvtl, fcvtn), part of every such CPU, so no
 * dispatch is needed; bfloat16 the portable functions' integer arithmetic,
 * with narrowing adds (GCC 12 turns the generic vectors' unsigned compares
 * and 32-to-16-bit conversions into one instruction per value here).  Same
 * bits as the portable code: rounding to nearest even (the FPCR's default
 * mode), overflow to infinity, subnormals kept, NaN quieted with its
 * payload truncated. */
#include <arm_neon.h>
static inline __attribute__((always_inline)) float32x4_t lnf_widen4_f16(uint16x4_t h)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(h));
}

static inline __attribute__((always_inline)) uint16x4_t lnf_narrow4_f16(float32x4_t v)
{
    return vreinterpret_u16_f16(vcvt_f16_f32(v));
}

static inline __attribute__((always_inline)) float32x4_t lnf_widen4_bf16(uint16x4_t h)
{
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

static inline __attribute__((always_inline)) uint16x4_t lnf_narrow4_bf16(float32x4_t v)
{
    uint32x4_t u = vreinterpretq_u32_f32(v);
    uint32x4_t bias = vaddq_u32(vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)),
                                vdupq_n_u32(0x7fff));
    uint16x4_t rne = vaddhn_u32(u, bias);               /* (u + bias) >> 16 */
    uint16x4_t nan = vorr_u16(vshrn_n_u32(u, 16), vdup_n_u16(0x40));
    uint16x4_t number = vmovn_u32(vceqq_f32(v, v));
    return vbsl_u16(number, rne, nan);
}

/* 4 values, for the row operations. */
#define LNF_A64_CONVERSIONS(NAME)                                                      \
    LNF_INLINE lnf_vf4 lnf_vwiden_##NAME##a64(lnf_vh4 h)                               \
    {                                                                                  \
        return (lnf_vf4)lnf_widen4_##NAME((uint16x4_t)h);                              \
    }                                                                                  \
    LNF_INLINE lnf_vh4 lnf_vnarrow_##NAME##a64(lnf_vf4 v)                              \
    {                                                                                  \
        return (lnf_vh4)lnf_narrow4_##NAME((float32x4_t)v);                            \
    }
LNF_A64_CONVERSIONS(f16)
LNF_A64_CONVERSIONS(bf16)
#undef LNF_A64_CONVERSIONS
#endif

#if LNF_CPU_DISPATCH
#include <immintrin.h>
/* Conversions for the row operations built for AVX-512 and AVX2.
 * float16 with F16C: one instruction per 16 (AVX-512) or 8 (AVX2) values. */
#define LNF_F16C(t) static inline __attribute__((target(t), always_inline))
#define LNF_NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
LNF_F16C("avx512f,f16c") lnf_vf16 lnf_vwiden_f16c512(lnf_vh16 h)
{
    return (lnf_vf16)_mm512_cvtph_ps((__m256i)h);
}

LNF_F16C("avx512f,f16c") lnf_vh16 lnf_vnarrow_f16c512(lnf_vf16 v)
{
    return (lnf_vh16)_mm512_cvtps_ph((__m512)v, LNF_NEAREST);
}

LNF_F16C("avx2,f16c") lnf_vf8 lnf_vwiden_f16c256(lnf_vh8 h)
{
    return (lnf_vf8)_mm256_cvtph_ps((__m128i)h);
}

LNF_F16C("avx2,f16c") lnf_vh8 lnf_vnarrow_f16c256(lnf_vf8 v)
{
    return (lnf_vh8)_mm256_cvtps_ph((__m256)v, LNF_NEAREST);
}

/* bfloat16 with AVX-512 and AVX2 integer instructions: the portable
 * functions' arithmetic, in the instructions GCC's generic vectors miss. */
LNF_F16C("avx512f") lnf_vf16 lnf_vwiden_bf16x512(lnf_vh16 h)
{
    return (lnf_vf16)_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16);
}

LNF_F16C("avx512f") lnf_vh16 lnf_vnarrow_bf16x512(lnf_vf16 v)
{
    __m512i u = (__m512i)v, hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                         _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_or_epi32(r, nan, hi, _mm512_set1_epi32(0x40));
    return (lnf_vh16)_mm512_cvtepi32_epi16(r);
}

#if LNF_BF16_UNITS
/* bfloat16 on CPUs with AVX512-BF16 (and BW, DQ).  Widening: vpermw with
 * zero masking puts value k in the high half of lane k, one shuffle instead
 * of a widening move and a shift. */
LNF_F16C("avx512f,avx512bw") lnf_vf16 lnf_vwiden_bf16b512(lnf_vh16 h)
{
    const __m512i idx = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
                                         7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    return (lnf_vf16)_mm512_maskz_permutexvar_epi16(0xaaaaaaaau, idx,
                                                    _mm512_castsi256_si512((__m256i)h));
}

/* Narrowing: vcvtneps2bf16 rounds 16 values to nearest even (NaN as above)
 * but flushes float32 subnormals to zero, so a vector holding one (found by
 * vfpclassps; rare) takes the integer code instead.  About 4 vector
 * operations instead of 10, where narrowing was a third of a bfloat16
 * forward sweep's work. */
LNF_F16C("avx512f,avx512dq,avx512bf16") lnf_vh16 lnf_vnarrow_bf16b512(lnf_vf16 v)
{
    if (__builtin_expect(_mm512_fpclass_ps_mask((__m512)v, 0x20) != 0, 0))
        return lnf_vnarrow_bf16x512(v);
    __m256bh h = _mm512_cvtneps_pbh((__m512)v);
    lnf_vh16 r;
    memcpy(&r, &h, sizeof r);
    return r;
}

/* Thirty-two values at once, for the forward map: vcvtne2ps2bf16 takes
 * about what vcvtneps2bf16 takes for sixteen (docs/performance_cpu.md).
 * The subnormals it flushes come out as zeros, so only a pair with a zero
 * result is classified, and one holding a subnormal takes the integer code. */
LNF_F16C("avx512f,avx512dq,avx512bw,avx512bf16") lnf_vh32 lnf_vnarrow2_bf16b512(lnf_vf16 a,
                                                                                lnf_vf16 b)
{
    __m512bh h = _mm512_cvtne2ps_pbh((__m512)b, (__m512)a);
    lnf_vh32 r;
    memcpy(&r, &h, sizeof r);
    if (__builtin_expect(_mm512_testn_epi16_mask((__m512i)h, _mm512_set1_epi16(0x7fff)) != 0, 0)
        && (_mm512_fpclass_ps_mask((__m512)a, 0x20) | _mm512_fpclass_ps_mask((__m512)b, 0x20))) {
        lnf_vh16 lo = lnf_vnarrow_bf16x512(a), hi = lnf_vnarrow_bf16x512(b);
        memcpy(&r, &lo, sizeof lo);
        memcpy((char *)&r + sizeof lo, &hi, sizeof hi);
    }
    return r;
}
#endif

LNF_F16C("avx2") lnf_vf8 lnf_vwiden_bf16x256(lnf_vh8 h)
{
    return (lnf_vf8)_mm256_slli_epi32(_mm256_cvtepu16_epi32((__m128i)h), 16);
}

/* The bits of non-NaN float32 values u rounded to nearest even at bit 16:
 * the bfloat16 values in their high halves. */
LNF_F16C("avx2") __m256i lnf_rne_bf16x256(__m256i u)
{
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                            _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
}

/* Narrowing, the general case: NaN included. */
LNF_F16C("avx2") lnf_vh8 lnf_vnarrow_bf16x256_any(lnf_vf8 v)
{
    __m256i u = (__m256i)v, hi = _mm256_srli_epi32(u, 16);
    __m256i rne = _mm256_srli_epi32(lnf_rne_bf16x256(u), 16);
    /* NaN: magnitude above infinity's bits (signed compare is safe: both
     * sides are below 2^31) */
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    __m256i r = _mm256_blendv_epi8(rne, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    /* every value fits 16 bits: packus keeps them as they are */
    return (lnf_vh8)_mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Narrowing without NaN (checked first, one compare): round to nearest
 * even in place, then gather the high halves with one byte shuffle and one
 * qword permute: 7 operations per 8 values instead of 12
 * (docs/performance_cpu.md). */
LNF_F16C("avx2") lnf_vh8 lnf_vnarrow_bf16x256(lnf_vf8 v)
{
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps((__m256)v, (__m256)v, _CMP_UNORD_Q)), 0))
        return lnf_vnarrow_bf16x256_any(v);
    __m256i r = lnf_rne_bf16x256((__m256i)v);
    const __m256i high = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
                                          2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    r = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r, high), 0x08);
    return (lnf_vh8)_mm256_castsi256_si128(r);
}

/* Sixteen values at once, for the maps: one NaN check for both vectors
 * and one pack (packus, then a qword permute into memory order) for both:
 * 14 operations per 16 values instead of 16. */
LNF_F16C("avx2") lnf_vh16 lnf_vnarrow2_bf16x256(lnf_vf8 a, lnf_vf8 b)
{
    lnf_vh16 r;
    if (__builtin_expect(_mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_UNORD_Q)), 0)) {
        lnf_vh8 lo = lnf_vnarrow_bf16x256_any(a), hi = lnf_vnarrow_bf16x256_any(b);
        memcpy(&r, &lo, sizeof lo);
        memcpy((char *)&r + sizeof lo, &hi, sizeof hi);
        return r;
    }
    __m256i u = _mm256_srli_epi32(lnf_rne_bf16x256((__m256i)a), 16);
    __m256i v = _mm256_srli_epi32(lnf_rne_bf16x256((__m256i)b), 16);
    /* (packus: every value fits 16 bits; it leaves u0-3 v0-3 u4-7 v4-7) */
    return (lnf_vh16)_mm256_permute4x64_epi64(_mm256_packus_epi32(u, v), 0xd8);
}
#undef LNF_F16C
#undef LNF_NEAREST
#endif
#endif

#endif
