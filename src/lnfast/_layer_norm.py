"""LayerNorm and the fused residual-add LayerNorm (SPEC "Functions")."""
from lnfast import _checks
from lnfast._dispatch import backend
from lnfast._kernels import backward_common, forward_common


def _check_forward(x, weight, bias, eps):
    D = _checks.data("x", x)
    _checks.param("weight", weight, D, x.dtype)
    _checks.param("bias", bias, D, x.dtype)
    return _checks.eps(eps)


def _check_backward(dy, x, mean, rstd, weight, x_name):
    D = _checks.data(x_name, x)
    _checks.like("dy", dy, x, x_name)
    _checks.stats("mean", mean, x.shape[:-1])
    _checks.stats("rstd", rstd, x.shape[:-1])
    _checks.param("weight", weight, D, x.dtype)


def layer_norm(x, weight=None, bias=None, *, eps=1e-5, out=None):
    """LayerNorm over the last axis of `x`: (x - mean) * rstd * weight + bias.

    `out`, if given, must have x's shape and dtype and may be `x` itself.
    """
    if out is None:
        done = forward_common(x, None, weight, bias, eps, True, False)
        if done is not None:
            return done[0]
    eps = _check_forward(x, weight, bias, eps)
    if out is not None:
        _checks.out(out, x.shape, x.dtype)
    kernels = backend("x weight bias out", x, weight, bias, out)
    return kernels.forward(x, weight, bias, eps, centered=True, out=out)[0]


def layer_norm_forward(x, weight=None, bias=None, *, eps=1e-5):
    """LayerNorm that also returns the row statistics: (y, mean, rstd).

    mean and rstd have shape x.shape[:-1] and x's dtype (float32 for
    float16 and bfloat16 x).
    """
    done = forward_common(x, None, weight, bias, eps, True, True)
    if done is not None:
        return done[0], done[2], done[3]
    eps = _check_forward(x, weight, bias, eps)
    kernels = backend("x weight bias", x, weight, bias)
    y, _, mean, rstd = kernels.forward(x, weight, bias, eps, centered=True,
                                       with_mean=True, with_rstd=True)
    return y, mean, rstd


def layer_norm_backward(dy, x, mean, rstd, weight=None):
    """Gradients of layer_norm: (dx, dweight, dbias).

    dweight and dbias are sums over every row, of shape (D,), in the dtype of
    `weight` (of `x` when weight is None), accumulated in float64.
    """
    done = backward_common(dy, x, mean, rstd, weight, None, True)
    if done is not None:
        return done
    _check_backward(dy, x, mean, rstd, weight, "x")
    kernels = backend("x dy mean rstd weight", x, dy, mean, rstd, weight)
    return kernels.backward(dy, x, mean, rstd, weight, centered=True)


def add_layer_norm_forward(x, residual, weight=None, bias=None, *, eps=1e-5):
    """Fused pre-norm residual step: z = x + residual, y = LayerNorm(z).

    One pass reads x and residual and writes y and z: (y, z, mean, rstd).
    """
    if residual is not None:     # (None is for forward_common's plain LayerNorm)
        done = forward_common(x, residual, weight, bias, eps, True, True)
        if done is not None:
            return done
    eps = _check_forward(x, weight, bias, eps)
    _checks.like("residual", residual, x)
    kernels = backend("x residual weight bias", x, residual, weight, bias)
    return kernels.forward(x, weight, bias, eps, centered=True, residual=residual,
                           with_mean=True, with_rstd=True)


def add_layer_norm_backward(dy, z, mean, rstd, weight=None, *, dz=None):
    """Gradients of add_layer_norm_forward: (dsum, dweight, dbias).

    dsum is the gradient of both x and residual: the LayerNorm gradient
    reaching z, plus `dz` (the gradient z receives from the next residual
    connection) when given.
    """
    done = backward_common(dy, z, mean, rstd, weight, dz, True)
    if done is not None:
        return done
    _check_backward(dy, z, mean, rstd, weight, "z")
    if dz is not None:
        _checks.like("dz", dz, z, "z")
    kernels = backend("z dy mean rstd weight dz", z, dy, mean, rstd, weight, dz)
    return kernels.backward(dy, z, mean, rstd, weight, centered=True, dz=dz)
