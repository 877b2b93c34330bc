"""Plain NumPy float64 reference implementations, for tests and self-checks.

Everything here is written for clarity, not speed: two-pass statistics (the
mean corrected by the mean of x - mean), the textbook backward formula, the
explicit Jacobian of one row and a central finite-difference gradient.
"""
import numpy as np


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def layer_norm_forward(x, weight=None, bias=None, eps=1e-5):
    """(y, mean, rstd) in float64, normalizing over the last axis."""
    x = _f64(x)
    mean = x.mean(axis=-1)
    xc = x - mean[..., None]
    c = xc.mean(axis=-1)                        # the rounding of the mean itself,
    xc -= c[..., None]                          # which rows with a large offset
    mean += c                                   # would otherwise carry into y
    var = (xc * xc).mean(axis=-1)               # biased: divide by D
    rstd = 1.0 / np.sqrt(var + eps)             # eps inside the root
    y = xc * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y, mean, rstd


def layer_norm_backward(dy, x, mean, rstd, weight=None):
    """(dx, dweight, dbias) in float64; dweight, dbias sum over all rows."""
    dy, x = _f64(dy), _f64(x)
    mean, rstd = _f64(mean)[..., None], _f64(rstd)[..., None]
    D = x.shape[-1]
    xc = x - mean
    xhat = (xc - xc.mean(axis=-1, keepdims=True)) * rstd    # about the exact row mean
    g = dy if weight is None else dy * _f64(weight)   # weight stays inside the sums
    dx = rstd * (g - g.mean(axis=-1, keepdims=True)
                 - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dweight = (dy * xhat).reshape(-1, D).sum(axis=0)
    dbias = dy.reshape(-1, D).sum(axis=0)
    return dx, dweight, dbias


def add_layer_norm_forward(x, residual, weight=None, bias=None, eps=1e-5):
    """(y, z, mean, rstd) with z = x + residual and y = LayerNorm(z), float64."""
    z = _f64(x) + _f64(residual)
    y, mean, rstd = layer_norm_forward(z, weight, bias, eps)
    return y, z, mean, rstd


def add_layer_norm_backward(dy, z, mean, rstd, weight=None, dz=None):
    """(dsum, dweight, dbias): dsum = dL/dz through the norm, plus dz."""
    dsum, dweight, dbias = layer_norm_backward(dy, z, mean, rstd, weight)
    if dz is not None:
        dsum = dsum + _f64(dz)
    return dsum, dweight, dbias


def rms_norm_forward(x, weight=None, eps=1e-5):
    """(y, rstd) in float64: y = x * rstd * weight, rstd = 1/sqrt(mean(x^2)+eps)."""
    x = _f64(x)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1) + eps)
    y = x * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    return y, rstd


def rms_norm_backward(dy, x, rstd, weight=None):
    """(dx, dweight) in float64: dx = rstd * (g - xhat * mean(g * xhat))."""
    dy, x = _f64(dy), _f64(x)
    rstd = _f64(rstd)[..., None]
    D = x.shape[-1]
    xhat = x * rstd
    g = dy if weight is None else dy * _f64(weight)
    dx = rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    return dx, (dy * xhat).reshape(-1, D).sum(axis=0)


def layer_norm_jacobian(x, eps=1e-5):
    """d xhat / d x of one row: (1/sigma) (I - 1 1^T / D - xhat xhat^T / D).

    Symmetric, so dx = (dy * weight) @ J.  Built only for tests: the kernels
    use the two row sums it collapses to.
    """
    x = _f64(x)
    if x.ndim != 1:
        raise ValueError(f"x must be one row (1-D), got shape {x.shape}")
    D = x.shape[0]
    _, _, rstd = layer_norm_forward(x, eps=eps)
    xhat = (x - x.mean()) * rstd
    return rstd * (np.eye(D) - np.ones((D, D)) / D - np.outer(xhat, xhat) / D)


def finite_difference(f, x, h=1e-6):
    """Central-difference gradient of the scalar function f at float64 x."""
    x = np.array(x, dtype=np.float64)
    grad = np.empty_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        up = f(x)
        flat[i] = old - h
        down = f(x)
        flat[i] = old
        gflat[i] = (up - down) / (2 * h)
    return grad


def rel_error(out, ref):
    """||out - ref|| / ||ref|| in float64 (NaN never passes a <= check)."""
    out, ref = _f64(out), _f64(ref)
    denom = np.linalg.norm(ref)
    diff = np.linalg.norm(out - ref)
    return float(diff / denom) if denom > 0 else float(diff)
