"""Docstring pieces shared by the public functions (numpydoc style), filled
in by `fill`, so that each parameter is described once."""
import textwrap
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable[..., object])

PARAMS = {
    "x": """x : numpy.ndarray, cupy.ndarray or dask.array.Array
    The data, float32, float64, float16 or bfloat16 (``ml_dtypes``), any
    strides; at least one axis.""",
    "weight": """weight : array or None, optional
    The scale, of the normalized axes' shape, in x's dtype or float32;
    None means ones.""",
    "bias": """bias : array or None, optional
    The shift, as weight; None means zeros.""",
    "eps": """eps : float, optional
    Added to the variance (mean square for RMSNorm) before the square root;
    finite and >= 0.""",
    "axis": """axis : int or tuple of ints, optional
    The normalized axes (the last by default); any others are rows.""",
    "out": """out : array, optional
    Where to write the result: x's shape and dtype, writeable; may be x
    itself.  Not for Dask arrays.""",
    "dy": """dy : array
    The gradient reaching the output y, of y's shape and dtype.""",
    "mean": """mean : array
    The row means the forward pass returned (x's shape without the
    normalized axes).""",
    "rstd": """rstd : array
    The reciprocal standard deviations (RMSNorm: reciprocal root mean
    squares) the forward pass returned.""",
    "stats": """mean, rstd : array
    Per row: x's shape without the normalized axes; float64 for float64
    x, else float32.""",
    "grads": """dweight, dbias : array
    Sums over every row, of the normalized axes' shape, in weight's dtype
    (with weight None: x's, float32 for 16-bit x), rounded once from
    float64 sums (float32 and 16-bit x: each row's terms added in float32
    over runs of 16 rows first: docs/api.md, "Numerics"); bitwise the same
    for any thread count.""",
    "raises": """Raises
------
TypeError
    An argument of the wrong type or dtype, or arrays of different kinds
    (NumPy, CuPy, Dask) in one call.
ValueError
    A wrong shape, axis or eps, or an empty normalized axis.  Nothing is
    written when a call raises.""",
}
PARAMS["raises_backward"] = PARAMS["raises"].replace("shape, axis or eps", "shape or axis")


def fill(fn: F) -> F:
    """Replace {name} in fn's docstring by PARAMS[name], indented as the
    placeholder is."""
    doc = fn.__doc__ or ""
    for name, text in PARAMS.items():
        key = "{" + name + "}"
        while key in doc:
            at = doc.index(key)
            indent = doc[doc.rfind("\n", 0, at) + 1:at]
            doc = doc.replace(indent + key, textwrap.indent(text, indent), 1)
    fn.__doc__ = doc
    return fn
