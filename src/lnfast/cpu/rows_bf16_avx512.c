/* bfloat16 rows: the AVX-512 build. */
#include "simd.h"
#if LNF_X86_UNITS
#include "type_bf16.h"
#define LNF_NAME bf16_avx512
#define LNF_ATTR __attribute__((target("avx512f")))
#define LNF_VB 64
#define LNF_VWIDEN lnf_vwiden_bf16x512
#define LNF_VNARROW lnf_vnarrow_bf16x512
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
