"""lnfast for PyTorch (SPEC "Frameworks and engines"): the functions of
`torch.nn.functional`, `torch.nn`'s modules, and `replace_norms`.

    import lnfast.torch
    lnfast.torch.replace_norms(model)     # nn.LayerNorm / nn.RMSNorm -> lnfast's

The kernels are two custom operators, `lnfast::norm` and
`lnfast::norm_backward` (`torch.library.custom_op`, with fake kernels for
tracing and autograd registered), so `torch.compile(fullgraph=True)`
traces them whole.  For CPU tensors their kernels and the forward's
autograd are C++ (torch_ext/lnfast_torch.cc over lnfast's C API, built on
first import: lnfast._build), and an eager call with plain CPU tensors
enters that C++ in one step (_eager: its checks, then the operator through
PyTorch's dispatcher), as a call of PyTorch's own LayerNorm does.  The
Python kernels serve CUDA tensors (CuPy arrays through DLPack, on
PyTorch's current stream), and CPU tensors where the C++ cannot be built
(a warning says why) or LNFAST_TORCH_EXTENSION=0: CPU tensors then reach
the kernels as NumPy views (bfloat16 through a 16-bit integer view), and
eager calls go through an `autograd.Function`, which costs less per call
than the operators' Python dispatch (docs/torch.md).  Both give the same
bits.  torch.func's transforms work on both (batching rules: _norm_vmap).
Gradients of gradients are not computed: asking for them is an error
naming `lnfast::norm_backward`, which has no derivative.
"""
import ctypes
import numbers
import operator
import os
import pathlib
import sys
import sysconfig
import warnings
from collections.abc import Sequence
from typing import Any, Callable, List, Optional, Union

import ml_dtypes
import numpy as np
import torch
import torch.autograd.forward_ad as _forward_ad

import lnfast
from lnfast import _build, _checks, _cpu, _pool, _threads

__all__ = ["LayerNorm", "RMSNorm", "add_layer_norm", "layer_norm", "replace_norms", "rms_norm"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_LEAD = _cpu.MAX_LEAD


class _ValueError(ValueError, RuntimeError):
    """A ValueError that is also the RuntimeError torch.nn.functional raises."""


class _TypeError(TypeError, RuntimeError):
    """A TypeError that is also the RuntimeError torch.nn.functional raises."""


# --- tensors as arrays, and back -------------------------------------------

def _array(t):
    """t's data as a NumPy (CPU) or CuPy (CUDA) array, without a copy."""
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return _array(t.resolve_neg().view(torch.int16)).view(ml_dtypes.bfloat16)
    if t.is_cuda:
        import cupy

        return cupy.from_dlpack(t.resolve_neg())
    try:
        return t.numpy()
    except RuntimeError:    # a lazily negated view has no array of its own
        return t.resolve_neg().numpy()


def _rows(t, k):
    """x, residual, dy or dz as an array for the kernels over its last k
    axes.  On the CPU as the C++ kernels take them (as_rows), so that the
    two give the same bits: where it lies when those axes' elements are
    adjacent (whatever the leading axes' strides: the row kernels, the bits
    of a contiguous copy), else copied contiguous (strided elements would
    choose other kernels, and other bits: docs/api.md, "Axes")."""
    if t is None:
        return None
    if t.is_cuda or t.is_contiguous():
        return _array(t)
    if t.dim() - k > _MAX_LEAD:
        return _array(t.contiguous())
    n = 1
    for d in range(t.dim() - 1, t.dim() - k - 1, -1):
        if t.shape[d] != 1 and t.stride(d) != n:
            return _array(t.contiguous())
        n *= t.shape[d]
    return _array(t)


def _tensor(a):
    """A NumPy or CuPy array as a tensor, without a copy."""
    if a.dtype == ml_dtypes.bfloat16:
        return _tensor(a.view(np.int16)).view(torch.bfloat16)
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


# --- the two kernels ---------------------------------------------------------
# On arrays: the eager path keeps mean and rstd as arrays between forward and
# backward; the custom operators convert them to tensors and back.

def _axis(ndim, k):
    """lnfast's axis for the last k of ndim axes (-1, the quickest call, for one)."""
    return -1 if k == 1 else tuple(range(ndim - k, ndim))


def _forward(xa, ra, wa, ba, k, eps, centered, stats=True):
    """(y, z, mean, rstd) arrays over the last k axes; z None without a
    residual ra, mean None for RMSNorm; without `stats`, (y, None) alone."""
    ax = _axis(xa.ndim, k)
    if ra is not None:
        return lnfast.add_layer_norm_forward(xa, ra, wa, ba, eps=eps, axis=ax)
    if not stats:
        if centered:
            return lnfast.layer_norm(xa, wa, ba, eps=eps, axis=ax), None
        return lnfast.rms_norm(xa, wa, eps=eps, axis=ax), None
    if centered:
        y, mean, rstd = lnfast.layer_norm_forward(xa, wa, ba, eps=eps, axis=ax)
        return y, None, mean, rstd
    y, rstd = lnfast.rms_norm_forward(xa, wa, eps=eps, axis=ax)
    return y, None, None, rstd


def _backward(dya, xa, mean, rstd, wa, dza, k, centered):
    """(dx, dweight, dbias) arrays over the last k axes; xa is z for the
    fused step (dza then its gradient); dbias None for RMSNorm."""
    ax = _axis(xa.ndim, k)
    if dza is not None:
        return lnfast.add_layer_norm_backward(dya, xa, mean, rstd, wa, dz=dza, axis=ax)
    if centered:
        return lnfast.layer_norm_backward(dya, xa, mean, rstd, wa, axis=ax)
    return (*lnfast.rms_norm_backward(dya, xa, rstd, wa, axis=ax), None)


def _on_stream(x, fn, *args):
    """fn(*args), with CuPy on PyTorch's current stream of x's device (CUDA)."""
    if not x.is_cuda:
        return fn(*args)
    import cupy

    with cupy.cuda.Device(x.device.index), \
            cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream):
        return fn(*args)


def _compute_dtype(dtype):
    """_checks.compute_dtype for torch dtypes: the dtype of mean and rstd,
    and of dweight and dbias without a weight."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _or_empty(a, like, dtype):
    return like.new_empty(0, dtype=dtype) if a is None else _tensor(a)


# --- custom operators, for torch.compile ------------------------------------

@torch.library.custom_op("lnfast::norm", mutates_args=())
def _norm_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], k: int, eps: float,
             centered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, z, mean, rstd = _on_stream(x, _forward, _rows(x, k), _rows(residual, k),
                                  _array(weight), _array(bias), k, eps, centered)
    stats = _compute_dtype(x.dtype)
    return (_tensor(y), _or_empty(z, x, x.dtype), _or_empty(mean, x, stats), _tensor(rstd))


def _on_device_of(x, **tensors):
    """The operators' check that every tensor given is on x's device (where
    the modules' scripted forward calls them, a meta parameter with a CPU
    input would otherwise choose the fake kernel, whose results are empty
    tensors, not an error)."""
    for name, t in tensors.items():
        if t is not None and t.device != x.device:
            raise _ValueError(f"{name} must be on x's device ({x.device}), got {t.device}")


@_norm_op.register_fake
def _(x, residual, weight, bias, k, eps, centered):
    _on_device_of(x, residual=residual, weight=weight, bias=bias)
    lead = x.shape[:x.dim() - k]
    stats = _compute_dtype(x.dtype)
    y = x.new_empty(x.shape)
    z = x.new_empty(x.shape) if residual is not None else x.new_empty(0)
    mean = x.new_empty(lead, dtype=stats) if centered else x.new_empty(0, dtype=stats)
    return y, z, mean, x.new_empty(lead, dtype=stats)


@torch.library.custom_op("lnfast::norm_backward", mutates_args=())
def _norm_backward_op(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                      weight: Optional[torch.Tensor], dz: Optional[torch.Tensor], k: int,
                      centered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = _on_stream(x, _backward, _rows(dy, k), _rows(x, k),
                            _array(mean) if centered else None, _array(rstd), _array(weight),
                            _rows(dz, k), k, centered)
    dw = _tensor(dw)
    return _tensor(dx), dw, _or_empty(db, x, dw.dtype)


@_norm_backward_op.register_fake
def _(dy, x, mean, rstd, weight, dz, k, centered):
    _on_device_of(x, dy=dy, mean=mean, rstd=rstd, weight=weight, dz=dz)
    norm = x.shape[x.dim() - k:]
    grads = _compute_dtype(x.dtype) if weight is None else weight.dtype
    db = x.new_empty(norm, dtype=grads) if centered else x.new_empty(0, dtype=grads)
    return x.new_empty(x.shape), x.new_empty(norm, dtype=grads), db


def _dense(t):
    return t.contiguous() if 0 in t.stride() and t.numel() > 1 else t


def _incoming(src, dy, dz, fused):
    """The gradients reaching y and z, dense; zeros for one not used."""
    # (the gradient of a sum arrives expanded, every stride 0: the kernels
    # read such rows one element at a time, slower than a copy first)
    dy = torch.zeros_like(src) if dy is None else _dense(dy)
    if fused:
        dz = torch.zeros_like(src) if dz is None else _dense(dz)
    return dy, dz if fused else None


def _needed(ctx, dx, dw, db):
    """The inputs' gradients (x, residual, weight, bias, and None for k,
    eps, centered) that autograd asked for."""
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, dx if ctx.fused and needs[1] else None,
            dw if ctx.has_weight and needs[2] else None,
            db if ctx.has_bias and needs[3] else None, None, None, None)


def _remember(ctx, residual, weight, bias, k, centered):
    ctx.k, ctx.centered = k, centered
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.fused, ctx.has_weight, ctx.has_bias = (residual is not None, weight is not None,
                                               bias is not None)


def _z_without_gradient(ctx, z):
    """z = x + residual needs a gradient only where x or residual does, as
    torch's sum would (not where only the weight or bias does)."""
    if ctx.fused and not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        ctx.mark_non_differentiable(z)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, k, eps, centered = inputs
    _remember(ctx, residual, weight, bias, k, centered)
    _z_without_gradient(ctx, output[1])
    ctx.save_for_backward(output[1] if residual is not None else x, output[2], output[3], weight)


def _bias_apart(ctx, weight, src):
    """Whether the bias's dtype is not dweight's (the weight's, else the
    compute dtype): dbias then takes a second backward pass (_as_bias)."""
    grads = _compute_dtype(src.dtype) if weight is None else weight.dtype
    return ctx.bias_dtype is not None and ctx.bias_dtype != grads


def _as_bias(ctx, weight, src):
    """The weight in the bias's dtype (ones where there is none): the
    backward again with it gives dbias, which does not depend on the
    weight, rounded once from its float64 sums to the bias's own dtype
    where that is not the weight's."""
    if weight is not None:
        return weight.detach().to(ctx.bias_dtype)
    return src.new_ones(src.shape[src.dim() - ctx.k:], dtype=ctx.bias_dtype)


def _op_grads(ctx, dy, dz, src, mean, rstd, weight, op=_norm_backward_op):
    """_needed's gradients through the backward operator: op is the
    operator, or under torch.func's transforms _TransformedBackward.apply,
    which calls it."""
    dx, dw, db = op(dy, src, mean, rstd, weight, dz, ctx.k, ctx.centered)
    if _bias_apart(ctx, weight, src):
        db = op(dy, src, mean, rstd, _as_bias(ctx, weight, src), dz, ctx.k, ctx.centered)[2]
    return _needed(ctx, dx, dw, db)


def _op_backward(ctx, dy, dz, dmean, drstd, op=_norm_backward_op):
    src, mean, rstd, weight = ctx.saved_tensors
    dy, dz = _incoming(src, dy, dz, ctx.fused)
    return _op_grads(ctx, dy, dz, src, mean, rstd, weight, op)


_norm_op.register_autograd(_op_backward, setup_context=_setup_context)


def _no_second_derivative(ctx, *grads):
    """The derivative of lnfast::norm_backward: an error, in the words of the
    C++ kernels' node (PyTorch's for a C++ operator without one)."""
    raise RuntimeError("derivative for lnfast::norm_backward is not implemented: lnfast.torch "
                       "computes first derivatives only (no gradient of a gradient)")


# a gradient of the backward's outputs: an error that says so, not PyTorch's
# advice to register a formula
_norm_backward_op.register_autograd(_no_second_derivative,
                                    setup_context=lambda ctx, inputs, output: None)
_NORM = torch.ops.lnfast.norm.default
_NORM_BACKWARD = torch.ops.lnfast.norm_backward.default


# --- torch.func.vmap -------------------------------------------------------------

def _entry(t, d, i):
    """Entry i of t's mapped dimension d (t itself where it has none); for
    i None, zeros of an entry's shape."""
    if t is None or d is None:
        return t
    if i is None:
        shape = list(t.shape)
        del shape[d]
        return t.new_zeros(shape)
    return t.select(d, i)


def _per_entry(op, info, in_dims, tensors, *rest):
    """op called on each entry of the mapped dimension, results stacked
    (each entry's own sums: dweight and dbias, a mapped weight); of no
    entries, empty results of an entry's shapes (op called once on zeros
    for them)."""
    if info.batch_size == 0:
        outs = op(*(_entry(t, d, None) for t, d in zip(tensors, in_dims)), *rest)
        return tuple(o.new_empty((0, *o.shape)) for o in outs)
    outs = [op(*(_entry(t, d, i) for t, d in zip(tensors, in_dims)), *rest)
            for i in range(info.batch_size)]
    return tuple(torch.stack(o) for o in zip(*outs))


@torch.library.register_vmap("lnfast::norm")
def _norm_vmap(info, in_dims, x, residual, weight, bias, k, eps, centered):
    """A mapped x (or residual) is more rows: one call.  A mapped weight or
    bias: a call per entry."""
    dims = in_dims[:4]
    if dims[2] is None and dims[3] is None:
        lead = [t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
                for t, d in zip((x, residual), dims) if t is not None]
        y, z, mean, rstd = _NORM(lead[0], lead[1] if residual is not None else None, weight,
                                 bias, k, eps, centered)
    else:
        y, z, mean, rstd = _per_entry(_NORM, info, dims, (x, residual, weight, bias), k, eps,
                                      centered)
        # (z and mean stand empty for no residual and RMSNorm: not mapped)
        z = z if residual is not None else z.new_empty(z.shape[1:])
        mean = mean if centered else mean.new_empty(mean.shape[1:])
    return (y, z, mean, rstd), (0, 0 if residual is not None else None,
                                0 if centered else None, 0)


@torch.library.register_vmap("lnfast::norm_backward")
def _norm_backward_vmap(info, in_dims, dy, x, mean, rstd, weight, dz, k, centered):
    """A call per entry: each has its own dweight and dbias sums."""
    return (_per_entry(_NORM_BACKWARD, info, in_dims[:6], (dy, x, mean, rstd, weight, dz), k,
                       centered), (0, 0, 0))


# --- the operators' CPU kernels and autograd in C++ ------------------------------

def _extension():
    """torch_ext/lnfast_torch.cc, built on first import (lnfast._build) and
    loaded: the C++ kernels then serve CPU tensors.  None where
    LNFAST_TORCH_EXTENSION=0, or, with a warning, where it cannot be built
    (the Python kernels then serve CPU tensors as well)."""
    if os.environ.get("LNFAST_TORCH_EXTENSION", "").strip() == "0":
        return None
    root = pathlib.Path(torch.__file__).parent
    lib, include = root / "lib", root / "include"
    flags = ["-std=c++20", "-O2", "-shared", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
             f"-I{sysconfig.get_paths()['include']}"]
    if sys.platform == "darwin":
        flags += ["-undefined", "dynamic_lookup"]      # (Python's own symbols)
    # (PyTorch's build configuration, beside its version: a source build may
    # say "Unknown" for its git version)
    config = [f for f in (include / "ATen" / "Config.h",
                          include / "c10" / "macros" / "cmake_macros.h") if f.exists()]
    try:
        ext = _build.load("lnfast.torch", "its C++ operator kernels", "lnfast_torch",
                          pathlib.Path(__file__).parent / "torch_ext" / "lnfast_torch.cc", flags,
                          config, [torch.__version__, str(torch.version.git_version)],
                          [f"-L{lib}", "-ltorch_python", "-ltorch_cpu", "-lc10",
                           f"-Wl,-rpath,{lib}"])
    except (ImportError, OSError) as e:
        warnings.warn(f"{e}\nlnfast.torch goes on with its Python kernels, which cost more per "
                      "call (set LNFAST_TORCH_EXTENSION=0 to skip the build)", RuntimeWarning,
                      stacklevel=3)
        return None
    # (PYFUNCTYPE: called with the GIL held, as it takes a Python object)
    set_api = ctypes.PYFUNCTYPE(None, *[ctypes.c_void_p] * 6, ctypes.c_size_t, ctypes.py_object,
                                ctypes.c_int64)(("lnfast_torch_set_api", ext))
    set_api(*_cpu.c_api_addresses(), *_pool.c_addresses(), _pool.MIN_BYTES, _threads.threads_for,
            _threads.PARALLEL_MIN_ELEMENTS_BACKWARD)
    return ext


_EXT = _extension()
# (lnfast_torch.cc's eager(): an eager call with CPU tensors in one step)
_EAGER = None if _EXT is None else ctypes.PYFUNCTYPE(ctypes.py_object)(
    ("lnfast_torch_eager", _EXT))()


def _eager(x, normalized_shape, residual, weight, bias, eps, mode):
    """The eager call's result (y, or (y, z) for the fused step, mode 2;
    mode 0 LayerNorm, 1 RMSNorm) where the C++ takes it, after its own
    checks; else None, and the functions go on with theirs: where
    torch.compile traces, with dual tensors, and with any argument not
    as the common call passes it."""
    if torch.compiler.is_compiling() or _EAGER is None or _forward_ad._current_level >= 0:
        return None
    return _EAGER(x, normalized_shape, residual, weight, bias, eps, mode)


# --- the eager path ------------------------------------------------------------

class _Norm(torch.autograd.Function):
    """What _norm_op does, without the custom operators' dispatch.  x (or z)
    and the weight are saved as tensors, so that saved-tensor hooks
    (activation checkpointing, offloading) hold them, and autograd checks
    that neither was changed in place meanwhile; the statistics, a value
    per row, stay arrays beside them (the cheapest per call)."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, k, eps, centered):
        y, z, mean, rstd = _on_stream(x, _forward, _rows(x, k), _rows(residual, k),
                                      _array(weight), _array(bias), k, eps, centered)
        _remember(ctx, residual, weight, bias, k, centered)
        ctx.stats = mean, rstd
        if residual is not None:
            zt = _tensor(z)
            _z_without_gradient(ctx, zt)
            ctx.save_for_backward(zt, weight)
            return _tensor(y), zt
        ctx.save_for_backward(x, weight)
        return _tensor(y), None

    @staticmethod
    def backward(ctx, dy, dz):
        src, weight = ctx.saved_tensors
        dy, dz = _incoming(src, dy, dz, ctx.fused)
        mean, rstd = ctx.stats
        if (torch.is_grad_enabled() or _bias_apart(ctx, weight, src)
                or torch._C._are_functorch_transforms_active() or _batched(dy)
                or _batched(dz)):
            # With create_graph, through the operator, which has no
            # derivative: differentiating its result again is an error
            # naming it, not a silent zero.  (A bias of another dtype
            # than dweight's too: _op_grads' second pass; and batched
            # gradients, of is_grads_batched or of vmap over autograd.grad:
            # its batching rule or PyTorch's loop over the batch.)
            stats = _compute_dtype(src.dtype)
            return _op_grads(ctx, dy, dz, src, _or_empty(mean, src, stats), _tensor(rstd),
                             weight)
        dx, dw, db = _on_stream(src, _backward, _rows(dy, ctx.k), _rows(src, ctx.k), mean, rstd,
                                _array(weight), _rows(dz, ctx.k), ctx.k, ctx.centered)
        return _needed(ctx, _tensor(dx), _tensor(dw), None if db is None else _tensor(db))


def _batched(t):
    """Whether t is a batch of gradients (vmap's, or is_grads_batched's)."""
    return t is not None and (torch._C._functorch.is_batchedtensor(t)
                              or torch._C._functorch.is_legacy_batchedtensor(t))


class _Transformed(torch.autograd.Function):
    """The operator's autograd, for torch.func's transforms (grad, vmap,
    jacrev) where the Python kernels serve x: custom_op's own autograd does
    not take them.  Forward and backward are the operators, whose vmap
    rules (_norm_vmap) serve vmap."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, residual, weight, bias, k, eps, centered):
        return _NORM(x, residual, weight, bias, k, eps, centered)

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def backward(ctx, dy, dz, dmean, drstd):
        return _op_backward(ctx, dy, dz, dmean, drstd, _TransformedBackward.apply)


class _TransformedBackward(torch.autograd.Function):
    """The backward operator under torch.func's transforms, whose own
    derivative is an error, as the C++ kernels' is."""
    generate_vmap_rule = True

    @staticmethod
    def forward(dy, x, mean, rstd, weight, dz, k, centered):
        return _NORM_BACKWARD(dy, x, mean, rstd, weight, dz, k, centered)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_no_second_derivative)


_norm_apply = super(torch.autograd.Function, _Norm).apply
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _apply(x, residual, weight, bias, k, eps, centered):
    """(y, z) through the operator while torch.compile or torch.jit.trace
    traces and where the C++ kernels serve x; else under torch.func's
    transforms through _Transformed; else through the operator for meta
    tensors and tensor subclasses such as fake tensors (its fake kernel
    gives the shapes, and its dispatch serves the subclass); else through
    _Norm where a gradient may be asked for, else straight."""
    if _forward_ad._current_level >= 0 and any(
            t is not None and _forward_ad.unpack_dual(t).tangent is not None
            for t in (x, residual, weight, bias)):
        raise NotImplementedError("lnfast.torch computes no forward-mode derivative (jvp): "
                                  "its inputs must not be dual tensors")
    op: Optional[Callable[..., Any]]
    if torch.compiler.is_compiling() or (_EXT is not None and x.is_cpu) or torch.jit.is_tracing():
        op = _NORM
    elif torch._C._are_functorch_transforms_active():
        op = _Transformed.apply
    elif x.is_meta or type(x) not in _PLAIN:
        op = _NORM
    else:
        op = None
    if op is not None:
        y, z, _, _ = op(x, residual, weight, bias, k, eps, centered)
        return y, None if residual is None else z
    if torch.is_grad_enabled() and (
            x.requires_grad or (residual is not None and residual.requires_grad)
            or (weight is not None and weight.requires_grad)
            or (bias is not None and bias.requires_grad)):
        # (autograd.Function.apply, less its Python preamble for functorch)
        return _norm_apply(x, residual, weight, bias, k, eps, centered)
    y, z = _on_stream(x, _forward, _rows(x, k), _rows(residual, k), _array(weight),
                      _array(bias), k, eps, centered, False)[:2]
    return _tensor(y), None if z is None else _tensor(z)


# --- the functions -------------------------------------------------------------

def _strided(name, t):
    """A TypeError unless t is a dense (strided, not nested) tensor."""
    if t.layout != torch.strided or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"layout {t.layout}"
        raise _TypeError(f"{name} must be a dense (strided) tensor, got {kind}")


def _size(n):
    """One size of normalized_shape: an integer (operator.index), not a
    bool.  An int as it is: under torch.compile's dynamic shapes (and
    torch.export's Dims) it may be symbolic, and operator.index would fix
    it to its example value (a recompilation for each size)."""
    if isinstance(n, bool):
        raise TypeError
    return n if isinstance(n, (int, torch.SymInt)) else operator.index(n)


def _quietly(check, *args):
    """check(*args).  Under torch.jit.trace sizes are traced values, and the
    checks' answers constants of the trace, as normalized_shape is: not
    worth a TracerWarning each."""
    if not torch.jit.is_tracing():
        return check(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return check(*args)


def _normalized(x, normalized_shape, params, name="input"):
    """k, the number of trailing axes normalized, after the checks that
    torch.nn.functional makes (shapes) and those of lnfast (dtypes,
    devices); x is called `name` in the messages."""
    return _quietly(_checked, x, normalized_shape, params, name)


def _checked(x, normalized_shape, params, name_x):
    if not isinstance(x, torch.Tensor):
        raise _TypeError(f"{name_x} must be a torch.Tensor, got {type(x).__name__}")
    _strided(name_x, x)
    if type(normalized_shape) is int:
        shape = (normalized_shape,)
    elif type(normalized_shape) is tuple and all(type(n) is int for n in normalized_shape):
        shape = normalized_shape        # (the modules' own, checked quickest)
    else:
        try:        # (integers only, as torch: not floats, bools or a tensor of sizes)
            if isinstance(normalized_shape, (str, bytes, torch.Tensor)):
                raise TypeError
            if isinstance(normalized_shape, numbers.Integral):
                normalized_shape = (normalized_shape,)
            shape = tuple(_size(n) for n in normalized_shape)
        except (TypeError, ValueError):
            raise _TypeError(f"normalized_shape must be an int or a sequence of ints, "
                             f"got {normalized_shape!r}") from None
    k = len(shape)
    xshape = x.shape
    if k == 0:
        raise _ValueError("normalized_shape must name at least one axis, got []")
    if len(xshape) < k or xshape[len(xshape) - k:] != shape:
        raise _ValueError(f"normalized_shape={list(shape)} must be the last axes of {name_x}, "
                          f"got {name_x} of shape {list(xshape)}")
    if 0 in shape:
        raise _ValueError(f"normalized_shape must have no size 0 (D >= 1), got {list(shape)}")
    dtype, cuda = x.dtype, x.is_cuda
    if dtype not in _DTYPES:
        raise _TypeError(f"{name_x} must be float32, float64, float16 or bfloat16, got {dtype}")
    if not (cuda or x.is_cpu or x.is_meta):
        raise _TypeError(f"{name_x} must be on the CPU or a CUDA device (or meta), "
                         f"got {x.device}")
    for name, p in params:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise _TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
        _strided(name, p)
        if p.dtype != dtype and p.dtype != torch.float32:
            also = "" if dtype == torch.float32 else " or float32"
            raise _TypeError(f"{name} must have {name_x}'s dtype ({dtype}){also}, got {p.dtype}")
        if p.shape != shape:
            raise _ValueError(f"{name} must have shape {list(shape)} (normalized_shape), "
                              f"got {list(p.shape)}")
        if p.device != x.device:
            raise _ValueError(f"{name} must be on {name_x}'s device ({x.device}), "
                              f"got {p.device}")
    return k


def _eps(eps):
    """lnfast's check of eps, its exceptions as torch's too; a 0-d real
    tensor is taken as its value, as torch.nn.functional takes it."""
    if torch.compiler.is_compiling() and not isinstance(eps, bool):
        # (maybe a symbolic float: the kernels check its value when they
        # run; a bool, which they would take as 0 or 1, goes to the check
        # below)
        return float(eps) if isinstance(eps, torch.Tensor) else eps
    if (isinstance(eps, torch.Tensor) and eps.dim() == 0 and eps.dtype.is_floating_point
            and not eps.requires_grad):
        eps = eps.item()
    try:
        return _checks.eps(eps)
    except TypeError as e:
        raise _TypeError(str(e)) from None
    except ValueError as e:
        raise _ValueError(str(e)) from None


def _handled(args):
    """Whether an argument is not a tensor but takes torch functions itself
    (__torch_function__: an FX Proxy while torch.fx.symbolic_trace runs, a
    tensor-like): the call is then handed to it, as torch.nn.functional's
    functions hand theirs (an FX graph records the lnfast function)."""
    for a in args:      # (a loop: cheaper per call than any() over a generator)
        if a is not None and not isinstance(a, torch.Tensor) and hasattr(a, "__torch_function__"):
            return True
    return False


def _exporting_to_onnx():
    """Whether torch.onnx.export is tracing the model (the TorchScript
    exporter's torch.jit.trace, or torch.export's non-strict tracing): the
    functions are then torch.nn.functional's, whose ONNX forms exist
    (lnfast's operators have none)."""
    onnx = sys.modules.get("torch.onnx")
    return (onnx is not None and (torch.compiler.is_compiling() or torch.jit.is_tracing())
            and onnx.is_in_onnx_export())


def _as_sequence(normalized_shape):
    """normalized_shape as torch.nn.functional takes it (an int is one axis)."""
    return (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape


def _default_rms_eps(dtype):
    """rms_norm's eps=None, as PyTorch's: float64's machine epsilon for
    float64 input, float32's for the others (its float16 and bfloat16
    kernels compute in float32 and take float32's)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


Shape = Union[int, Sequence[int]]


def layer_norm(input: torch.Tensor, normalized_shape: Shape,
               weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
               eps: float = 1e-5) -> torch.Tensor:
    """`torch.nn.functional.layer_norm`, computed by lnfast.

    Parameters
    ----------
    input : torch.Tensor
        float32, float64, float16 or bfloat16, on the CPU or a CUDA device.
    normalized_shape : int or sequence of ints
        The last axes of input, normalized together.
    weight, bias : torch.Tensor or None, optional
        Of normalized_shape, in input's dtype or float32.
    eps : float, optional
        Added to the variance.

    Returns
    -------
    torch.Tensor
        input's shape and dtype; differentiable in input, weight and bias.

    Examples
    --------
    >>> import torch, lnfast.torch
    >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    >>> y = lnfast.torch.layer_norm(x, 4, eps=0.0)
    >>> y.detach()
    tensor([[-1.3416, -0.4472,  0.4472,  1.3416]])
    """
    y = _eager(input, normalized_shape, None, weight, bias, eps, 0)
    if y is not None:
        return y
    if _handled((input, weight, bias)):
        return torch.overrides.handle_torch_function(layer_norm, (input, weight, bias), input,
                                                     normalized_shape, weight, bias, eps)
    if _exporting_to_onnx():
        return torch.nn.functional.layer_norm(input, _as_sequence(normalized_shape), weight, bias,
                                              eps)
    k = _normalized(input, normalized_shape, (("weight", weight), ("bias", bias)))
    return _apply(input, None, weight, bias, k, _eps(eps), True)[0]


def rms_norm(input: torch.Tensor, normalized_shape: Shape,
             weight: Optional[torch.Tensor] = None, eps: Optional[float] = None) -> torch.Tensor:
    """`torch.nn.functional.rms_norm`, computed by lnfast.

    Parameters
    ----------
    input : torch.Tensor
        As `layer_norm`'s.
    normalized_shape : int or sequence of ints
        The last axes of input, normalized together.
    weight : torch.Tensor or None, optional
        Of normalized_shape, in any floating dtype, as PyTorch's: one other
        than input's and float32 is taken in input's dtype (float32 for
        16-bit input), its gradient returned in its own.
    eps : float or None, optional
        Added to the mean square; None is PyTorch's default: float64's
        machine epsilon for float64 input, float32's for the others
        (float16 and bfloat16 included, as ``torch.nn.RMSNorm``).

    Returns
    -------
    torch.Tensor
        input's shape and dtype; differentiable in input and weight.

    Examples
    --------
    >>> import torch, lnfast.torch
    >>> lnfast.torch.rms_norm(torch.tensor([[3.0, 4.0]]), 2, eps=0.0)
    tensor([[0.8485, 1.1314]])
    """
    y = _eager(input, normalized_shape, None, weight, None, eps, 1)
    if y is not None:
        return y
    if _handled((input, weight)):
        return torch.overrides.handle_torch_function(rms_norm, (input, weight), input,
                                                     normalized_shape, weight, eps)
    if _exporting_to_onnx():
        return torch.nn.functional.rms_norm(input, _as_sequence(normalized_shape), weight, eps)
    if isinstance(weight, torch.Tensor) and isinstance(input, torch.Tensor):
        if weight.dtype not in _DTYPES:     # (any of them: they are converted below)
            raise _TypeError(f"weight must be float32, float64, float16 or bfloat16, "
                             f"got {weight.dtype}")
        if weight.dtype not in (input.dtype, torch.float32):
            weight = weight.to(input.dtype if input.dtype == torch.float64 else torch.float32)
    k = _normalized(input, normalized_shape, (("weight", weight),))
    eps = _default_rms_eps(input.dtype) if eps is None else _eps(eps)
    return _apply(input, None, weight, None, k, eps, False)[0]


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, normalized_shape: Shape,
                   weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step in one pass: ``z = x + residual``,
    ``y = layer_norm(z)``.

    Parameters
    ----------
    x, residual : torch.Tensor
        Of one shape, dtype and device (as `layer_norm`'s input).
    normalized_shape : int or sequence of ints
        The last axes, normalized together.
    weight, bias : torch.Tensor or None, optional
        Of normalized_shape, in x's dtype or float32.
    eps : float, optional
        Added to the variance.

    Returns
    -------
    y, z : torch.Tensor
        The LayerNorm of z, and z; gradients flow through both.

    Examples
    --------
    >>> import torch, lnfast.torch
    >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    >>> y, z = lnfast.torch.add_layer_norm(x, torch.ones_like(x), 4)
    >>> z
    tensor([[2., 3., 4., 5.]])
    """
    yz = _eager(x, normalized_shape, residual, weight, bias, eps, 2)
    if yz is not None:
        return yz
    if _handled((x, residual, weight, bias)):
        return torch.overrides.handle_torch_function(add_layer_norm, (x, residual, weight, bias),
                                                     x, residual, normalized_shape, weight, bias,
                                                     eps)
    if _exporting_to_onnx():
        z = x + residual
        return (torch.nn.functional.layer_norm(z, _as_sequence(normalized_shape), weight, bias,
                                               eps), z)
    k = _normalized(x, normalized_shape, (("weight", weight), ("bias", bias)), "x")
    _quietly(_residual, x, residual)
    return _apply(x, residual, weight, bias, k, _eps(eps), True)


def _residual(x, residual):
    """add_layer_norm's checks of residual: x's type, dtype, shape, device."""
    if not isinstance(residual, torch.Tensor):
        raise _TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    _strided("residual", residual)
    if residual.dtype != x.dtype:
        raise _TypeError(f"residual must have x's dtype ({x.dtype}), got {residual.dtype}")
    if residual.shape != x.shape or residual.device != x.device:
        raise _ValueError(f"residual must have x's shape and device "
                          f"({list(x.shape)}, {x.device}), got "
                          f"({list(residual.shape)}, {residual.device})")


# --- modules -------------------------------------------------------------------

def _scripted_shape_check(input: torch.Tensor, normalized_shape: List[int]) -> None:
    """TorchScript's check that normalized_shape is input's last axes (the
    modules' forward calls the operator itself when scripted: TorchScript
    compiles no more of lnfast.torch)."""
    k = len(normalized_shape)
    if input.dim() < k or input.shape[input.dim() - k:] != normalized_shape:
        raise ValueError("normalized_shape=" + str(normalized_shape) + " must be the last "
                         "axes of input, got input of shape " + str(input.shape))


class LayerNorm(torch.nn.LayerNorm):
    """`torch.nn.LayerNorm` computed by lnfast: the same constructor
    arguments, parameters, ``state_dict`` keys and ``isinstance`` answers.

    Examples
    --------
    >>> import torch, lnfast.torch
    >>> m = lnfast.torch.LayerNorm(8)
    >>> sorted(m.state_dict()) == sorted(torch.nn.LayerNorm(8).state_dict())
    True
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            _scripted_shape_check(input, list(self.normalized_shape))
            return torch.ops.lnfast.norm(input, None, self.weight, self.bias,
                                         len(self.normalized_shape), self.eps, True)[0]
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` computed by lnfast: the same constructor
    arguments, parameters, ``state_dict`` keys and ``isinstance`` answers.

    Examples
    --------
    >>> import torch, lnfast.torch
    >>> m = lnfast.torch.RMSNorm(8)
    >>> m(torch.ones(2, 8)).shape
    torch.Size([2, 8])
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            _scripted_shape_check(input, list(self.normalized_shape))
            eps = self.eps
            if eps is None:         # (_default_rms_eps)
                eps = 2.220446049250313e-16 if input.dtype == torch.float64 else 1.1920928955078125e-07
            weight: Optional[torch.Tensor] = self.weight  # (rms_norm's conversion)
            if weight is not None and weight.dtype not in (input.dtype, torch.float32):
                weight = weight.to(torch.float64 if input.dtype == torch.float64
                                   else torch.float32)
            return torch.ops.lnfast.norm(input, None, weight, None,
                                         len(self.normalized_shape), eps, False)[0]
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)


# torch.nn's modules and lnfast's for them: lnfast's only override forward.
_LNFAST_CLASS = {torch.nn.LayerNorm: LayerNorm, torch.nn.RMSNorm: RMSNorm}


def replace_norms(module: torch.nn.Module) -> torch.nn.Module:
    """Swap every `torch.nn.LayerNorm` and `torch.nn.RMSNorm` in `module`
    for lnfast's, in place.

    Each such module becomes lnfast's by its class alone (lnfast's modules
    only override ``forward``): the same object, with its Parameters (an
    optimizer built before still steps them), device, dtype, training mode,
    hooks and attributes, wherever it is registered. Subclasses of them are
    left as they are.

    Parameters
    ----------
    module : torch.nn.Module
        The model, or a LayerNorm or RMSNorm itself.

    Returns
    -------
    torch.nn.Module
        `module`.

    Examples
    --------
    >>> import torch, lnfast.torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    >>> model = lnfast.torch.replace_norms(model)
    >>> type(model[1]).__module__
    'lnfast.torch'
    """
    if not isinstance(module, torch.nn.Module):
        raise _TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for m in module.modules():
        cls = _LNFAST_CLASS.get(type(m))
        if cls is not None:
            m.__class__ = cls
    return module
