"""RMSNorm: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps)."""
from lnfast import _checks
from lnfast._dispatch import backend
from lnfast._kernels import backward_common, forward_common


def _check_forward(x, weight, eps):
    D = _checks.data("x", x)
    _checks.param("weight", weight, D, x.dtype)
    return _checks.eps(eps)


def rms_norm(x, weight=None, *, eps=1e-5, out=None):
    """RMSNorm over the last axis of `x`; `out` may be `x` itself."""
    if out is None:
        done = forward_common(x, None, weight, None, eps, False, False)
        if done is not None:
            return done[0]
    eps = _check_forward(x, weight, eps)
    if out is not None:
        _checks.out(out, x.shape, x.dtype)
    kernels = backend("x weight out", x, weight, out)
    return kernels.forward(x, weight, None, eps, centered=False, out=out)[0]


def rms_norm_forward(x, weight=None, *, eps=1e-5):
    """RMSNorm that also returns rstd (shape x.shape[:-1]): (y, rstd)."""
    done = forward_common(x, None, weight, None, eps, False, True)
    if done is not None:
        return done[0], done[3]
    eps = _check_forward(x, weight, eps)
    kernels = backend("x weight", x, weight)
    y, _, _, rstd = kernels.forward(x, weight, None, eps, centered=False, with_rstd=True)
    return y, rstd


def rms_norm_backward(dy, x, rstd, weight=None):
    """Gradients of rms_norm: (dx, dweight); dweight sums over every row."""
    done = backward_common(dy, x, None, rstd, weight, None, False)
    if done is not None:
        return done[:2]
    D = _checks.data("x", x)
    _checks.like("dy", dy, x)
    _checks.stats("rstd", rstd, x.shape[:-1])
    _checks.param("weight", weight, D, x.dtype)
    kernels = backend("x dy rstd weight", x, dy, rstd, weight)
    dx, dweight, _ = kernels.backward(dy, x, None, rstd, weight, centered=False)
    return dx, dweight
