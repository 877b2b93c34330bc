/* lnf_array: an array described as rows over its last axis. */
#include "array.h"

/* Whether `outer` is stride * n, the stride of an axis outside one of n
 * elements `stride` bytes apart, which then merge: tested by division, as
 * the product may pass the array's last byte, and overflow. */
static int outer_of(ptrdiff_t outer, ptrdiff_t stride, ptrdiff_t n)
{
    return n == 0 ? outer == 0 : outer % n == 0 && outer / n == stride;
}

int lnf_array_init(lnf_array *a, void *base, int dtype, int ndim, const ptrdiff_t *shape,
                   const ptrdiff_t *strides)
{
    lnf_array t;        /* (a is written only on success) */
    if (a == NULL || shape == NULL || strides == NULL || dtype < 0 || dtype >= LNF_NDTYPES
        || ndim < 1 || !lnf_axes_fit(ndim, shape, strides))
        return LNF_EINVAL;
    t.base = (char *)base;
    /* A single element's stride addresses nothing (NumPy calls such an
     * axis contiguous whatever it is): elements adjacent, for the paths
     * that want them so. */
    t.inner = shape[ndim - 1] == 1 ? lnf_itemsize(dtype) : strides[ndim - 1];
    t.dtype = dtype;
    t.nd = 0;
    for (int k = 0; k < ndim - 1; k++) {      /* outermost first; drop unit axes */
        if (shape[k] == 1)
            continue;
        if (t.nd > 0 && outer_of(t.stride[t.nd - 1], strides[k], shape[k])) {
            t.shape[t.nd - 1] *= shape[k];
            t.stride[t.nd - 1] = strides[k];
            continue;
        }
        if (t.nd == LNF_MAX_LEAD)
            return LNF_EINVAL;
        t.shape[t.nd] = shape[k];
        t.stride[t.nd] = strides[k];
        t.nd++;
    }
    *a = t;
    return LNF_OK;
}
