"""Argument checks shared by every public function.

Each check raises before any output is written, so a failed call leaves its
arguments unchanged.  Messages name the argument, what was expected and what
was given: TypeError for a wrong type or dtype, ValueError for a wrong shape
or value (SPEC "Bad input").
"""
import math
import numbers
import sys

import ml_dtypes
import numpy as np

HALF_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
FLOAT_DTYPES = frozenset((np.dtype(np.float32), np.dtype(np.float64)) + HALF_DTYPES)
_HALVES = frozenset(HALF_DTYPES)
_FLOAT_NAMES = "float32, float64, float16 or bfloat16"


def is_cupy(a):
    """A CuPy array, recognised without importing CuPy."""
    t = type(a)
    return t is not np.ndarray and t.__name__ == "ndarray" and t.__module__.startswith("cupy")


def is_dask(a):
    """A Dask array, recognised without importing Dask."""
    mod = sys.modules.get("dask.array")
    return mod is not None and isinstance(a, mod.Array)


def array(name, a):
    if type(a) is np.ndarray:           # the common case, decided quickly
        return a
    if not (isinstance(a, np.ndarray) or is_cupy(a) or is_dask(a)):
        raise TypeError(f"{name} must be a numpy.ndarray, cupy.ndarray or dask.array.Array, "
                        f"got {type(a).__name__}")
    if type(a) is not np.ndarray and isinstance(a, np.ma.MaskedArray):
        raise TypeError(f"{name} must not be a masked array (its mask would be ignored); "
                        "pass a.filled(value) or a.data")
    if isinstance(a, np.matrix):
        raise TypeError(f"{name} must not be a numpy.matrix (it stays 2-D when reshaped); "
                        f"pass np.asarray({name})")
    return a


def _got(dtype, written=False):
    """A dtype as an error names it: a byte order not the machine's said so
    (written: of an array lnfast writes into, which a converted copy would
    not serve)."""
    if getattr(dtype, "isnative", True):     # (JAX's key types have no byte order)
        return str(dtype)
    if written:
        return f"{dtype.str} (not the machine's byte order, which lnfast writes)"
    return (f"{dtype.str} (not the machine's byte order: pass "
            f"a.astype(a.dtype.newbyteorder('=')))")


def data(name, a, kind=array):
    """An input holding rows to normalize (x, residual): a float array of at
    least one axis.  kind: the check of its type (lnfast.jax has its own)."""
    kind(name, a)
    if a.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype {_FLOAT_NAMES}, got {_got(a.dtype)}")
    if a.ndim == 0:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d array")
    return a


def axes(axis, ndim, x_name="x"):
    """`axis` (SPEC "Axes": an int or a tuple of ints, negative from the
    end) as a sorted tuple of distinct axes in [0, ndim).  A repeated or
    out-of-range axis is a ValueError (numpy's AxisError for out of range),
    any other kind a TypeError.  x_name: the array's name in the messages."""
    items = axis if type(axis) is tuple else (axis,)
    if not items:
        raise ValueError("axis must name at least one axis, got ()")
    seen = []
    for a in items:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, numbers.Integral):
            raise TypeError(f"axis must be an int or a tuple of ints, got {axis!r}")
        k = int(a)
        if not -ndim <= k < ndim:
            raise np.exceptions.AxisError(
                f"axis {k} is out of range for {x_name} of {ndim} dimension(s) (axis={axis!r})")
        k %= ndim
        if k in seen:
            raise ValueError(f"axis must not repeat an axis, got {axis!r}")
        seen.append(k)
    return tuple(sorted(seen))


def normalized(name, a, ax):
    """The shape of a's normalized axes `ax` (sorted, from axes()); their
    product D must be at least 1."""
    shape = tuple(a.shape[k] for k in ax)
    if 0 in shape:
        where = "a last axis" if ax == (a.ndim - 1,) else f"normalized axes {ax}"
        raise ValueError(f"{name} must have {where} of non-zero length (D >= 1), "
                         f"got shape {a.shape}")
    return shape


def unknown(n):
    """Whether a length is of unknown size (NaN: a Dask array's rows)."""
    return math.isnan(n)


def same_shape(a, b):
    """Shapes a and b alike, a length of unknown size matching only another;
    the blocks' own shapes are checked when they run."""
    return len(a) == len(b) and all(m == n or (unknown(m) and unknown(n)) for m, n in zip(a, b))


def like(name, a, x, x_name="x"):
    """An array that must match x in shape and dtype (dy, dz, residual)."""
    array(name, a)
    if a.dtype != x.dtype:
        raise TypeError(f"{name} must have the dtype of {x_name} ({x.dtype}), got {_got(a.dtype)}")
    if not same_shape(a.shape, x.shape):
        raise ValueError(f"{name} must have the shape of {x_name} {x.shape}, got {a.shape}")
    return a


def param(name, p, shape, dtype, kind=array, x_name="x"):
    """weight or bias: None, or an array of the normalized axes' shape (a
    length-D vector for one axis), of x's dtype or float32.  kind: as
    data's; x_name: x's name in the messages."""
    if p is None:
        return None
    kind(name, p)
    if p.dtype != dtype and p.dtype != np.float32:
        also = "" if dtype == np.float32 else " or float32"
        raise TypeError(f"{name} must have dtype {dtype} (that of {x_name}){also}, got {_got(p.dtype)}")
    if p.shape != shape:
        raise ValueError(f"{name} must have shape {shape} (the normalized axes'), got {p.shape}")
    return p


def scalar_stat(s):
    """mean or rstd as np.mean returns them for a 1-D x: a NumPy scalar,
    taken as the 0-d array it stands for (SPEC "Axes").  Python numbers
    stay a TypeError (stats)."""
    return np.asarray(s) if isinstance(s, np.generic) else s


def stats(name, s, shape, x_name="x"):
    """mean or rstd as returned by a forward pass: float, x's shape without
    the normalized axes (x_name: x's name in the messages)."""
    array(name, s)
    if s.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype {_FLOAT_NAMES}, got {_got(s.dtype)}")
    if not same_shape(s.shape, shape):
        raise ValueError(
            f"{name} must have shape {shape} ({x_name}'s without the normalized axes), "
            f"got {s.shape}")
    return s


_FLOAT32 = np.dtype(np.float32)


def compute_dtype(dtype):
    """The arithmetic type of the kernels for data of `dtype`: float32 for
    the 16-bit types, else the type itself.  mean, rstd and (with
    weight=None) dweight and dbias have this dtype."""
    return _FLOAT32 if dtype in _HALVES else dtype


def _real_dtype(dtype):
    """Whether a dtype holds real numbers: NumPy's floats and integers, and
    ml_dtypes' (bfloat16, int4 and the rest, of kind 'V')."""
    if dtype.kind in ("f", "i", "u"):
        return True
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo) if dtype.kind == "V" else ():
        try:
            info(dtype)
            return True
        except ValueError:              # (a void or structured dtype)
            pass
    return False


def eps(value):
    given = value
    if type(value) is not float:        # the common case skips the ABC check
        array = type(value) is np.ndarray or is_cupy(value)     # (not masked, not Dask)
        numpy_number = (array and value.ndim == 0) or isinstance(value, np.generic)
        if numpy_number and _real_dtype(value.dtype):
            value = value.item()        # (as NumPy takes a 0-d array for a number)
        elif numpy_number or isinstance(value, bool) or not isinstance(value, numbers.Real):
            # (a timedelta64 is a numbers.Integral, not a real number here)
            what = type(value).__name__
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                what += f" of dtype {value.dtype} and shape {value.shape}"
            raise TypeError(f"eps must be a real number, got {what}")
        try:
            value = float(value)
        except OverflowError:           # an int past float64's range
            raise ValueError(f"eps must be finite and >= 0, got an integer of "
                             f"{value.bit_length()} bits") from None
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"eps must be finite and >= 0, got {given!r}")
    return value


def out(o, shape, dtype):
    array("out", o)
    if o.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {_got(o.dtype, written=True)}")
    if o.shape != shape:
        raise ValueError(f"out must have shape {shape}, got {o.shape}")
    if not getattr(o.flags, "writeable", True):     # CuPy arrays are always writeable
        raise ValueError("out must be writeable, got a read-only array")
    return o


def rows(name, x, axis):
    """x's normalized axes for `axis`, and their shape."""
    data(name, x)
    ax = axes(axis, x.ndim, name)
    return ax, normalized(name, x, ax)


def forward_args(x, residual, weight, bias, eps_value, out_array, centered, axis=-1):
    """A forward call's arguments, in the order the functions name them (bias
    only when centered, residual and out when given); returns eps as a
    float.  Shared by the CPU and GPU backends and lnfast._axes."""
    _, shape = rows("x", x, axis)
    param("weight", weight, shape, x.dtype)
    if centered:
        param("bias", bias, shape, x.dtype)
    value = eps(eps_value)
    if residual is not None:
        like("residual", residual, x)
    if out_array is not None:
        out(out_array, x.shape, x.dtype)
    return value


def backward_args(dy, x, mean, rstd, weight, dz, centered, x_name="x", axis=-1):
    """A backward call's arguments (mean only when centered, dz when given);
    x_name: x's name in the messages.  Shared by the CPU and GPU backends
    and lnfast._axes."""
    ax, shape = rows(x_name, x, axis)
    like("dy", dy, x, x_name)
    lead = tuple(n for k, n in enumerate(x.shape) if k not in ax)
    if centered:
        stats("mean", mean, lead, x_name)
    stats("rstd", rstd, lead, x_name)
    param("weight", weight, shape, x.dtype, x_name=x_name)
    if dz is not None:
        like("dz", dz, x, x_name)
