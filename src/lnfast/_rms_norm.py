"""RMSNorm: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps)."""
from lnfast import _axes
from lnfast._dispatch import backend
from lnfast._layer_norm import _last


def rms_norm(x, weight=None, *, eps=1e-5, axis=-1, out=None):
    """RMSNorm of `x` over `axis` (the last by default); `out` may be `x`
    itself; weight has the normalized axes' shape."""
    kernels = backend("x weight out", x, weight, out)
    if not _last(axis):
        return _axes.forward(kernels, x, None, weight, None, eps, out, False, False, axis)[0]
    return kernels.forward(x, None, weight, None, eps, out, False, False)[0]


def rms_norm_forward(x, weight=None, *, eps=1e-5, axis=-1):
    """RMSNorm that also returns rstd (x's shape without the normalized
    axes): (y, rstd)."""
    kernels = backend("x weight", x, weight)
    if not _last(axis):
        y, _, _, rstd = _axes.forward(kernels, x, None, weight, None, eps, None, False, True, axis)
    else:
        y, _, _, rstd = kernels.forward(x, None, weight, None, eps, None, False, True)
    return y, rstd


def rms_norm_backward(dy, x, rstd, weight=None, *, axis=-1):
    """Gradients of rms_norm over `axis`: (dx, dweight); dweight sums over
    every row."""
    kernels = backend("x dy rstd weight", x, dy, rstd, weight)
    if not _last(axis):
        dx, dweight, _ = _axes.backward(kernels, dy, x, None, rstd, weight, None, False, "x",
                                        axis)
    else:
        dx, dweight, _ = kernels.backward(dy, x, None, rstd, weight, None, False, "x")
    return dx, dweight
