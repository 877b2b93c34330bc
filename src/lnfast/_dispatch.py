"""Backend choice by array type, shared by every public function.

NumPy arrays run on the CPU kernels (lnfast._kernels), CuPy arrays on the
CUDA kernels (lnfast._gpu, which imports CuPy on first use).  Arguments are
checked (lnfast._checks) before this is asked.
"""
import numpy as np

from lnfast import _checks, _kernels


def _kind(a):
    return "cupy.ndarray" if _checks.is_cupy(a) else "numpy.ndarray"


def backend(names, x, *others):
    """The kernels module for x's kind; every other array must be the same kind.

    names: the arguments' names, x's first, separated by spaces (read only
    to word an error)."""
    if type(x) is np.ndarray:
        for a in others:
            if a is not None and type(a) is not np.ndarray:
                break
        else:
            return _kernels             # the common case, decided quickly
    x_name, *other_names = names.split()
    kind = _kind(x)
    for name, a in zip(other_names, others):
        if a is not None and _kind(a) != kind:
            raise TypeError(
                f"{name} is a {_kind(a)} but {x_name} is a {kind}: "
                "pass all arrays of one call on the same device")
    if kind == "cupy.ndarray":
        from lnfast import _gpu

        return _gpu
    return _kernels
