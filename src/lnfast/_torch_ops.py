"""lnfast.torch's two custom operators, `lnfast::norm` and
`lnfast::norm_backward` (`torch.library.custom_op`): their Python kernels,
which call lnfast's NumPy or CuPy functions on the tensors' data without a
copy, their fake kernels for tracing, their autograd, and their batching
rules for torch.func.vmap.  Where the C++ kernels are built (_torch_eager)
they serve the operators' CPU tensors instead of the Python kernels, with
the same bits.
"""
from typing import Optional

import ml_dtypes
import numpy as np
import torch

import lnfast
from lnfast import _cpu

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
