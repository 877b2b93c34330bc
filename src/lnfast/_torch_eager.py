"""lnfast.torch's eager path: the C++ kernels of its operators for CPU
tensors (torch_ext/lnfast_torch.cc over lnfast's C API, built on first
import: lnfast._build) with their one-step eager call (_eager), and the
`autograd.Function`s through which eager calls reach the Python kernels
where the C++ does not serve them, at less cost per call than the
operators' Python dispatch (docs/torch.md).
"""
import ctypes
import os
import pathlib
import sys
import sysconfig
import warnings
from typing import Any, Callable, Optional

import torch
import torch.autograd.forward_ad as _forward_ad

from lnfast import _build, _cpu, _pool, _threads
from lnfast._torch_ops import (_NORM, _NORM_BACKWARD, _array, _backward, _bias_apart,
                               _compute_dtype, _forward, _incoming, _needed,
                               _no_second_derivative, _on_stream, _op_backward, _op_grads,
                               _or_empty, _remember, _rows, _setup_context, _tensor,
                               _z_without_gradient)

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
