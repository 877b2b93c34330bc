/* float32 rows: the baseline build (SSE2 on x86-64, NEON on aarch64, or plain C). */
#include "simd.h"
#if 1
#include "type_f32.h"
#define LNF_NAME f32_baseline
#define LNF_ATTR 
#define LNF_VB 16
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
