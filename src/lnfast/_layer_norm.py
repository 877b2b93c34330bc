"""LayerNorm and the fused residual-add LayerNorm (SPEC "Functions").

Each function picks the backend for its arrays' kind (lnfast._dispatch) and
hands it the call; the backend checks the arguments (lnfast._checks).  An
`axis` other than the last goes through lnfast._axes first."""
from typing import Optional, TypeVar, Union

from lnfast import _axes, _checks
from lnfast._dispatch import backend
from lnfast._doc import fill

# An array of one kind (numpy.ndarray, cupy.ndarray or dask.array.Array):
# results are of the inputs' kind.
A = TypeVar("A")
Axis = Union[int, tuple[int, ...]]


def _last(axis: Axis) -> bool:
    return type(axis) is int and axis == -1


@fill
def layer_norm(x: A, weight: Optional[A] = None, bias: Optional[A] = None, *,
               eps: float = 1e-5, axis: Axis = -1, out: Optional[A] = None) -> A:
    """LayerNorm: ``(x - mean) * rstd * weight + bias`` over `axis`.

    mean and variance are taken over the normalized axes of each row in
    float64 (float32 data too); ``rstd = 1 / sqrt(variance + eps)``.

    Parameters
    ----------
    {x}
    {weight}
    {bias}
    {eps}
    {axis}
    {out}

    Returns
    -------
    y : array
        x's shape and dtype, C-contiguous (`out` itself when given).

    {raises}

    See Also
    --------
    layer_norm_forward : also returns the row statistics, for the backward.

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 6.0]])
    >>> lnfast.layer_norm(x, eps=0.0)
    array([[-1.34164079, -0.4472136 ,  0.4472136 ,  1.34164079],
           [-0.57735027, -0.57735027, -0.57735027,  1.73205081]])

    Over the first axis instead (a channels-first layout needs no copy):

    >>> lnfast.layer_norm(np.arange(6.0).reshape(2, 3), axis=0, eps=0.0)
    array([[-1., -1., -1.],
           [ 1.,  1.,  1.]])
    """
    kernels = backend("x weight bias out", x, weight, bias, out)
    if not _last(axis):
        return _axes.forward(kernels, x, None, weight, bias, eps, out, True, False, axis)[0]
    return kernels.forward(x, None, weight, bias, eps, out, True, False)[0]


@fill
def layer_norm_forward(x: A, weight: Optional[A] = None, bias: Optional[A] = None, *,
                       eps: float = 1e-5, axis: Axis = -1) -> tuple[A, A, A]:
    """LayerNorm that also returns the row statistics the backward takes.

    Parameters
    ----------
    {x}
    {weight}
    {bias}
    {eps}
    {axis}

    Returns
    -------
    y : array
        As `layer_norm` returns it.
    {stats}

    {raises}

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 6.0]])
    >>> y, mean, rstd = lnfast.layer_norm_forward(x, eps=0.0)
    >>> mean, rstd
    (array([2.5, 3. ]), array([0.89442719, 0.57735027]))
    """
    kernels = backend("x weight bias", x, weight, bias)
    if not _last(axis):
        y, _, mean, rstd = _axes.forward(kernels, x, None, weight, bias, eps, None, True, True,
                                         axis)
    else:
        y, _, mean, rstd = kernels.forward(x, None, weight, bias, eps, None, True, True)
    return y, mean, rstd


@fill
def layer_norm_backward(dy: A, x: A, mean: A, rstd: A, weight: Optional[A] = None, *,
                        axis: Axis = -1) -> tuple[A, A, A]:
    """The gradients of `layer_norm` from the gradient of its output.

    One sweep over the rows computes dx and the dweight/dbias sums.

    Parameters
    ----------
    {dy}
    {x}
    {mean}
    {rstd}
    {weight}
    {axis}

    Returns
    -------
    dx : array
        The gradient of x: x's shape and dtype.
    {grads}

    {raises_backward}

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 6.0]])
    >>> y, mean, rstd = lnfast.layer_norm_forward(x, eps=0.0)
    >>> dx, dweight, dbias = lnfast.layer_norm_backward(np.ones_like(x), x, mean, rstd)
    >>> dbias
    array([2., 2., 2., 2.])
    """
    mean, rstd = _checks.scalar_stat(mean), _checks.scalar_stat(rstd)
    kernels = backend("x dy mean rstd weight", x, dy, mean, rstd, weight)
    if not _last(axis):
        return _axes.backward(kernels, dy, x, mean, rstd, weight, None, True, "x", axis)
    return kernels.backward(dy, x, mean, rstd, weight, None, True, "x")


@fill
def add_layer_norm_forward(x: A, residual: A, weight: Optional[A] = None,
                           bias: Optional[A] = None, *, eps: float = 1e-5,
                           axis: Axis = -1) -> tuple[A, A, A, A]:
    """The pre-norm residual step fused: ``z = x + residual``, ``y = layer_norm(z)``.

    One pass reads x and residual and writes y and z.

    Parameters
    ----------
    {x}
    residual : array
        Added to x: x's shape and dtype.
    {weight}
    {bias}
    {eps}
    {axis}

    Returns
    -------
    y : array
        The LayerNorm of z.
    z : array
        ``x + residual``, rounded to x's dtype.
    {stats}

    {raises}

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0]])
    >>> y, z, mean, rstd = lnfast.add_layer_norm_forward(x, np.ones_like(x), eps=0.0)
    >>> z
    array([[2., 3., 4., 5.]])
    """
    if residual is None:    # (the backends read None as no residual)
        _checks.forward_args(x, None, weight, bias, eps, None, True, axis)
        _checks.like("residual", residual, x)
    kernels = backend("x residual weight bias", x, residual, weight, bias)
    if not _last(axis):
        return _axes.forward(kernels, x, residual, weight, bias, eps, None, True, True, axis)
    return kernels.forward(x, residual, weight, bias, eps, None, True, True)


@fill
def add_layer_norm_backward(dy: A, z: A, mean: A, rstd: A, weight: Optional[A] = None, *,
                            dz: Optional[A] = None, axis: Axis = -1) -> tuple[A, A, A]:
    """The gradients of `add_layer_norm_forward`.

    Parameters
    ----------
    {dy}
    z : array
        The sum the forward pass returned.
    {mean}
    {rstd}
    {weight}
    dz : array or None, optional
        The gradient z receives from elsewhere (the next residual
        connection), added to dsum.
    {axis}

    Returns
    -------
    dsum : array
        The gradient of both x and residual: the LayerNorm's gradient
        reaching z, plus dz.
    {grads}

    {raises_backward}

    Examples
    --------
    >>> import numpy as np, lnfast
    >>> x = np.array([[1.0, 2.0, 3.0, 4.0]])
    >>> y, z, mean, rstd = lnfast.add_layer_norm_forward(x, np.ones_like(x), eps=0.0)
    >>> dsum, dweight, dbias = lnfast.add_layer_norm_backward(
    ...     np.zeros_like(x), z, mean, rstd, dz=np.ones_like(x))
    >>> dsum
    array([[1., 1., 1., 1.]])
    """
    mean, rstd = _checks.scalar_stat(mean), _checks.scalar_stat(rstd)
    kernels = backend("z dy mean rstd weight dz", z, dy, mean, rstd, weight, dz)
    if not _last(axis):
        return _axes.backward(kernels, dy, z, mean, rstd, weight, dz, True, "z", axis)
    return kernels.backward(dy, z, mean, rstd, weight, dz, True, "z")
