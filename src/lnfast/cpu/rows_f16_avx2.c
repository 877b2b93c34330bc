/* float16 rows: the AVX2 build, with F16C conversions. */
#include "simd.h"
#if LNF_X86_UNITS
#include "type_f16.h"
#define LNF_NAME f16_avx2
#define LNF_ATTR __attribute__((target("avx2,f16c")))
#define LNF_VB 32
#define LNF_VWIDEN lnf_vwiden_f16c256
#define LNF_VNARROW lnf_vnarrow_f16c256
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
