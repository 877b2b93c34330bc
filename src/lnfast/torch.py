"""lnfast for PyTorch (SPEC "Frameworks and engines"): the functions of
`torch.nn.functional`, `torch.nn`'s modules, and `replace_norms`.

    import lnfast.torch
    lnfast.torch.replace_norms(model)     # nn.LayerNorm / nn.RMSNorm -> lnfast's

The kernels are two custom operators (_torch_ops), `lnfast::norm` and
`lnfast::norm_backward` (`torch.library.custom_op`, with fake kernels for
tracing and autograd registered), so `torch.compile(fullgraph=True)`
traces them whole.  For CPU tensors their kernels and the forward's
autograd are C++ (torch_ext/lnfast_torch.cc over lnfast's C API, built on
first import: lnfast._build), and an eager call with plain CPU tensors
enters that C++ in one step (_torch_eager._eager: its checks, then the
operator through PyTorch's dispatcher), as a call of PyTorch's own
LayerNorm does.  The
Python kernels serve CUDA tensors (CuPy arrays through DLPack, on
PyTorch's current stream), and CPU tensors where the C++ cannot be built
(a warning says why) or LNFAST_TORCH_EXTENSION=0: CPU tensors then reach
the kernels as NumPy views (bfloat16 through a 16-bit integer view), and
eager calls go through an `autograd.Function`, which costs less per call
than the operators' Python dispatch (docs/torch.md).  Both give the same
bits.  torch.func's transforms work on both (batching rules:
_torch_ops._norm_vmap).
Gradients of gradients are not computed: asking for them is an error
naming `lnfast::norm_backward`, which has no derivative.
"""
import numbers
import operator
import sys
import warnings
from collections.abc import Sequence
from typing import List, Optional, Union

import torch

from lnfast import _checks
from lnfast._torch_eager import _apply, _eager
from lnfast._torch_ops import _TypeError, _ValueError

__all__ = ["LayerNorm", "RMSNorm", "add_layer_norm", "layer_norm", "replace_norms", "rms_norm"]

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

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
