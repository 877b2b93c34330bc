"""lnfast for JAX, on the CPU: `layer_norm`, `rms_norm` and
`add_layer_norm`, each a `jax.custom_vjp` whose forward and backward are
XLA FFI custom calls into lnfast's C kernels.  They work under `jax.jit`,
`jax.grad` and `jax.vmap` (docs/jax.md).

    import lnfast.jax as lj
    y = jax.jit(lambda x, w, b: lj.layer_norm(x, w, b))(x, w, b)

The handlers (jax_ffi/lnfast_ffi.cc) are compiled once, on first import,
against jaxlib's FFI headers, and kept (lnfast._build).  The custom calls
exist for the CPU only: a program compiled for a GPU cannot use them
(there, use XLA's own LayerNorm).
"""
import ctypes
import functools
import pathlib
from typing import Optional, Union

import numpy as np

try:
    import jax
    import jax.numpy as jnp
    import jaxlib
    from jax import ffi as _ffi
    _ffi.ffi_call, _ffi.include_dir, _ffi.register_ffi_target     # (jax 0.5 or newer)
except (ImportError, AttributeError) as e:      # (lnfast[jax] brings it)
    raise ImportError(f"lnfast.jax needs JAX 0.5 or newer with jax.ffi: "
                      f"pip install 'lnfast[jax]' ({e})") from None

from lnfast import _build, _checks, _cpu, _threads

__all__ = ["add_layer_norm", "layer_norm", "rms_norm"]

_SOURCE = pathlib.Path(__file__).parent / "jax_ffi" / "lnfast_ffi.cc"


# --- the handlers: built, loaded and registered once ---------------------------

def _library():
    api = pathlib.Path(_ffi.include_dir()) / "xla" / "ffi" / "api"
    return _build.load("lnfast.jax", "its XLA FFI handlers", "lnfast_ffi", _SOURCE,
                       ["-std=c++17", "-O2", "-shared", "-fPIC", f"-I{_ffi.include_dir()}"],
                       sorted(api.glob("*.h")), [jaxlib.__version__])


def _register():
    lib = _library()
    lib.lnfast_ffi_set_api.argtypes = [ctypes.c_void_p] * 4
    lib.lnfast_ffi_set_api(*_cpu.c_api_addresses())
    for name in ("lnfast_norm_forward", "lnfast_norm_backward"):
        _ffi.register_ffi_target(name, _ffi.pycapsule(getattr(lib, name)), platform="cpu")
    return lib


_LIB = _register()


# --- checks (at trace time) ------------------------------------------------------

def _array(name, a):
    """The type check lnfast._checks' data and param take here: a jax.Array
    (traced ones included) or a numpy.ndarray, not a masked one."""
    if isinstance(a, np.ma.MaskedArray):
        raise TypeError(f"{name} must not be a masked array (its mask would be ignored); "
                        "pass a.filled(value) or a.data")
    if not isinstance(a, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be a JAX or NumPy array, got {type(a).__name__}")
    return a


def _held(a):
    """A tracer as one of a JAX array (jax.device_put, which adds no
    operation to a traced program): jax.vmap over a NumPy array inside a
    traced program (jit, eval_shape, checkpoint) gives a tracer of the raw
    array, which the staging of custom_vjp and custom_jvp refuses with an
    AssertionError."""
    return jax.device_put(a) if isinstance(a, jax.core.Tracer) else a


def _canonical(a):
    """A float64 NumPy array as JAX takes it (jnp.asarray): float32 with
    jax_enable_x64 off, as for every jax.numpy function; a tracer as
    _held makes it.  (Masked arrays are left for _array to refuse.)"""
    if isinstance(a, jax.core.Tracer):
        return _held(a)
    if isinstance(a, np.ndarray) and a.dtype == np.float64 and not isinstance(a, np.ma.MaskedArray):
        return jnp.asarray(a)
    return a


def _as_x(a, x):
    """A weakly typed JAX array (of a Python scalar's type, such as
    jnp.full(D, 0.5) or jnp.broadcast_to(1.0, D) gives) of real numbers in
    x's dtype, as jax.numpy's arithmetic with x takes it; any other
    argument as it is, for the checks."""
    if (isinstance(a, jax.Array) and getattr(a.aval, "weak_type", False)
            and a.dtype != x.dtype and jnp.issubdtype(a.dtype, jnp.number)
            and not jnp.issubdtype(a.dtype, jnp.complexfloating)):
        return jax.lax.convert_element_type(a, x.dtype)
    return a


def _eps(eps):
    """eps as lnfast checks it; a concrete JAX scalar is taken as its value,
    a traced one refused (eps is compiled into the call)."""
    if isinstance(eps, jax.core.Tracer):
        raise TypeError("eps must be a concrete real number (a Python float; it is "
                        "compiled into the call), got a traced value")
    if (isinstance(eps, jax.Array) and eps.shape == ()
            and (jnp.issubdtype(eps.dtype, jnp.floating) or jnp.issubdtype(eps.dtype, jnp.integer))):
        eps = float(eps)    # (as a 0-d NumPy array of either kind is taken)
    return _checks.eps(eps)


def _plan(x, axis):
    """(normalized axes, their shape, whether they are x's last ones)."""
    _checks.data("x", x, _array)
    ax = _checks.axes(axis, x.ndim)
    norm = tuple(x.shape[k] for k in ax)
    if not all(_known(n) for n in norm):
        raise ValueError(f"x's normalized axes must have known lengths (symbolic sizes, as "
                         f"jax.export takes them, only in the other axes), got shape {x.shape}")
    _checks.normalized("x", x, ax)
    return ax, norm, ax == tuple(range(x.ndim - len(ax), x.ndim))


def _known(n):
    """Whether a size is a number, not symbolic (jax.export's shape
    polymorphism)."""
    return isinstance(n, (int, np.integer))


def _threads_for(x, min_elements=_threads.PARALLEL_MIN_ELEMENTS):
    """The thread count compiled into a call on x; where x's size is symbolic
    (jax.export's shape polymorphism), the count for a large call."""
    n = x.size
    return _threads.threads_for(n if _known(n) else min_elements, min_elements)


# --- jax.shard_map: the manual mesh axes the arrays vary over ------------------------

def _aval(a):
    return jax.typeof(a) if hasattr(jax, "typeof") else None


def _varying(a):
    """The manual mesh axes a varies over inside jax.shard_map (JAX 0.10's
    manual_axis_type; older JAX: none are tracked here)."""
    mat = getattr(_aval(a), "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def _vary(*arrays):
    """arrays, each made to vary over every axis any of them varies over,
    outside the custom_vjp, so that the gradient of a replicated weight is
    summed over those axes (the transpose of the cast)."""
    axes = frozenset().union(*(_varying(a) for a in arrays))
    out = []
    for a in arrays:
        more = tuple(sorted(axes - _varying(a), key=str))
        out.append(jax.lax.pcast(a, more, to="varying") if more else a)
    return out


def _result(shape, dtype, like):
    """A custom call's result of shape and dtype, varying as `like` does
    (without which, under jax.shard_map, JAX would take it as replicated)."""
    aval = _aval(like)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and mat.varying:     # (over like's mesh)
        sharding = jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(shape, dtype)


# --- the two custom calls ----------------------------------------------------------

def _empty(dtype):
    return jnp.zeros((0,), dtype)


def _first_order(call, *arrays):
    """call(*arrays), a custom call, where differentiating it (what a
    gradient of a gradient does to the custom_vjp's passes) raises an error
    that says what is missing, instead of JAX's advice to define a JVP.
    (Concrete arrays cannot be differentiated: they take the call as it is,
    without custom_jvp's cost per eager call.)"""
    if not any(isinstance(a, jax.core.Tracer) for a in arrays):
        return call(*arrays)
    arrays = tuple(_held(a) for a in arrays)     # (a cotangent may be one of NumPy's)
    f = jax.custom_jvp(call)

    @f.defjvp
    def _(primals, tangents):
        raise TypeError("lnfast.jax's functions have first derivatives only (jax.grad, "
                        "jax.vjp): a gradient of a gradient, a Hessian or forward mode over "
                        "them is not defined")
    return f(*arrays)


def _forward_call(x, r, w, b, eps, centered):
    """(y, z, mean, rstd) over x's last axis; z and mean empty where not
    computed.  w (and b, when centered) are vectors of length D."""
    lead = x.shape[:-1]
    ct = _checks.compute_dtype(np.dtype(x.dtype))
    out = (_result(x.shape, x.dtype, x),
           _result(x.shape if r is not None else (0,), x.dtype, x),
           _result(lead if centered else (0,), ct, x),
           _result(lead, ct, x))
    call = functools.partial(_ffi.ffi_call("lnfast_norm_forward", out, vmap_method="broadcast_all"),
                             eps=np.float64(eps), centered=np.int64(centered),
                             has_residual=np.int64(r is not None),
                             nthreads=np.int64(_threads_for(x)))
    return _first_order(call, x, _empty(x.dtype) if r is None else r, w,
                        b if centered else _empty(w.dtype))


def _backward_call(dy, x, mean, rstd, w, b, dz, centered):
    """(dx, dweight, dbias) over x's last axis: dweight and dbias in w's
    and b's dtypes, each rounded once from the float64 sums."""
    D = x.shape[-1]
    out = (_result(x.shape, x.dtype, x), _result((D,), w.dtype, x), _result((D,), b.dtype, x))
    call = functools.partial(_ffi.ffi_call("lnfast_norm_backward", out, vmap_method="broadcast_all"),
                             centered=np.int64(centered), has_dz=np.int64(dz is not None),
                             nthreads=np.int64(_threads_for(
                                 x, _threads.PARALLEL_MIN_ELEMENTS_BACKWARD)))
    return _first_order(call, dy, x, mean, rstd, w, _empty(x.dtype) if dz is None else dz)


# --- differentiable rows -------------------------------------------------------------
# w and b are always arrays here (ones and zeros standing in for None).

@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _rows(x, w, b, eps, centered):
    return _forward_call(x, None, w, b, eps, centered)[0]


def _rows_fwd(x, w, b, eps, centered):
    y, _, mean, rstd = _forward_call(x, None, w, b, eps, centered)
    return y, (x, mean, rstd, w, b)


def _rows_bwd(eps, centered, saved, dy):
    x, mean, rstd, w, b = saved
    return _backward_call(dy, x, mean, rstd, w, b, None, centered)


_rows.defvjp(_rows_fwd, _rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _add_rows(x, r, w, b, eps):
    y, z, _, _ = _forward_call(x, r, w, b, eps, True)
    return y, z


def _add_rows_fwd(x, r, w, b, eps):
    y, z, mean, rstd = _forward_call(x, r, w, b, eps, True)
    return (y, z), (z, mean, rstd, w, b)


def _add_rows_bwd(eps, saved, cotangents):
    z, mean, rstd, w, b = saved
    dy, dz = cotangents
    dsum, dw, db = _backward_call(dy, z, mean, rstd, w, b, dz, True)
    return dsum, dsum, dw, db


_add_rows.defvjp(_add_rows_fwd, _add_rows_bwd)


# --- the functions ----------------------------------------------------------------

def _as_rows(a, ax, last, D):
    """a with its normalized axes ax last, merged into one of D (a reshape
    when they are last already, else a transpose XLA carries out)."""
    if not last:
        a = jnp.moveaxis(a, ax, tuple(range(a.ndim - len(ax), a.ndim)))
    return a.reshape(a.shape[:a.ndim - len(ax)] + (D,))


def _from_rows(y, shape, ax, last):
    if last:
        return y.reshape(shape)
    lead = tuple(n for k, n in enumerate(shape) if k not in ax)
    y = y.reshape(lead + tuple(shape[k] for k in ax))
    return jnp.moveaxis(y, tuple(range(y.ndim - len(ax), y.ndim)), ax)


def _vectors(x, weight, bias, norm, centered):
    """weight and bias as length-D vectors of dtypes the kernels take: their
    own, but float64 for a float32 one with float64 x (an exact cast, whose
    gradient rounds the float64 sums once); ones and zeros of the compute
    dtype for None (their gradients are then dropped)."""
    dtype = np.dtype(x.dtype)
    weight = _checks.param("weight", weight, norm, dtype, _array)
    bias = _checks.param("bias", bias, norm, dtype, _array) if centered else None
    D = int(np.prod(norm))
    ct = _checks.compute_dtype(dtype)

    def vector(p, fill):
        v = jnp.full(D, fill, ct) if p is None else jnp.reshape(p, D)
        return v.astype(ct) if v.dtype == np.float32 and ct == np.float64 else v

    w = vector(weight, 1)
    return w, jnp.zeros(D, w.dtype) if bias is None else vector(bias, 0)


def _norm(x, weight, bias, eps, axis, centered):
    x, weight, bias = _canonical(x), _canonical(weight), _canonical(bias)
    ax, norm, last = _plan(x, axis)
    weight, bias = _as_x(weight, x), _as_x(bias, x)
    eps = _eps(eps)
    w, b = _vectors(x, weight, bias, norm, centered)
    x_rows, w, b = _vary(_as_rows(x, ax, last, w.shape[0]), w, b)
    y = _rows(x_rows, w, b, eps, centered)
    return _from_rows(y, x.shape, ax, last)


ArrayLike = Union[jax.Array, np.ndarray]
Axis = Union[int, tuple[int, ...]]


def layer_norm(x: ArrayLike, weight: Optional[ArrayLike] = None,
               bias: Optional[ArrayLike] = None, *, eps: float = 1e-5,
               axis: Axis = -1) -> jax.Array:
    """LayerNorm, ``(x - mean) * rstd * weight + bias``, as an XLA custom call.

    Works under `jax.jit`, `jax.grad` (reverse mode) and `jax.vmap`.

    Parameters
    ----------
    x : jax.Array or numpy.ndarray
        float32, float64 (with ``jax_enable_x64``), float16 or bfloat16, on
        the CPU.
    weight, bias : array or None, optional
        Of the normalized axes' shape, in x's dtype or float32; None means
        ones and zeros.
    eps : float, optional
        Added to the variance.
    axis : int or tuple of ints, optional
        The normalized axes (the last by default).

    Returns
    -------
    jax.Array
        x's shape and dtype.

    Examples
    --------
    >>> import jax, numpy as np, lnfast.jax as lj
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    >>> y = jax.jit(lambda x: lj.layer_norm(x, eps=0.0))(x)
    >>> np.asarray(y).round(4)
    array([[-1.3416, -0.4472,  0.4472,  1.3416]], dtype=float32)
    """
    return _norm(x, weight, bias, eps, axis, True)


def rms_norm(x: ArrayLike, weight: Optional[ArrayLike] = None, *, eps: float = 1e-5,
             axis: Axis = -1) -> jax.Array:
    """RMSNorm, ``x * rstd * weight``, as an XLA custom call.

    Parameters
    ----------
    x : jax.Array or numpy.ndarray
        As `layer_norm`'s.
    weight : array or None, optional
        Of the normalized axes' shape, in x's dtype or float32.
    eps : float, optional
        Added to the mean square.
    axis : int or tuple of ints, optional
        The normalized axes (the last by default).

    Returns
    -------
    jax.Array
        x's shape and dtype.

    Examples
    --------
    >>> import numpy as np, lnfast.jax as lj
    >>> np.asarray(lj.rms_norm(np.array([[3.0, 4.0]], np.float32), eps=0.0)).round(4)
    array([[0.8485, 1.1314]], dtype=float32)
    """
    return _norm(x, weight, None, eps, axis, False)


def add_layer_norm(x: ArrayLike, residual: ArrayLike, weight: Optional[ArrayLike] = None,
                   bias: Optional[ArrayLike] = None, *, eps: float = 1e-5,
                   axis: Axis = -1) -> tuple[jax.Array, jax.Array]:
    """The pre-norm residual step in one custom call: ``z = x + residual``,
    ``y = layer_norm(z)``.

    Parameters
    ----------
    x, residual : jax.Array or numpy.ndarray
        Of one shape and dtype (as `layer_norm`'s x).
    weight, bias : array or None, optional
        As `layer_norm`'s.
    eps : float, optional
        Added to the variance.
    axis : int or tuple of ints, optional
        The normalized axes (the last by default).

    Returns
    -------
    y, z : jax.Array
        The LayerNorm of z, and z; differentiable in both.

    Examples
    --------
    >>> import numpy as np, lnfast.jax as lj
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    >>> y, z = lj.add_layer_norm(x, np.ones_like(x))
    >>> np.asarray(z)
    array([[2., 3., 4., 5.]], dtype=float32)
    """
    x, residual = _canonical(x), _canonical(residual)
    weight, bias = _canonical(weight), _canonical(bias)
    ax, norm, last = _plan(x, axis)
    residual, weight, bias = _as_x(residual, x), _as_x(weight, x), _as_x(bias, x)
    _checks.data("residual", residual, _array)
    if residual.dtype != x.dtype:
        raise TypeError(f"residual must have x's dtype ({x.dtype}), got {residual.dtype}")
    if tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, "
                         f"got {tuple(residual.shape)}")
    eps = _eps(eps)
    w, b = _vectors(x, weight, bias, norm, True)
    D = w.shape[0]
    y, z = _add_rows(*_vary(_as_rows(x, ax, last, D), _as_rows(residual, ax, last, D), w, b),
                     eps)
    return _from_rows(y, x.shape, ax, last), _from_rows(z, x.shape, ax, last)
