"""lnfast for PyTorch (SPEC "Frameworks and engines"): the functions of
`torch.nn.functional`, `torch.nn`'s modules, and `replace_norms`.

    import lnfast.torch
    lnfast.torch.replace_norms(model)     # nn.LayerNorm / nn.RMSNorm -> lnfast's

Tensors reach the kernels without a copy: CPU tensors as NumPy views (a
bfloat16 tensor through a 16-bit integer view), CUDA tensors as CuPy arrays
through DLPack, on PyTorch's current stream.  The kernels are two custom
operators, `lnfast::norm` and `lnfast::norm_backward`
(`torch.library.custom_op`, with fake kernels for tracing and autograd
registered), so `torch.compile(fullgraph=True)` traces them whole.  In
eager mode the same functions run through an `autograd.Function` instead,
which costs less per call than the custom operators' dispatch
(docs/torch.md).  Gradients of gradients are not computed: asking for them
is PyTorch's error for `lnfast::norm_backward`, which has no derivative.
"""
import math
from typing import Optional

import ml_dtypes
import numpy as np
import torch

import lnfast
from lnfast import _checks

__all__ = ["LayerNorm", "RMSNorm", "add_layer_norm", "layer_norm", "replace_norms", "rms_norm"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _ValueError(ValueError, RuntimeError):
    """A ValueError that is also the RuntimeError torch.nn.functional raises."""


class _TypeError(TypeError, RuntimeError):
    """A TypeError that is also the RuntimeError torch.nn.functional raises."""


# --- tensors as arrays, and back -------------------------------------------

def _array(t):
    """t's data as a NumPy (CPU) or CuPy (CUDA) array, without a copy."""
    if t is None:
        return None
    t = t.detach().resolve_neg()       # (a lazily negated view has no array of its own)
    bf16 = t.dtype == torch.bfloat16
    if bf16:
        t = t.view(torch.int16)
    if t.is_cuda:
        import cupy

        a = cupy.from_dlpack(t)
    else:
        a = t.numpy()
    return a.view(ml_dtypes.bfloat16) if bf16 else a


def _tensor(a):
    """A NumPy or CuPy array as a tensor, without a copy."""
    if a.dtype == ml_dtypes.bfloat16:
        return _tensor(a.view(np.int16)).view(torch.bfloat16)
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


def _on_stream(x, fn):
    """fn() with CuPy on PyTorch's current stream of x's device (CUDA)."""
    if not x.is_cuda:
        return fn()
    import cupy

    with cupy.cuda.Device(x.device.index), \
            cupy.cuda.ExternalStream(torch.cuda.current_stream(x.device).cuda_stream):
        return fn()


def _axis(x, k):
    """lnfast's axis for x's last k axes (-1, the quickest call, for one)."""
    return -1 if k == 1 else tuple(range(x.dim() - k, x.dim()))


def _compute_dtype(dtype):
    """_checks.compute_dtype for torch dtypes: the dtype of mean and rstd,
    and of dweight and dbias without a weight."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- the two kernels ---------------------------------------------------------

def _norm(x, residual, weight, bias, k, eps, centered, stats=True):
    """(y, z, mean, rstd) over x's last k axes; z and (RMSNorm) mean empty
    where not computed, and without `stats`, (y, z) alone."""
    ax = _axis(x, k)

    def run():
        xa, wa = _array(x), _array(weight)
        if not stats and residual is None:
            if centered:
                return _tensor(lnfast.layer_norm(xa, wa, _array(bias), eps=eps, axis=ax)), None
            return _tensor(lnfast.rms_norm(xa, wa, eps=eps, axis=ax)), None
        if residual is not None:
            y, z, mean, rstd = lnfast.add_layer_norm_forward(
                xa, _array(residual), wa, _array(bias), eps=eps, axis=ax)
            return _tensor(y), _tensor(z), _tensor(mean), _tensor(rstd)
        if centered:
            y, mean, rstd = lnfast.layer_norm_forward(xa, wa, _array(bias), eps=eps, axis=ax)
            return _tensor(y), x.new_empty(0), _tensor(mean), _tensor(rstd)
        y, rstd = lnfast.rms_norm_forward(xa, wa, eps=eps, axis=ax)
        return (_tensor(y), x.new_empty(0), x.new_empty(0, dtype=_compute_dtype(x.dtype)),
                _tensor(rstd))

    return _on_stream(x, run)


def _norm_backward(dy, x, mean, rstd, weight, dz, k, centered):
    """(dx, dweight, dbias) over the last k axes; x is z for the fused step
    (dz then its gradient); dbias empty for RMSNorm."""
    ax = _axis(x, k)

    def run():
        dya, xa, wa = _array(dy), _array(x), _array(weight)
        if dz is not None:
            dx, dw, db = lnfast.add_layer_norm_backward(dya, xa, _array(mean), _array(rstd), wa,
                                                        dz=_array(dz), axis=ax)
        elif centered:
            dx, dw, db = lnfast.layer_norm_backward(dya, xa, _array(mean), _array(rstd), wa,
                                                    axis=ax)
        else:
            dx, dw = lnfast.rms_norm_backward(dya, xa, _array(rstd), wa, axis=ax)
            return _tensor(dx), _tensor(dw), x.new_empty(0, dtype=_compute_dtype(x.dtype) if weight is None else weight.dtype)
        return _tensor(dx), _tensor(dw), _tensor(db)

    return _on_stream(x, run)


# --- custom operators, for torch.compile ------------------------------------

@torch.library.custom_op("lnfast::norm", mutates_args=())
def _norm_op(x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor],
             bias: Optional[torch.Tensor], k: int, eps: float,
             centered: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _norm(x, residual, weight, bias, k, eps, centered)


@_norm_op.register_fake
def _(x, residual, weight, bias, k, eps, centered):
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
    return _norm_backward(dy, x, mean, rstd, weight, dz, k, centered)


@_norm_backward_op.register_fake
def _(dy, x, mean, rstd, weight, dz, k, centered):
    norm = x.shape[x.dim() - k:]
    grads = _compute_dtype(x.dtype) if weight is None else weight.dtype
    db = x.new_empty(norm, dtype=grads) if centered else x.new_empty(0, dtype=grads)
    return x.new_empty(x.shape), x.new_empty(norm, dtype=grads), db


def _dense(t):
    return t.contiguous() if 0 in t.stride() and t.numel() > 1 else t


def _save(ctx, x, residual, weight, bias, k, centered, z, mean, rstd):
    ctx.save_for_backward(z if residual is not None else x, mean, rstd, weight)
    ctx.k, ctx.centered = k, centered
    ctx.fused, ctx.has_bias = residual is not None, bias is not None


def _grads(ctx, dy, dz, backward):
    """The inputs' gradients (x, residual, weight, bias) from dy and dz."""
    src, mean, rstd, weight = ctx.saved_tensors
    # (the gradient of a sum arrives expanded, every stride 0: the kernels
    # read such rows one element at a time, slower than a copy first)
    dy = torch.zeros_like(src) if dy is None else _dense(dy)
    if ctx.fused:
        dz = torch.zeros_like(src) if dz is None else _dense(dz)
    dx, dw, db = backward(dy, src, mean, rstd, weight, dz if ctx.fused else None, ctx.k,
                          ctx.centered)
    needs = ctx.needs_input_grad
    return (dx if needs[0] else None, dx if ctx.fused and needs[1] else None,
            dw if weight is not None and needs[2] else None,
            db if ctx.has_bias and needs[3] else None)


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, k, eps, centered = inputs
    _save(ctx, x, residual, weight, bias, k, centered, output[1], output[2], output[3])


def _op_backward(ctx, dy, dz, dmean, drstd):
    return (*_grads(ctx, dy, dz, _norm_backward_op), None, None, None)


_norm_op.register_autograd(_op_backward, setup_context=_setup_context)


# --- the eager path ------------------------------------------------------------

class _Norm(torch.autograd.Function):
    """What _norm_op does, without the custom operators' dispatch."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, k, eps, centered):
        y, z, mean, rstd = _norm(x, residual, weight, bias, k, eps, centered)
        _save(ctx, x, residual, weight, bias, k, centered, z, mean, rstd)
        return y, (z if residual is not None else None)

    @staticmethod
    def backward(ctx, dy, dz):
        # With create_graph, through the operator, which has no derivative:
        # differentiating its result again is PyTorch's error naming it,
        # not a silent zero.
        kernel = _norm_backward_op if torch.is_grad_enabled() else _norm_backward
        return (*_grads(ctx, dy, dz, kernel), None, None, None)


def _apply(x, residual, weight, bias, k, eps, centered):
    """(y, z) through the custom operator while torch.compile traces, else
    through _Norm where a gradient may be asked for, else straight."""
    if torch.compiler.is_compiling():
        y, z, _, _ = _norm_op(x, residual, weight, bias, k, eps, centered)
        return y, z
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (x, residual, weight, bias)):
        return _Norm.apply(x, residual, weight, bias, k, eps, centered)
    return _norm(x, residual, weight, bias, k, eps, centered, stats=False)[:2]


# --- the functions -------------------------------------------------------------

def _normalized(x, normalized_shape, params):
    """k, the number of trailing axes normalized, after the checks that
    torch.nn.functional makes (shapes) and those of lnfast (dtypes,
    devices)."""
    if not isinstance(x, torch.Tensor):
        raise _TypeError(f"input must be a torch.Tensor, got {type(x).__name__}")
    if type(normalized_shape) is int:
        shape = (normalized_shape,)
    else:
        try:
            if isinstance(normalized_shape, (str, bytes)):
                raise TypeError
            shape = tuple(int(n) for n in normalized_shape)
        except (TypeError, ValueError):
            raise _TypeError(f"normalized_shape must be an int or a sequence of ints, "
                             f"got {normalized_shape!r}") from None
    k = len(shape)
    if k == 0 or x.dim() < k or x.shape[x.dim() - k:] != shape:
        raise _ValueError(f"normalized_shape={list(shape)} must be the last axes of input, "
                          f"got input of shape {list(x.shape)}")
    if 0 in shape:
        raise _ValueError(f"normalized_shape must not be empty (D >= 1), got {list(shape)}")
    dtype, device = x.dtype, x.device
    if dtype not in _DTYPES:
        raise _TypeError(f"input must be float32, float64, float16 or bfloat16, got {dtype}")
    if device.type != "cpu" and device.type != "cuda":
        raise _TypeError(f"input must be on the CPU or a CUDA device, got {device}")
    for name, p in params:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise _TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
        if p.dtype != dtype and p.dtype != torch.float32:
            also = "" if dtype == torch.float32 else " or float32"
            raise _TypeError(f"{name} must have input's dtype ({dtype}){also}, got {p.dtype}")
        if p.shape != shape:
            raise _ValueError(f"{name} must have shape {list(shape)} (normalized_shape), "
                              f"got {list(p.shape)}")
        if p.device != device:
            raise _ValueError(f"{name} must be on input's device ({device}), got {p.device}")
    return k


def _eps(eps):
    """lnfast's check of eps, its exceptions as torch's too."""
    if torch.compiler.is_compiling():
        return eps      # (maybe a symbolic float: the kernels check it when they run)
    try:
        return _checks.eps(eps)
    except TypeError as e:
        raise _TypeError(str(e)) from None
    except ValueError as e:
        raise _ValueError(str(e)) from None


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.layer_norm."""
    k = _normalized(input, normalized_shape, (("weight", weight), ("bias", bias)))
    return _apply(input, None, weight, bias, k, _eps(eps), True)[0]


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """torch.nn.functional.rms_norm: eps=None is torch.finfo(input.dtype).eps."""
    k = _normalized(input, normalized_shape, (("weight", weight),))
    eps = torch.finfo(input.dtype).eps if eps is None else _eps(eps)
    return _apply(input, None, weight, None, k, eps, False)[0]


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps=1e-5):
    """The pre-norm residual step: z = x + residual, y = layer_norm(z);
    returns (y, z), with gradients through both."""
    k = _normalized(x, normalized_shape, (("weight", weight), ("bias", bias)))
    if not isinstance(residual, torch.Tensor):
        raise _TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise _ValueError(f"residual must have x's shape, dtype and device "
                          f"({list(x.shape)}, {x.dtype}, {x.device}), got "
                          f"({list(residual.shape)}, {residual.dtype}, {residual.device})")
    return _apply(x, residual, weight, bias, k, _eps(eps), True)


# --- modules -------------------------------------------------------------------

class LayerNorm(torch.nn.LayerNorm):
    """torch.nn.LayerNorm (same arguments, parameters and state_dict keys)
    computed by lnfast."""

    def forward(self, input):
        return layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm (same arguments, parameters and state_dict keys)
    computed by lnfast."""

    def forward(self, input):
        return rms_norm(input, self.normalized_shape, self.weight, self.eps)


def _swapped(m):
    """lnfast's module for m, holding m's own parameters, or None."""
    if type(m) is torch.nn.LayerNorm:
        new = LayerNorm(m.normalized_shape, m.eps, m.elementwise_affine, bias=m.bias is not None,
                        device="meta")
        new.weight, new.bias = m.weight, m.bias
    elif type(m) is torch.nn.RMSNorm:
        new = RMSNorm(m.normalized_shape, m.eps, m.elementwise_affine, device="meta")
        new.weight = m.weight
    else:
        return None
    new.train(m.training)
    return new


def replace_norms(module):
    """Swap every torch.nn.LayerNorm and torch.nn.RMSNorm in `module` (or
    `module` itself, returned) for lnfast's, in place: the same Parameter
    objects (so an optimizer built before still holds them), device and
    dtype.  Returns the module."""
    top = _swapped(module)
    if top is not None:
        return top
    for parent in module.modules():
        for name, child in list(parent.named_children()):
            new = _swapped(child)
            if new is not None:
                setattr(parent, name, new)
    return module
