/* float64 rows, for a rows_f64_<isa>.c unit: the storage and compute types
 * of the row operations' template (rowops.h). */
#define LNF_T double
#define LNF_S double
#define LNF_DOUBLE 1
#define LNF_STORAGE16 0
