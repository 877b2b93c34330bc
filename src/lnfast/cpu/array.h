/* Row addressing: row r of an lnf_array, and rows brought into the compute
 * type (gathered from strides, widened from 16 bits) and back. */
#ifndef LNFAST_CPU_ARRAY_H
#define LNFAST_CPU_ARRAY_H

#include "kernels.h"
#include "lnfast_cpu.h"

/* Whether a * b (a, b >= 0) fits a ptrdiff_t. */
static inline int lnf_mul_fits(ptrdiff_t a, ptrdiff_t b)
{
    return b == 0 || a <= PTRDIFF_MAX / b;
}

/* a * b (a, b >= 0), or PTRDIFF_MAX where that does not fit: a byte count
 * no memory holds. */
static inline ptrdiff_t lnf_mul_sat(ptrdiff_t a, ptrdiff_t b)
{
    return lnf_mul_fits(a, b) ? a * b : PTRDIFF_MAX;
}

/* The bytes of M rows of D elements of `itemsize` bytes (all >= 0), or
 * PTRDIFF_MAX where they pass what memory holds. */
static inline ptrdiff_t lnf_rows_bytes(ptrdiff_t M, ptrdiff_t D, ptrdiff_t itemsize)
{
    return lnf_mul_sat(lnf_mul_sat(M, D), itemsize);
}

/* a / b rounded up (a >= 0, b > 0), without a + b - 1, which may overflow. */
static inline ptrdiff_t lnf_div_up(ptrdiff_t a, ptrdiff_t b)
{
    return a / b + (a % b > 0);
}

/* Whether n axes of these lengths and byte strides can be addressed: no
 * negative length, and the product of the nonzero lengths and the bytes
 * from the first element to the last, the sum of |stride| (length - 1),
 * fit a ptrdiff_t (row addresses and row counts are computed in one). */
static inline int lnf_axes_fit(int n, const ptrdiff_t *shape, const ptrdiff_t *stride)
{
    ptrdiff_t count = 1, span = 0;
    for (int k = 0; k < n; k++) {
        if (shape[k] < 0)
            return 0;
        if (shape[k] <= 1)              /* (its stride addresses nothing) */
            continue;
        if (stride[k] == PTRDIFF_MIN)
            return 0;
        ptrdiff_t s = stride[k] < 0 ? -stride[k] : stride[k];
        if (!lnf_mul_fits(count, shape[k]) || !lnf_mul_fits(s, shape[k] - 1)
            || span > PTRDIFF_MAX - s * (shape[k] - 1))
            return 0;
        count *= shape[k];
        span += s * (shape[k] - 1);
    }
    return 1;
}

/* Bytes per element of a dtype. */
static inline ptrdiff_t lnf_itemsize(int dtype)
{
    return dtype == LNF_FLOAT64 ? 8 : dtype == LNF_FLOAT32 ? 4 : 2;
}

static inline char *lnf_row(const lnf_array *m, ptrdiff_t r)
{
    ptrdiff_t off = 0;
    if (m->nd == 1)
        return m->base + r * m->stride[0];
    for (int k = m->nd - 1; k >= 0; k--) {
        off += (r % m->shape[k]) * m->stride[k];
        r = r / m->shape[k];
    }
    return m->base + off;
}

/* Row r, or NULL when r is end or past it (or `present` is 0). */
static inline const void *lnf_row_or_null(const lnf_array *m, ptrdiff_t r, ptrdiff_t end,
                                          int present)
{
    return present && r < end ? lnf_row(m, r) : NULL;
}

/* Whether rows of m are stored in the compute type (float32, float64). */
static inline int lnf_native(const lnf_array *m)
{
    return m->dtype == LNF_FLOAT32 || m->dtype == LNF_FLOAT64;
}

/* Row r of D elements as a contiguous pointer of the compute type (tsize
 * bytes): the row itself, or a copy in `buf`. */
static inline const void *lnf_load_row(const lnf_array *m, ptrdiff_t r, ptrdiff_t D, void *buf,
                                       size_t tsize)
{
    const char *p = lnf_row(m, r);
    if (!lnf_native(m)) {
        lnf_kernels_for(m->dtype)->widen(p, m->inner, (float *)buf, D);
    } else if (m->inner == (ptrdiff_t)tsize) {
        return p;
    } else if (tsize == sizeof(float)) {
        for (ptrdiff_t i = 0; i < D; i++)
            ((float *)buf)[i] = *(const float *)(const void *)(p + i * m->inner);
    } else {
        for (ptrdiff_t i = 0; i < D; i++)
            ((double *)buf)[i] = *(const double *)(const void *)(p + i * m->inner);
    }
    return buf;
}

/* Copy a finished row from scratch to row r (strided, or 16-bit: rounded
 * to nearest even, once). */
static inline void lnf_store_row(const lnf_array *m, ptrdiff_t r, ptrdiff_t D, const void *src,
                                 size_t tsize)
{
    char *p = lnf_row(m, r);
    if (!lnf_native(m))
        lnf_kernels_for(m->dtype)->narrow((const float *)src, p, m->inner, D);
    else if (tsize == sizeof(float))
        for (ptrdiff_t i = 0; i < D; i++)
            *(float *)(void *)(p + i * m->inner) = ((const float *)src)[i];
    else
        for (ptrdiff_t i = 0; i < D; i++)
            *(double *)(void *)(p + i * m->inner) = ((const double *)src)[i];
}

/* Where to compute output row r: in place, or in `buf` (then
 * lnf_store_row). */
static inline void *lnf_out_row(const lnf_array *m, ptrdiff_t r, void *buf, size_t tsize)
{
    return m->inner == (ptrdiff_t)tsize && lnf_native(m) ? lnf_row(m, r) : buf;
}

#endif
