/* What the C API checks share: the storage types, a value stored as one
 * of them, and a weight vector. */
#ifndef LNFAST_CHECK_UTIL_H
#define LNFAST_CHECK_UTIL_H
#include <stdint.h>
#include <stdlib.h>

#include "halfconv.h"
#include "lnfast_cpu.h"

static const int types[4] = {LNF_FLOAT32, LNF_FLOAT64, LNF_FLOAT16, LNF_BFLOAT16};

static inline size_t itemsize(int t) { return t == LNF_FLOAT64 ? 8 : t == LNF_FLOAT32 ? 4 : 2; }
/* The type of the weights and of the statistics for storage type t. */
static inline int compute(int t) { return t == LNF_FLOAT64 ? LNF_FLOAT64 : LNF_FLOAT32; }

/* v, rounded to type t, as p[i]. */
static inline void put(void *p, int t, size_t i, double v)
{
    if (t == LNF_FLOAT64) ((double *)p)[i] = v;
    else if (t == LNF_FLOAT32) ((float *)p)[i] = (float)v;
    else if (t == LNF_FLOAT16) ((uint16_t *)p)[i] = lnf_f32_to_f16((float)v);
    else ((uint16_t *)p)[i] = lnf_f32_to_bf16((float)v);
}

/* n contiguous values of type t (exits 2 where the C API refuses them). */
static inline lnf_array vector(void *p, int t, ptrdiff_t n)
{
    lnf_array a;
    ptrdiff_t shape[1] = {n}, strides[1] = {(ptrdiff_t)itemsize(t)};
    if (lnf_array_init(&a, p, t, 1, shape, strides) != LNF_OK)
        exit(2);
    return a;
}
#endif
