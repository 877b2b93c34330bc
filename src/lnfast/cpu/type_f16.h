/* float16 rows, for a rows_f16_<isa>.c unit: the storage and compute types
 * of the row operations' template (rowops.h). */
#include "halfconv.h"
#define LNF_T float
#define LNF_S uint16_t
#define LNF_DOUBLE 0
#define LNF_STORAGE16 1
#define LNF_TO_F32 lnf_f16_to_f32
#define LNF_FROM_F32 lnf_f32_to_f16
