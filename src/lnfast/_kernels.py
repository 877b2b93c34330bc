"""Glue between the public functions and the Cython kernels: output
allocation, out= handling, weight defaults and the thread and chunk choices.
Arguments arrive checked (lnfast._checks)."""
import functools
import math
import os

import numpy as np

from lnfast import _cpu, _pool
from lnfast._checks import compute_dtype
from lnfast._threads import PARALLEL_MIN_ELEMENTS_BACKWARD, threads_for

# The kernels address at most this many (non-mergeable) leading axes; deeper
# arrays are reshaped to 2-D first.
_MAX_LEAD = 32

def _cache_limit_from_env():
    text = os.environ.get("LNFAST_CACHE_BYTES")
    if text is None:
        return 1 << 30
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if not 0 <= limit < 1 << 64:
        raise ValueError(f"LNFAST_CACHE_BYTES must be an integer from 0 to 2**64 - 1, "
                         f"got {text!r}")
    return limit


_pool.set_cache_limit(_cache_limit_from_env())
_CACHE_MIN = _pool.MIN_BYTES


def empty_cache():
    """Return the cached output buffers (and the cached stand-in weight
    vectors) to the system (see docs/api.md)."""
    _pool.clear_cache()
    _cpu.drop_constants()


def _empty(shape, dtype, nbytes=None):
    """An output array (of `nbytes` bytes, when the caller knows); large
    ones reuse buffers of dead lnfast outputs."""
    if (math.prod(shape) * dtype.itemsize if nbytes is None else nbytes) >= _CACHE_MIN:
        return _pool.empty(shape, dtype)
    return np.empty(shape, dtype)


def _aligned(a):
    """`a`, or an aligned copy: the kernels load elements of their own type."""
    return a if a.flags.aligned else a.copy()


def _vector(p, value, D, dtype, forward=False):
    """weight or bias as the kernels take it: a read-only stand-in of
    `value` kept for reuse (None; for the forward pass of long rows, shorter
    than D: _cpu.constant), 16-bit weights as they are (each thread widens
    its own copy), else contiguous in the compute dtype."""
    if p is None:
        return _cpu.constant(value, D, dtype.num, forward)
    if p.dtype.itemsize == 2:
        return _aligned(p)
    return _aligned(np.ascontiguousarray(p, dtype=dtype))


def _rows(a, dtype):
    """mean or rstd as aligned contiguous data of the compute dtype (the
    kernels read its M values in order; the shape does not matter)."""
    if not (a.dtype == dtype and a.flags.c_contiguous and a.flags.aligned):
        a = _aligned(np.ascontiguousarray(a, dtype=dtype))
    return a


def _kernel_view(a):
    """`a` itself when the kernels can address it, else an aligned C copy."""
    if a is None or (a.flags.aligned and a.ndim <= _MAX_LEAD + 1):
        return a
    return np.array(a, order="C").reshape(-1, a.shape[-1])


def self_overlaps(a):
    """True when two elements of `a` share memory (e.g. stride-0 axes)."""
    span = a.itemsize
    for stride, n in sorted((abs(st), n) for st, n in zip(a.strides, a.shape) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def _writes_safely(o, x, others):
    """True when the kernel can write straight into `o`: addressable, no two
    of its elements alike, and it either overlaps no input or is exactly the
    view `x` (in place: each row is read whole before it is written)."""
    if not o.flags.aligned or o.ndim > _MAX_LEAD + 1 or self_overlaps(o):
        return False
    if np.may_share_memory(o, x) and not (
            o.strides == x.strides
            and o.__array_interface__["data"][0] == x.__array_interface__["data"][0]):
        return False
    return not any(a is not None and np.may_share_memory(o, a) for a in others)


# How many fixed row chunks the backward pass sums dweight/dbias over: a
# function of the shape only (cpu/config.h).
num_chunks = _cpu.num_chunks


# The common call (NumPy arrays, contiguous data, weight and bias None or of
# x's or the compute dtype, a float eps, no out=; docs/api.md) runs
# unchecked by Python, in one Cython function that recognises it and returns
# what forward or backward would, or None for any other call, which then
# takes the general path:
#   forward_common(x, residual, weight, bias, eps, centered, stats)
#       -> (y, z, mean, rstd), mean and rstd only when `stats`
#   backward_common(dy, x, mean, rstd, weight, dz, centered)
#       -> (dx, dweight, dbias)
forward_common = functools.partial(_cpu.forward_common, threads_for)


def forward(x, weight, bias, eps, *, centered, residual=None, out=None,
            with_mean=False, with_rstd=False):
    """Normalize the rows of x (of x + residual): returns (y, z, mean, rstd),
    z and the statistics None where not asked for."""
    dtype, D, lead = x.dtype, x.shape[-1], x.shape[:-1]
    compute = compute_dtype(dtype)
    mean = _empty(lead, compute) if with_mean else None
    rstd = _empty(lead, compute) if with_rstd else None
    z = _empty(x.shape, dtype, x.nbytes) if residual is not None else None
    if out is None:
        y = target = _empty(x.shape, dtype, x.nbytes)
    else:
        y = out
        safe = _writes_safely(out, x, (residual, weight, bias))
        target = out if safe else np.empty(x.shape, dtype)
    if x.size:
        _cpu.forward(_kernel_view(x), _kernel_view(residual), z, target,
                     _vector(weight, 1.0, D, compute, True), _vector(bias, 0.0, D, compute, True),
                     mean, rstd, eps, centered, min(threads_for(x.size), x.size // D))
    if target is not y:
        np.copyto(y, target)
    return y, z, mean, rstd


def backward(dy, x, mean, rstd, weight, *, centered, dz=None):
    """(dx [+ dz], dweight, dbias) for the rows of x; dweight and dbias in the
    weight's dtype (the compute dtype when weight is None)."""
    dtype, D = x.dtype, x.shape[-1]
    compute = compute_dtype(dtype)
    M = x.size // D
    grad_dtype = compute if weight is None else weight.dtype
    dx = _empty(x.shape, dtype, x.nbytes)
    if M == 0:
        return dx, np.zeros(D, grad_dtype), np.zeros(D, grad_dtype)
    nchunks = num_chunks(M, D)
    dwdb = np.empty((2, D), grad_dtype)     # (summed in float64, rounded once in the kernel)
    _cpu.backward(
        _kernel_view(dy), _kernel_view(x), _kernel_view(dz),
        _rows(mean, compute) if centered else None, _rows(rstd, compute),
        _vector(weight, 1.0, D, compute), dx, dwdb, nchunks, centered,
        min(threads_for(x.size, PARALLEL_MIN_ELEMENTS_BACKWARD), nchunks))
    return dx, dwdb[0], dwdb[1]


backward_common = functools.partial(_cpu.backward_common, threads_for,
                                    PARALLEL_MIN_ELEMENTS_BACKWARD)
