"""LayerNorm and RMSNorm on CuPy arrays: the CUDA kernels of kernels/norm.cu.

The same entry points as lnfast._kernels (forward, backward), reached through
lnfast._dispatch when the arrays are CuPy's; the same checks (lnfast._checks).  CuPy is imported here, on the
first GPU call, never by `import lnfast`.
"""
import functools
import math
from importlib import resources

import numpy as np

from lnfast import _checks
from lnfast._checks import HALF_DTYPES, compute_dtype

_SOURCE = "kernels/norm.cu"

# dtype -> (CUDA element type, CUDA type of mean and rstd)
_CTYPES = {
    np.dtype(np.float32): ("float", "float"),
    np.dtype(np.float64): ("double", "double"),
    HALF_DTYPES[0]: ("__half", "float"),
    HALF_DTYPES[1]: ("__nv_bfloat16", "float"),
}
# dtype of dweight/dbias as the reduce kernel writes them -> its instantiation
_REDUCE = {np.dtype(np.float64): "lnf::norm_backward_reduce<double>",
           np.dtype(np.float32): "lnf::norm_backward_reduce<float>"}

_PARTIAL_BYTES = 64 << 20       # cap on the backward pass's partial rows

# Compiler options: no FMA contraction, as on the CPU.
OPTIONS = ("--std=c++17", "--fmad=false")


def _cupy():
    import cupy

    return cupy


def _vec_widths(dtype):
    """Elements per access: 1 (scalar path) or a 16-byte pack."""
    return (1, 16 // dtype.itemsize)


def _name(kernel, dtype, vec, centered):
    t, s = _CTYPES[dtype]
    return f"lnf::{kernel}<{t}, {s}, {vec}, {'true' if centered else 'false'}>"


def name_expressions():
    """Every kernel instantiation the module is built with."""
    names = []
    for dtype in _CTYPES:
        for vec in _vec_widths(dtype):
            for centered in (True, False):
                names.append(_name("norm_forward", dtype, vec, centered))
                names.append(_name("norm_backward_partial", dtype, vec, centered))
    return names + list(_REDUCE.values())


def source():
    """(path, text) of the CUDA source shipped in the package."""
    path = resources.files("lnfast").joinpath(_SOURCE)
    return str(path), path.read_text()


def code():
    """The module's source: norm.cu, with a #line directive so that compiler
    errors name the file."""
    path, text = source()
    return f'#line 1 "{path.replace(chr(92), "/")}"\n{text}'


@functools.lru_cache(maxsize=None)
def _module(device_id):
    """The compiled RawModule, one per device."""
    cp = _cupy()
    with cp.cuda.Device(device_id):
        return cp.RawModule(code=code(), options=OPTIONS,
                            name_expressions=name_expressions())


def _kernel(name):
    cp = _cupy()
    return _module(cp.cuda.Device().id).get_function(name)


@functools.lru_cache(maxsize=None)
def _sm_count(device_id):
    return _cupy().cuda.Device(device_id).attributes["MultiProcessorCount"]


def usable():
    """(True, description) when CuPy sees a GPU, else (False, why not)."""
    try:
        cp = _cupy()
    except ImportError:
        return False, "no (CuPy is not installed)"
    try:
        if not cp.is_available():
            return False, f"no (CuPy {cp.__version__} finds no CUDA device)"
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        return True, f"yes (CuPy {cp.__version__}, {name})"
    except Exception as e:      # a broken driver or runtime: report, don't fail
        return False, f"no ({type(e).__name__}: {e})"


# --- row layout ------------------------------------------------------------

def _rows(arrays, lead_shape):
    """Leading layout shared by `arrays` (all of shape lead_shape + (D,)):
    (n0, n1, n2) and each array's element strides (s0, s1, s2, inner), or
    None when more than three leading axes stay after merging."""
    itemsize = arrays[0].itemsize
    strides = [[s // itemsize for s in a.strides] for a in arrays]
    dims = [k for k, n in enumerate(lead_shape) if n != 1]
    shape = []
    per = [[] for _ in arrays]
    for k in dims:
        mergeable = shape and all(p[-1] == st[k] * lead_shape[k] for p, st in zip(per, strides))
        if mergeable:
            shape[-1] *= lead_shape[k]
            for p, st in zip(per, strides):
                p[-1] = st[k]
        else:
            shape.append(lead_shape[k])
            for p, st in zip(per, strides):
                p.append(st[k])
    if len(shape) > 3:
        return None
    pad = 3 - len(shape)
    shape = [1] * pad + shape
    return shape, [[0] * pad + p + [st[-1]] for p, st in zip(per, strides)]


def _vector_ok(arrays, row_strides, D, vec):
    """16-byte accesses are safe: contiguous, aligned rows, D a multiple."""
    if vec == 1 or D % vec:
        return False
    for a, st in zip(arrays, row_strides):
        if st[3] != 1 or a.data.ptr % 16 or any(s * a.itemsize % 16 for s in st[:3]):
            return False
    return True


def _threads(D, vec):
    """Threads per row: a warp for short rows, up to 512 with ~4 packs each."""
    n = -(-D // (vec * 4))
    return int(min(512, max(32, -(-n // 32) * 32)))


def _row_args(a, st):
    null = np.uint64(0)
    if a is None:
        return [null, np.int64(0), np.int64(0), np.int64(0), np.int64(1)]
    return [a] + [np.int64(s) for s in st]


def _prepare(inputs, lead_shape):
    """Row layout for the inputs (None entries skipped), copying them to
    C order in the rare case of more than three unmergeable leading axes."""
    present = [a for a in inputs if a is not None]
    layout = _rows(present, lead_shape)
    if layout is None:
        cp = _cupy()
        inputs = [None if a is None else cp.ascontiguousarray(a) for a in inputs]
        present = [a for a in inputs if a is not None]
        layout = _rows(present, lead_shape)
    shape, per = layout
    it = iter(per)
    strides = [None if a is None else next(it) for a in inputs]
    return inputs, shape, strides


def _vector(p, value, D, dtype):
    """weight or bias as a contiguous, 16-byte aligned vector of `dtype`
    (kernels/norm.cu reads it in packs of up to 16 bytes); for None, a
    vector of `value` filled on the call's stream (a kept one could be read
    on another stream before its fill had run)."""
    cp = _cupy()
    if p is None:
        return cp.full(D, value, dtype=dtype)
    v = cp.ascontiguousarray(p, dtype=dtype)
    return v if v.data.ptr % 16 == 0 else v.copy()


# --- entry points (those of lnfast._kernels, the CPU backend) ---------------

def forward(x, residual, weight, bias, eps, out, centered, stats, z_out=None):
    eps = _checks.forward_args(x, residual, weight, bias, eps, out, centered)
    with x.device:      # outputs, kernels and launches on x's device
        y, z, mean, rstd = _forward(x, weight, bias, eps, centered, residual, out,
                                    stats and centered, stats)
    if z_out is not None:
        z_out[...] = z
        z = z_out
    return y, z, mean, rstd


def backward(dy, x, mean, rstd, weight, dz, centered, x_name="x", dx_out=None, partials=False):
    _checks.backward_args(dy, x, mean, rstd, weight, dz, centered, x_name)
    with x.device:
        dx, dw, db = _backward(dy, x, mean, rstd, weight, centered, dz, partials)
    if dx_out is not None:
        dx_out[...] = dx
        dx = dx_out
    return dx, dw, db


def empty(shape, dtype):
    """An uninitialized C-ordered CuPy array on the current device."""
    return _cupy().empty(shape, dtype)


def _forward(x, weight, bias, eps, centered, residual, out, with_mean, with_rstd):
    cp = _cupy()
    dtype, D, lead = x.dtype, x.shape[-1], x.shape[:-1]
    compute = compute_dtype(dtype)
    M = math.prod(lead)
    mean = cp.empty(lead, compute) if with_mean else None
    rstd = cp.empty(lead, compute) if with_rstd else None
    z = cp.empty(x.shape, dtype) if residual is not None else None
    # Write straight into `out` when it is an aligned C-ordered array that
    # overlaps no input, or is exactly x (each element is read before the
    # thread that reads it writes it).
    direct = (out is not None and out.flags.c_contiguous and out.data.ptr % 16 == 0
              and (out is x or not cp.may_share_memory(out, x))
              and not any(a is not None and cp.may_share_memory(out, a)
                          for a in (residual, weight, bias)))
    y = out if direct else cp.empty(x.shape, dtype)
    if M:
        (x, residual), n, st = _prepare([x, residual], lead)
        rows = [a for a in (x, residual) if a is not None]
        row_st = [s for s in st if s is not None]
        vec = _vec_widths(dtype)[1]
        vec = vec if _vector_ok(rows, row_st, D, vec) else 1
        kernel = _kernel(_name("norm_forward", dtype, vec, centered))
        grid = int(min(M, 32 * _sm_count(cp.cuda.Device().id)))
        w = _vector(weight, 1.0, D, compute)
        b = _vector(bias, 0.0, D, compute) if centered else w     # (RMSNorm: unread)
        kernel((grid,), (_threads(D, vec),),
               (*_row_args(x, st[0]), *_row_args(residual, st[1]),
                z if z is not None else np.uint64(0), y, w, b,
                mean if mean is not None else np.uint64(0),
                rstd if rstd is not None else np.uint64(0),
                np.int64(M), np.int64(D), np.int64(n[1]), np.int64(n[2]), np.float64(eps)))
    if out is not None and y is not out:
        out[...] = y
        y = out
    return y, z, mean, rstd


def _backward(dy, x, mean, rstd, weight, centered, dz, partials=False):
    """(dx, dweight, dbias); with `partials`, dweight and dbias are the
    float64 sums, unrounded (as lnfast._kernels.backward's)."""
    cp = _cupy()
    dtype, D, lead = x.dtype, x.shape[-1], x.shape[:-1]
    compute = compute_dtype(dtype)
    M = math.prod(lead)
    grad_dtype = np.dtype(np.float64) if partials else compute if weight is None else weight.dtype
    dx = cp.empty(x.shape, dtype)
    if M == 0:
        return dx, cp.zeros(D, grad_dtype), cp.zeros(D, grad_dtype)
    (dy, x, dz), n, st = _prepare([dy, x, dz], lead)
    rows = [v for v in (dy, x, dz) if v is not None]
    vec = _vec_widths(dtype)[1]
    vec = vec if _vector_ok(rows, [v for v in st if v is not None], D, vec) else 1
    # Blocks, each with float64 partial rows: fixed for a shape and a device.
    G = int(max(1, min(M, 2 * _sm_count(cp.cuda.Device().id),
                       _PARTIAL_BYTES // (2 * D * 8))))
    part = cp.empty((G, 2 * D), np.float64)
    mean_k = cp.ascontiguousarray(mean, dtype=compute).reshape(M) if centered else None
    rstd_k = cp.ascontiguousarray(rstd, dtype=compute).reshape(M)
    _kernel(_name("norm_backward_partial", dtype, vec, centered))(
        (G,), (_threads(D, vec),),
        (*_row_args(dy, st[0]), *_row_args(x, st[1]), *_row_args(dz, st[2]),
         mean_k if mean_k is not None else np.uint64(0), rstd_k,
         _vector(weight, 1.0, D, compute), dx, part,
         np.int64(M), np.int64(D), np.int64(n[1]), np.int64(n[2])))
    # float32 dweight/dbias are rounded by the kernel; 16-bit ones cast from float64
    dwdb = cp.empty((2, D), np.float32 if grad_dtype == np.float32 else np.float64)
    _kernel(_REDUCE[dwdb.dtype])(
        (int(min(-(-2 * D // 256), 4096)),), (256,),
        (part, np.int64(G), np.int64(2 * D), dwdb))
    return dx, dwdb[0].astype(grad_dtype), dwdb[1].astype(grad_dtype)
