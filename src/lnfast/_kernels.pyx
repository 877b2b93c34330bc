# cython: language_level=3, wraparound=True, boundscheck=True
"""The CPU backend: every call on NumPy arrays, from its arguments to its
outputs, in one step (lnfast._dispatch picks this module for NumPy arrays,
lnfast._gpu for CuPy's; both take the same arguments).

The step checks the arguments, prepares them for the kernels, allocates the
outputs, fills in weight=None and bias=None, chooses the thread count and
runs the kernels (lnfast._cpu).  An ordinary call (NumPy arrays of a
kernel dtype, aligned and C-contiguous, weight and bias None or vectors of
x's or the compute dtype, a float eps, no out=) is recognised by a few type
tests here; any other goes through lnfast._checks, which words the error
of a bad call, and is then made ordinary (aligned copies, weight converted
to the compute dtype, out= through a temporary where it overlaps an input).
From there one path serves both (docs/api.md, "Call overhead").
"""
from libc.float cimport DBL_MAX

cimport numpy as cnp
import math

import ml_dtypes
import numpy as np

from lnfast._cpu cimport chunks_for, run_backward, run_forward
from lnfast import _checks, _cpu, _pool
from lnfast._threads import PARALLEL_MIN_ELEMENTS_BACKWARD, threads_for

cnp.import_array()

cdef extern from "cpu/lnfast_cpu.h" nogil:
    enum:
        LNF_MAX_LEAD, LNF_CONSTANT_MAX_D

cdef extern from "numpy/arrayobject.h":
    object PyDataMem_SetHandler(object handler)

cdef int BF16_TYPENUM = np.dtype(ml_dtypes.bfloat16).num
cdef size_t POOL_MIN = _pool.MIN_BYTES
cdef object pool_handler = _pool.handler


# ---------------------------------------------------------------------------
# The step.

def forward(x, residual, weight, bias, eps, out, bint centered, bint stats, z_out=None):
    """Normalize the rows of x (of x + residual when residual is not None)
    over its last axis: LayerNorm when centered, else RMSNorm (bias
    unread).  Returns (y, z, mean, rstd): z = x + residual, or None; mean
    (centered) and rstd only when `stats`, else None.  y is `out` when out
    is given; z is z_out when given (lnfast._axes: a writeable array of
    x's shape that overlaps no argument)."""
    cdef int t = 0, ct = -1     # (set by ordinary_rows, which gcc cannot follow)
    cdef cnp.ndarray xa
    cdef bint ordinary = (out is None and type(eps) is float and ordinary_rows(x, &t, &ct)
                          and 0.0 <= <double>eps <= DBL_MAX)
    if ordinary:
        xa = x
        ordinary = ((residual is None or same_layout(residual, xa, t))
                    and ordinary_param(weight, t, ct, xa) and ordinary_param(bias, t, ct, xa))
    if not ordinary:
        eps = _checks.forward_args(x, residual, weight, bias, eps, out, centered)
        t, ct = x.dtype.num, compute_typenum(x.dtype.num)
        xa, residual = kernel_view(x), kernel_view(residual)
        weight, bias = as_param(weight, ct), as_param(bias, ct) if centered else None
    cdef cnp.ndarray x0 = x      # (the shape, where xa is a 2-D copy)
    cdef int nd = cnp.PyArray_NDIM(x0)
    cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(x0)
    cdef cnp.npy_intp D = dims[nd - 1], M = cnp.PyArray_SIZE(x0) // D
    cdef size_t nbytes = cnp.PyArray_NBYTES(x0)
    cdef size_t stat_bytes = M * (8 if ct == cnp.NPY_FLOAT64 else 4)
    w = constant(1.0, D, ct, True) if weight is None else weight
    b = (constant(0.0, D, ct, True) if bias is None else bias) if centered else None
    if out is None:
        y = target = new_array(nd, dims, t, nbytes)
    elif writes_safely(out, x, (residual, weight, bias)):
        y = target = out
    else:
        y, target = out, cnp.PyArray_EMPTY(nd, dims, t, 0)
    if residual is None:
        z = None
    else:
        z = z_out if z_out is not None else new_array(nd, dims, t, nbytes)
    mean = new_array(nd - 1, dims, ct, stat_bytes) if stats and centered else None
    rstd = new_array(nd - 1, dims, ct, stat_bytes) if stats else None
    if M:
        run_forward(xa, residual, z, target, w, b, mean, rstd, eps, centered,
                    min(<cnp.npy_intp>threads_for(M * D), M))
    if target is not y:
        np.copyto(y, target)
    return y, z, mean, rstd


def backward(dy, x, mean, rstd, weight, dz, bint centered, str x_name="x", dx_out=None,
             bint partials=False):
    """The gradients of forward's y (with stats) for the rows of x: (dx
    [+ dz], dweight, dbias), dweight and dbias summed over every row in the
    weight's dtype (the compute dtype when weight is None); dbias zero
    unless centered.  x_name: x's name in error messages.  dx is dx_out
    when given (as z_out in forward).  With `partials`, dweight and dbias
    are the float64 sums, unrounded (lnfast._dask adds those of blocks)."""
    cdef int t = 0, ct = -1, gt     # (t, ct: as in forward)
    cdef cnp.ndarray xa
    cdef bint ordinary = ordinary_rows(x, &t, &ct)
    if ordinary:
        xa = x
        ordinary = (same_layout(dy, xa, t) and (dz is None or same_layout(dz, xa, t))
                    and ordinary_stats(rstd, ct, xa)
                    and (not centered or ordinary_stats(mean, ct, xa))
                    and ordinary_param(weight, t, ct, xa))
    if not ordinary:
        _checks.backward_args(dy, x, mean, rstd, weight, dz, centered, x_name)
        t, ct = x.dtype.num, compute_typenum(x.dtype.num)
    gt = (cnp.NPY_FLOAT64 if partials else
          ct if weight is None else cnp.PyArray_TYPE(<cnp.ndarray>weight))   # (dweight's dtype)
    if not ordinary:
        dy, xa, dz = kernel_view(dy), kernel_view(x), kernel_view(dz)
        mean, rstd = as_stats(mean, ct) if centered else None, as_stats(rstd, ct)
        weight = as_param(weight, ct)
    cdef cnp.ndarray x0 = x      # (the shape, where xa is a 2-D copy)
    cdef int nd = cnp.PyArray_NDIM(x0)
    cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(x0)
    cdef cnp.npy_intp D = dims[nd - 1], M = cnp.PyArray_SIZE(x0) // D
    cdef cnp.npy_intp grads[2]
    grads[0], grads[1] = 2, D
    dx = dx_out if dx_out is not None else new_array(nd, dims, t, cnp.PyArray_NBYTES(x0))
    if M == 0:
        return dx, cnp.PyArray_ZEROS(1, &D, gt, 0), cnp.PyArray_ZEROS(1, &D, gt, 0)
    cdef Py_ssize_t nchunks = chunks_for(M, D)
    dwdb = cnp.PyArray_EMPTY(2, grads, gt, 0)       # (summed in float64, rounded once)
    run_backward(dy, xa, dz, mean if centered else None, rstd,
                 constant(1.0, D, ct) if weight is None else weight, dx, dwdb, nchunks, centered,
                 min(<Py_ssize_t>threads_for(M * D, PARALLEL_MIN_ELEMENTS_BACKWARD), nchunks))
    return dx, dwdb[0], dwdb[1]


def empty(shape, dtype):
    """numpy.empty(shape, dtype), large buffers from the output cache."""
    a = np.empty(0, dtype)
    cdef cnp.ndarray d = np.asarray(shape, dtype=np.intp)
    return new_array(len(shape), <cnp.npy_intp*>cnp.PyArray_DATA(d), a.dtype.num,
                     math.prod(shape) * a.itemsize)


# How many fixed row chunks the backward pass sums dweight/dbias over: a
# function of the shape only (cpu/config.h).
num_chunks = _cpu.num_chunks


# ---------------------------------------------------------------------------
# Ordinary arguments, recognised without Python-level checks.

cdef inline bint plain(object a, int typenum):
    """`a` is a NumPy ndarray (no subclass) of dtype `typenum` in native
    byte order, aligned and C-contiguous."""
    return (type(a) is cnp.ndarray and cnp.PyArray_TYPE(<cnp.ndarray>a) == typenum
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>a)
            and cnp.PyArray_ISALIGNED(<cnp.ndarray>a)
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a))


cdef inline int compute_typenum(int t):
    """The compute type of data of type t, or -1 for other types."""
    if t == cnp.NPY_FLOAT64:
        return cnp.NPY_FLOAT64
    if t == cnp.NPY_FLOAT32 or t == cnp.NPY_FLOAT16 or t == BF16_TYPENUM:
        return cnp.NPY_FLOAT32
    return -1


cdef inline bint ordinary_rows(object x, int* t, int* ct):
    """x is a plain array of a kernel type with at least one axis and one
    row; sets t to its type and ct to its compute type."""
    if type(x) is not cnp.ndarray:
        return False
    t[0] = cnp.PyArray_TYPE(<cnp.ndarray>x)
    ct[0] = compute_typenum(t[0])
    return (ct[0] >= 0 and cnp.PyArray_NDIM(<cnp.ndarray>x) > 0 and plain(x, t[0])
            and cnp.PyArray_SIZE(<cnp.ndarray>x) > 0)


cdef inline bint same_layout(object a, cnp.ndarray x, int t):
    """`a` is plain, of type t and of x's shape."""
    return (plain(a, t) and cnp.PyArray_NDIM(<cnp.ndarray>a) == cnp.PyArray_NDIM(x)
            and cnp.PyArray_CompareLists(cnp.PyArray_DIMS(<cnp.ndarray>a), cnp.PyArray_DIMS(x),
                                         cnp.PyArray_NDIM(x)))


cdef inline bint ordinary_stats(object s, int ct, cnp.ndarray x):
    """mean or rstd `s` is plain, of type ct and of shape x.shape[:-1]."""
    return (plain(s, ct) and cnp.PyArray_NDIM(<cnp.ndarray>s) == cnp.PyArray_NDIM(x) - 1
            and cnp.PyArray_CompareLists(cnp.PyArray_DIMS(<cnp.ndarray>s), cnp.PyArray_DIMS(x),
                                         cnp.PyArray_NDIM(x) - 1))


cdef inline bint ordinary_param(object p, int t, int ct, cnp.ndarray x):
    """weight or bias `p` is None or a plain vector of length D (x's last
    axis), of the compute type ct or of x's type t."""
    if p is None:
        return True
    return ((plain(p, ct) or plain(p, t)) and cnp.PyArray_NDIM(<cnp.ndarray>p) == 1
            and cnp.PyArray_DIM(<cnp.ndarray>p, 0)
                == cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1))


# ---------------------------------------------------------------------------
# Other arguments, checked (lnfast._checks), made ordinary.

def kernel_view(a):
    """`a` itself when the kernels can address it (aligned, at most
    LNF_MAX_LEAD leading axes; any strides), else an aligned copy: of the
    same strides (same_strides), or C-ordered with its rows merged where
    it has more leading axes."""
    if a is None:
        return a
    if a.ndim > LNF_MAX_LEAD + 1:
        return np.array(a, order="C").reshape(-1, a.shape[-1])
    return a if a.flags.aligned else same_strides(a)


def same_strides(a):
    """An aligned copy of `a` with a's strides, so that its layout, which
    chooses the kernel (the tile kernels for rows far apart) and so the
    bits, is a's; where those strides are not whole elements or would span
    more than twice a's elements, a compact copy in a's own axis order."""
    cdef Py_ssize_t isz = a.itemsize, lo = 0, hi = 0
    if a.size and all(st % isz == 0 for st in a.strides):
        for st, n in zip(a.strides, a.shape):
            if st < 0:
                lo += st * (n - 1)
            else:
                hi += st * (n - 1)
        if (hi - lo) // isz < 2 * a.size:
            c = np.ndarray(a.shape, a.dtype, np.empty((hi - lo) // isz + 1, a.dtype), -lo,
                           a.strides)
            c[...] = a
            return c
    return a.copy(order="K")


def aligned(a):
    """`a`, or an aligned copy: the kernels load elements of their own type."""
    return a if a.flags.aligned else a.copy()


def as_param(p, int ct):
    """weight or bias as the kernels take it: None, 16-bit vectors as they
    are (each thread widens its own copy), else contiguous in the compute
    type."""
    if p is None:
        return None
    if p.dtype.itemsize == 2:
        return aligned(p)
    return aligned(np.ascontiguousarray(p, dtype=cnp.PyArray_DescrFromType(ct)))


def as_stats(a, int ct):
    """mean or rstd as aligned contiguous data of the compute type (the
    kernels read its M values in order; the shape does not matter)."""
    if not (a.dtype.num == ct and a.flags.c_contiguous and a.flags.aligned):
        a = aligned(np.ascontiguousarray(a, dtype=cnp.PyArray_DescrFromType(ct)))
    return a


def self_overlaps(a):
    """True when two elements of `a` share memory (e.g. stride-0 axes)."""
    span = a.itemsize
    for stride, n in sorted((abs(st), n) for st, n in zip(a.strides, a.shape) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def writes_safely(o, x, others):
    """True when the kernel can write straight into `o`: addressable, no two
    of its elements alike, and it either overlaps no input or is exactly the
    view `x` (in place: each row is read whole before it is written)."""
    if not o.flags.aligned or o.ndim > LNF_MAX_LEAD + 1 or self_overlaps(o):
        return False
    if np.may_share_memory(o, x) and not (
            o.strides == x.strides
            and o.__array_interface__["data"][0] == x.__array_interface__["data"][0]):
        return False
    return not any(a is not None and np.may_share_memory(o, a) for a in others)


# ---------------------------------------------------------------------------
# Outputs and stand-ins.

cdef object new_array(int nd, cnp.npy_intp* dims, int typenum, size_t nbytes):
    """numpy.empty, drawing buffers of LNF_POOL_MIN bytes or more from the
    output cache (lnfast._pool)."""
    if nbytes < POOL_MIN:
        return cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    old = PyDataMem_SetHandler(pool_handler)
    try:
        return cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    finally:
        PyDataMem_SetHandler(old)


cdef dict _constants = {}       # (value, D, typenum) -> read-only vector
cdef enum:
    CONSTANT_MAX_KEPT = 64


def constant(double value, cnp.npy_intp D, int typenum, bint forward=False):
    """Read-only float32 or float64 vector of D copies of `value`: the
    stand-in for weight=None (ones) or bias=None (zeros), kept for reuse.
    For the forward pass, at most LNF_CONSTANT_MAX_D copies: its map takes
    longer rows by pieces of that length, so a long row needs no stand-in
    of its length."""
    if forward and D > LNF_CONSTANT_MAX_D:
        D = LNF_CONSTANT_MAX_D
    key = (value, D, typenum)
    v = _constants.get(key)
    if v is not None:
        return v
    v = cnp.PyArray_EMPTY(1, &D, typenum, 0)
    v.fill(value)
    v.flags.writeable = False
    if D <= LNF_CONSTANT_MAX_D:
        if len(_constants) >= CONSTANT_MAX_KEPT:
            _constants.clear()
        _constants[key] = v
    return v


def constants_kept():
    """How many stand-in vectors are kept.  For tests."""
    return len(_constants)


def empty_cache():
    """Return the cached output buffers (and the cached stand-in weight
    vectors) to the system.

    Outputs of 128 KiB or more are drawn from a cache of freed buffers of
    the same size (at most ``LNFAST_CACHE_BYTES``, 1 GiB by default), which
    saves the page faults of fresh memory on repeated calls.

    Examples
    --------
    >>> import lnfast
    >>> lnfast.empty_cache()
    """
    _pool.clear_cache()
    _constants.clear()
