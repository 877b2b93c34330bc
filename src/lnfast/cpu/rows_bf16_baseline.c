/* bfloat16 rows: the baseline build. */
#include "simd.h"
#if 1
#include "type_bf16.h"
#define LNF_NAME bf16_baseline
#define LNF_ATTR 
#define LNF_VB 16
#define LNF_VWIDEN lnf_vwiden_bf16
#define LNF_VNARROW lnf_vnarrow_bf16
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
