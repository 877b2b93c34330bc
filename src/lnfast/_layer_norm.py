"""LayerNorm and the fused residual-add LayerNorm (SPEC "Functions").

Each function picks the backend for its arrays' kind (lnfast._dispatch) and
hands it the call; the backend checks the arguments (lnfast._checks).  An
`axis` other than the last goes through lnfast._axes first."""
from lnfast import _axes, _checks
from lnfast._dispatch import backend


def _last(axis):
    return type(axis) is int and axis == -1


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, axis=-1, out=None):
    """LayerNorm of `x` over `axis` (an int or a tuple of ints; the last by
    default): (x - mean) * rstd * weight + bias.

    weight and bias have the normalized axes' shape.  `out`, if given, must
    have x's shape and dtype and may be `x` itself.
    """
    kernels = backend("x weight bias out", x, weight, bias, out)
    if not _last(axis):
        return _axes.forward(kernels, x, None, weight, bias, eps, out, True, False, axis)[0]
    return kernels.forward(x, None, weight, bias, eps, out, True, False)[0]


def layer_norm_forward(x, weight=None, bias=None, *, eps=1e-5, axis=-1):
    """LayerNorm that also returns the row statistics: (y, mean, rstd).

    mean and rstd have x's shape without the normalized axes, and x's dtype
    (float32 for float16 and bfloat16 x).
    """
    kernels = backend("x weight bias", x, weight, bias)
    if not _last(axis):
        y, _, mean, rstd = _axes.forward(kernels, x, None, weight, bias, eps, None, True, True,
                                         axis)
    else:
        y, _, mean, rstd = kernels.forward(x, None, weight, bias, eps, None, True, True)
    return y, mean, rstd


def layer_norm_backward(dy, x, mean, rstd, weight=None, *, axis=-1):
    """Gradients of layer_norm over `axis` (that of the forward pass): (dx,
    dweight, dbias).

    dweight and dbias are sums over every row, of the normalized axes'
    shape, in the dtype of `weight` (of `x` when weight is None),
    accumulated in float64.
    """
    kernels = backend("x dy mean rstd weight", x, dy, mean, rstd, weight)
    if not _last(axis):
        return _axes.backward(kernels, dy, x, mean, rstd, weight, None, True, "x", axis)
    return kernels.backward(dy, x, mean, rstd, weight, None, True, "x")


def add_layer_norm_forward(x, residual, weight=None, bias=None, *, eps=1e-5, axis=-1):
    """Fused pre-norm residual step: z = x + residual, y = LayerNorm(z).

    One pass reads x and residual and writes y and z: (y, z, mean, rstd).
    """
    if residual is None:    # (the backends read None as no residual)
        _checks.forward_args(x, None, weight, bias, eps, None, True, axis)
        _checks.like("residual", residual, x)
    kernels = backend("x residual weight bias", x, residual, weight, bias)
    if not _last(axis):
        return _axes.forward(kernels, x, residual, weight, bias, eps, None, True, True, axis)
    return kernels.forward(x, residual, weight, bias, eps, None, True, True)


def add_layer_norm_backward(dy, z, mean, rstd, weight=None, *, dz=None, axis=-1):
    """Gradients of add_layer_norm_forward: (dsum, dweight, dbias).

    dsum is the gradient of both x and residual: the LayerNorm gradient
    reaching z, plus `dz` (the gradient z receives from the next residual
    connection) when given.
    """
    kernels = backend("z dy mean rstd weight dz", z, dy, mean, rstd, weight, dz)
    if not _last(axis):
        return _axes.backward(kernels, dy, z, mean, rstd, weight, dz, True, "z", axis)
    return kernels.backward(dy, z, mean, rstd, weight, dz, True, "z")
