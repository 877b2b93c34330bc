/* bfloat16 rows: the AVX2 build. */
#include "simd.h"
#if LNF_X86_UNITS
#include "type_bf16.h"
#define LNF_NAME bf16_avx2
#define LNF_ATTR __attribute__((target("avx2")))
#define LNF_VB 32
#define LNF_VWIDEN lnf_vwiden_bf16x256
#define LNF_VNARROW lnf_vnarrow_bf16x256
#define LNF_VNARROW2 lnf_vnarrow2_bf16x256
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
