/* bfloat16 rows: aarch64, with NEON conversions. */
#include "simd.h"
#if LNF_NEON_UNITS
#include "type_bf16.h"
#define LNF_NAME bf16_neon
#define LNF_ATTR 
#define LNF_VB 16
#define LNF_VWIDEN lnf_vwiden_bf16a64
#define LNF_VNARROW lnf_vnarrow_bf16a64
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
