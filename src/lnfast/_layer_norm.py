"""LayerNorm on NumPy arrays: argument handling around the Cython kernels."""
import functools

import numpy as np

from lnfast import _checks, _cpu
from lnfast._threads import threads_for

# The kernels address at most this many (non-mergeable) leading axes; deeper
# arrays are reshaped to 2-D first.
_MAX_LEAD = 32

# dweight/dbias partial rows: at most this many chunks of rows, each summed in
# row order, and at most this many bytes of float64 partials.  The chunk grid
# depends on the shape only, never on the thread count.
_MAX_CHUNKS = 64
_MIN_ROWS_PER_CHUNK = 16
_PARTIALS_BYTES = 16 << 20


@functools.lru_cache(maxsize=64)
def _constant(value, D, dtype):
    """Read-only vector standing in for weight=None (ones) or bias=None (zeros)."""
    a = np.full(D, value, dtype=dtype)
    a.flags.writeable = False
    return a


def _vector(p, value, D, dtype):
    if p is None:
        return _constant(value, D, dtype)
    return np.ascontiguousarray(p, dtype=dtype)


def _kernel_view(a):
    """`a` itself when the kernels can address it, else a contiguous copy."""
    if a.flags.aligned and a.ndim <= _MAX_LEAD + 1:
        return a
    return np.ascontiguousarray(a).reshape(-1, a.shape[-1])


def _writes_safely(o, *inputs):
    """True when the kernel can write straight into `o`: addressable, and it
    either overlaps no input or is exactly the same view as the first (in
    place: each row is read whole before it is written)."""
    if not o.flags.aligned or o.ndim > _MAX_LEAD + 1:
        return False
    x = inputs[0]
    for a in inputs:
        if np.may_share_memory(o, a):
            same = (a is x and o.strides == x.strides
                    and o.__array_interface__["data"][0] == x.__array_interface__["data"][0])
            if not same:
                return False
    return True


def num_chunks(M, D):
    """How many fixed row chunks the backward pass sums dweight/dbias over."""
    by_rows = -(-M // _MIN_ROWS_PER_CHUNK)
    by_bytes = max(1, _PARTIALS_BYTES // (16 * D))
    return max(1, min(_MAX_CHUNKS, by_rows, by_bytes))


def _forward(x, weight, bias, eps, out, with_stats):
    D = _checks.data("x", x)
    dtype = x.dtype
    _checks.param("weight", weight, D, dtype)
    _checks.param("bias", bias, D, dtype)
    eps = _checks.eps(eps)
    if out is not None:
        _checks.out(out, x.shape, dtype)

    lead = x.shape[:-1]
    mean = np.empty(lead, dtype) if with_stats else None
    rstd = np.empty(lead, dtype) if with_stats else None
    if out is None:
        y = target = np.empty(x.shape, dtype)
    else:
        y = out
        inputs = [a for a in (x, weight, bias) if a is not None]
        target = out if _writes_safely(out, *inputs) else np.empty(x.shape, dtype)
    if x.size:
        _cpu.layer_norm_forward(
            _kernel_view(x), target,
            _vector(weight, 1.0, D, dtype), _vector(bias, 0.0, D, dtype),
            mean, rstd, eps, threads_for(x.size),
        )
    if target is not y:
        np.copyto(y, target)
    return y, mean, rstd


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, out=None):
    """LayerNorm over the last axis of `x`: (x - mean) * rstd * weight + bias.

    `out`, if given, must have x's shape and dtype and may be `x` itself.
    """
    return _forward(x, weight, bias, eps, out, False)[0]


def layer_norm_forward(x, weight=None, bias=None, *, eps=1e-5):
    """LayerNorm that also returns the row statistics: (y, mean, rstd).

    mean and rstd have shape x.shape[:-1] and x's dtype.
    """
    return _forward(x, weight, bias, eps, None, True)


def layer_norm_backward(dy, x, mean, rstd, weight=None):
    """Gradients of layer_norm: (dx, dweight, dbias).

    dweight and dbias are sums over every row, of shape (D,), in the dtype of
    `weight` (of `x` when weight is None), accumulated in float64.
    """
    D = _checks.data("x", x)
    dtype = x.dtype
    _checks.like("dy", dy, x)
    lead = x.shape[:-1]
    _checks.stats("mean", mean, lead)
    _checks.stats("rstd", rstd, lead)
    _checks.param("weight", weight, D, dtype)
    grad_dtype = dtype if weight is None else weight.dtype

    dx = np.empty(x.shape, dtype)
    M = x.size // D
    if M == 0:
        return dx, np.zeros(D, grad_dtype), np.zeros(D, grad_dtype)
    dwdb = _cpu.layer_norm_backward(
        _kernel_view(dy), _kernel_view(x),
        np.ascontiguousarray(mean, dtype=dtype).reshape(M),
        np.ascontiguousarray(rstd, dtype=dtype).reshape(M),
        _vector(weight, 1.0, D, dtype), dx,
        num_chunks(M, D), threads_for(x.size),
    )
    return dx, dwdb[0].astype(grad_dtype), dwdb[1].astype(grad_dtype)
