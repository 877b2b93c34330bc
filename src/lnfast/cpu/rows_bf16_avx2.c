/* bfloat16 rows: the AVX2 build. */
#include "simd.h"
#include "halfconv.h"
#if LNF_X86_UNITS
#define LNF_NAME bf16_avx2
#define LNF_T float
#define LNF_S uint16_t
#define LNF_DOUBLE 0
#define LNF_STORAGE16 1
#define LNF_ATTR __attribute__((target("avx2")))
#define LNF_VB 32
#define LNF_TO_F32 lnf_bf16_to_f32
#define LNF_FROM_F32 lnf_f32_to_bf16
#define LNF_VWIDEN lnf_vwiden_bf16x256
#define LNF_VNARROW lnf_vnarrow_bf16x256
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
