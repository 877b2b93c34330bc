/* bfloat16 rows: the AVX-512 build with the AVX512-BF16 conversions. */
#include "simd.h"
#if LNF_BF16_UNITS
#include "type_bf16.h"
#define LNF_NAME bf16_avx512bf16
#define LNF_ATTR __attribute__((target("avx512f,avx512dq,avx512bw,avx512bf16")))
#define LNF_VB 64
#define LNF_VWIDEN lnf_vwiden_bf16b512
#define LNF_VNARROW lnf_vnarrow_bf16b512
#define LNF_VNARROW2 lnf_vnarrow2_bf16b512
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
