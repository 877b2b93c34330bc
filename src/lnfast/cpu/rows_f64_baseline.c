/* float64 rows: the baseline build (SSE2 on x86-64, NEON on aarch64, or plain C). */
#include "simd.h"
#if 1
#define LNF_NAME f64_baseline
#define LNF_T double
#define LNF_S double
#define LNF_DOUBLE 1
#define LNF_STORAGE16 0
#define LNF_ATTR 
#define LNF_VB 16
#include "rowops.h"
#else
typedef int lnf_unit_not_built;   /* (not for this target) */
#endif
