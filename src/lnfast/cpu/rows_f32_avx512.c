/* float32 rows: the AVX-512 build. */
#include "simd.h"
#if LNF_X86_UNITS
#include "type_f32.h"
#define LNF_NAME f32_avx512
#define LNF_ATTR __attribute__((target("avx512f")))
#define LNF_VB 64
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
