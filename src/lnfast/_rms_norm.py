"""RMSNorm: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps)."""
from typing import Optional

from lnfast import _axes, _checks
from lnfast._dispatch import backend
from lnfast._doc import fill
from lnfast._layer_norm import A, Axis, _last


@fill
def rms_norm(x: A, weight: Optional[A] = None, *, eps: float = 1e-5, axis: Axis = -1,
             out: Optional[A] = None) -> A:
    """RMSNorm: ``x * rstd * weight``, ``rstd = 1 / sqrt(mean(x**2) + eps)`` over `axis`.

    Parameters
    ----------
    {x}
    {weight}
    {eps}
    {axis}
    {out}

    Returns
    -------
    y : array
        x's shape and dtype, C-contiguous (`out` itself when given).

    {raises}

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> lnfast.rms_norm(np.array([[3.0, 4.0]]), eps=0.0)
    array([[0.84852814, 1.13137085]])
    """
    kernels = backend("x weight out", x, weight, out)
    if not _last(axis):
        return _axes.forward(kernels, x, None, weight, None, eps, out, False, False, axis)[0]
    return kernels.forward(x, None, weight, None, eps, out, False, False)[0]


@fill
def rms_norm_forward(x: A, weight: Optional[A] = None, *, eps: float = 1e-5,
                     axis: Axis = -1) -> tuple[A, A]:
    """RMSNorm that also returns the row statistic the backward takes.

    Parameters
    ----------
    {x}
    {weight}
    {eps}
    {axis}

    Returns
    -------
    y : array
        As `rms_norm` returns it.
    rstd : array
        Per row, ``1 / sqrt(mean(x**2) + eps)``: x's shape without the
        normalized axes; float64 for float64 x, else float32.

    {raises}

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> lnfast.rms_norm_forward(np.array([[3.0, 4.0]]), eps=0.0)[1]
    array([0.28284271])
    """
    kernels = backend("x weight", x, weight)
    if not _last(axis):
        y, _, _, rstd = _axes.forward(kernels, x, None, weight, None, eps, None, False, True, axis)
    else:
        y, _, _, rstd = kernels.forward(x, None, weight, None, eps, None, False, True)
    return y, rstd


@fill
def rms_norm_backward(dy: A, x: A, rstd: A, weight: Optional[A] = None, *,
                      axis: Axis = -1) -> tuple[A, A]:
    """The gradients of `rms_norm` from the gradient of its output.

    Parameters
    ----------
    {dy}
    {x}
    {rstd}
    {weight}
    {axis}

    Returns
    -------
    dx : array
        The gradient of x: x's shape and dtype.
    dweight : array
        The sum over every row, as `layer_norm_backward`'s.

    {raises_backward}

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> x = np.array([[3.0, 4.0]])
    >>> y, rstd = lnfast.rms_norm_forward(x, eps=0.0)
    >>> dx, dweight = lnfast.rms_norm_backward(np.ones_like(x), x, rstd)
    >>> dweight
    array([0.84852814, 1.13137085])
    """
    rstd = _checks.scalar_stat(rstd)
    kernels = backend("x dy rstd weight", x, dy, rstd, weight)
    if not _last(axis):
        dx, dweight, _ = _axes.backward(kernels, dy, x, None, rstd, weight, None, False, "x",
                                        axis)
    else:
        dx, dweight, _ = kernels.backward(dy, x, None, rstd, weight, None, False, "x")
    return dx, dweight
