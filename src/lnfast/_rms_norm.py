"""RMSNorm: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps)."""
from lnfast._dispatch import backend


def rms_norm(x, weight=None, *, eps=1e-5, out=None):
    """RMSNorm over the last axis of `x`; `out` may be `x` itself."""
    kernels = backend("x weight out", x, weight, out)
    return kernels.forward(x, None, weight, None, eps, out, False, False)[0]


def rms_norm_forward(x, weight=None, *, eps=1e-5):
    """RMSNorm that also returns rstd (shape x.shape[:-1]): (y, rstd)."""
    kernels = backend("x weight", x, weight)
    y, _, _, rstd = kernels.forward(x, None, weight, None, eps, None, False, True)
    return y, rstd


def rms_norm_backward(dy, x, rstd, weight=None):
    """Gradients of rms_norm: (dx, dweight); dweight sums over every row."""
    kernels = backend("x dy rstd weight", x, dy, rstd, weight)
    dx, dweight, _ = kernels.backward(dy, x, None, rstd, weight, None, False, "x")
    return dx, dweight
