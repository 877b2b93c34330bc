"""lnfast for JAX, on the CPU: `layer_norm`, `rms_norm` and
`add_layer_norm`, each a `jax.custom_vjp` whose forward and backward are
XLA FFI custom calls into lnfast's C kernels.  They work under `jax.jit`,
`jax.grad` and `jax.vmap` (docs/jax.md).

    import lnfast.jax as lj
    y = jax.jit(lambda x, w, b: lj.layer_norm(x, w, b))(x, w, b)

The handlers (jax_ffi/lnfast_ffi.cc) are compiled once, on first import,
against jaxlib's FFI headers with the machine's C++ compiler ($CXX, else
c++, g++ or clang++), and cached (LNFAST_CACHE_DIR, else
$XDG_CACHE_HOME/lnfast or ~/.cache/lnfast, else a temporary folder) under
a name that changes with the source, the headers, jaxlib, the compiler and
the machine.  They link nothing: lnfast._cpu hands them the C API's
addresses.  The custom calls exist for the CPU only: a program compiled
for a GPU cannot use them (there, use XLA's own LayerNorm).
"""
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import tempfile
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

from lnfast import _checks, _cpu, _threads

__all__ = ["add_layer_norm", "layer_norm", "rms_norm"]

_HERE = pathlib.Path(__file__).parent
_SOURCE = _HERE / "jax_ffi" / "lnfast_ffi.cc"
_HEADERS = (_HERE / "cpu" / "lnfast_cpu.h", _HERE / "cpu" / "config.h")


# --- the handlers: built, loaded and registered once ---------------------------

def _cache_dirs():
    """Where the library may be kept: LNFAST_CACHE_DIR, else the user's
    cache; then a temporary directory, where those cannot be written."""
    env = os.environ.get("LNFAST_CACHE_DIR")
    if env:
        yield pathlib.Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
        yield pathlib.Path(base) / "lnfast"
    user = os.getuid() if hasattr(os, "getuid") else 0
    yield pathlib.Path(tempfile.gettempdir()) / f"lnfast-{user}"


def _compiler():
    cxx = os.environ.get("CXX")
    cmd = shlex.split(cxx) if cxx else next(
        ([c] for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if not cmd:
        raise ImportError("lnfast.jax compiles its XLA FFI handlers on first import and needs "
                          "a C++17 compiler: install g++ or clang++, or set CXX")
    return cmd


def _run(cmd, what):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise ImportError(f"lnfast.jax could not run the C++ compiler for {what} "
                          f"({' '.join(cmd)}): {e}") from None


def _key(flags):
    """A name for the library: it changes with the source, the headers,
    jaxlib and its FFI headers, the compiler and the machine."""
    digest = hashlib.sha256(" ".join(flags).encode())
    api = pathlib.Path(_ffi.include_dir()) / "xla" / "ffi" / "api"
    for f in (_SOURCE, *_HEADERS, *sorted(api.glob("*.h"))):
        digest.update(f.read_bytes())
    version = _run(flags[:flags.index("-std=c++17")] + ["--version"], "its version")
    for part in (jaxlib.__version__, platform.machine(), version.stdout):
        digest.update(part.encode())
    return f"lnfast_ffi-{digest.hexdigest()[:20]}.so"


def _compile(out, flags):
    """Compile into `out`, through a temporary file of the same directory
    (the rename is atomic: a concurrent import sees all of it or none)."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".tmp")
    os.close(fd)
    try:
        p = _run(flags + ["-o", tmp], "the handlers")
        if p.returncode != 0:
            raise ImportError("lnfast.jax could not compile its XLA FFI handlers:\n"
                              + " ".join(flags) + "\n" + p.stderr[-3000:])
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _library():
    """The handlers, loaded: from the cache, else compiled first (again
    where a cached file does not load)."""
    flags = _compiler() + ["-std=c++17", "-O2", "-shared", "-fPIC",
                           f"-I{_ffi.include_dir()}", f"-I{_HEADERS[0].parent}", str(_SOURCE)]
    name = _key(flags)
    errors = []
    for folder in _cache_dirs():
        out = folder / name
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for attempt in range(2):
                if not out.exists():
                    _compile(out, flags)
                try:
                    return ctypes.CDLL(str(out))
                except OSError as e:        # (a damaged file: compiled again, once)
                    errors.append(f"{out}: {e}")
                    out.unlink()
        except OSError as e:                # (a folder that cannot be written)
            errors.append(f"{folder}: {e}")
    raise ImportError("lnfast.jax could not keep or load its XLA FFI handlers: "
                      + "; ".join(errors))


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
    """The type check lnfast._checks' data and param take here: anything
    with a dtype and a shape (jax.Array, numpy.ndarray, ...)."""
    if not hasattr(a, "dtype") or not hasattr(a, "shape"):
        raise TypeError(f"{name} must be a JAX or NumPy array, got {type(a).__name__}")
    return a


def _plan(x, axis):
    """(normalized axes, their shape, whether they are x's last ones)."""
    _checks.data("x", x, _array)
    ax = _checks.axes(axis, x.ndim)
    _checks.normalized("x", x, ax)
    return ax, tuple(x.shape[k] for k in ax), ax == tuple(range(x.ndim - len(ax), x.ndim))


# --- the two custom calls ----------------------------------------------------------

def _empty(dtype):
    return jnp.zeros((0,), dtype)


def _forward_call(x, r, w, b, eps, centered):
    """(y, z, mean, rstd) over x's last axis; z and mean empty where not
    computed.  w (and b, when centered) are vectors of length D."""
    lead = x.shape[:-1]
    ct = _checks.compute_dtype(np.dtype(x.dtype))
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype),
           jax.ShapeDtypeStruct(x.shape if r is not None else (0,), x.dtype),
           jax.ShapeDtypeStruct(lead if centered else (0,), ct),
           jax.ShapeDtypeStruct(lead, ct))
    call = _ffi.ffi_call("lnfast_norm_forward", out, vmap_method="broadcast_all")
    return call(x, _empty(x.dtype) if r is None else r, w, b if centered else _empty(w.dtype),
                eps=np.float64(eps), centered=np.int64(centered),
                has_residual=np.int64(r is not None),
                nthreads=np.int64(_threads.threads_for(x.size)))


def _backward_call(dy, x, mean, rstd, w, b, dz, centered):
    """(dx, dweight, dbias) over x's last axis: dweight and dbias in w's
    and b's dtypes, each rounded once from the float64 sums."""
    D = x.shape[-1]
    out = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((D,), w.dtype),
           jax.ShapeDtypeStruct((D,), b.dtype))
    call = _ffi.ffi_call("lnfast_norm_backward", out, vmap_method="broadcast_all")
    return call(dy, x, mean, rstd, w, _empty(x.dtype) if dz is None else dz,
                centered=np.int64(centered), has_dz=np.int64(dz is not None),
                nthreads=np.int64(_threads.threads_for(x.size,
                                                       _threads.PARALLEL_MIN_ELEMENTS_BACKWARD)))


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
    ax, norm, last = _plan(x, axis)
    eps = _checks.eps(eps)
    w, b = _vectors(x, weight, bias, norm, centered)
    y = _rows(_as_rows(x, ax, last, w.shape[0]), w, b, eps, centered)
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
    ax, norm, last = _plan(x, axis)
    _checks.data("residual", residual, _array)
    if residual.dtype != x.dtype or tuple(residual.shape) != tuple(x.shape):
        raise ValueError(f"residual must have x's shape and dtype ({tuple(x.shape)}, "
                         f"{x.dtype}), got ({tuple(residual.shape)}, {residual.dtype})")
    eps = _checks.eps(eps)
    w, b = _vectors(x, weight, bias, norm, True)
    D = w.shape[0]
    y, z = _add_rows(_as_rows(x, ax, last, D), _as_rows(residual, ax, last, D), w, b, eps)
    return _from_rows(y, x.shape, ax, last), _from_rows(z, x.shape, ax, last)
