/* float32 rows, for a rows_f32_<isa>.c unit: the storage and compute types
 * of the row operations' template (rowops.h). */
#define LNF_T float
#define LNF_S float
#define LNF_DOUBLE 0
#define LNF_STORAGE16 0
