# cython: language_level=3, wraparound=True, boundscheck=True
"""Backend choice by array type, shared by every public function.

NumPy arrays run on the CPU kernels (lnfast._kernels), CuPy arrays on the
CUDA kernels (lnfast._gpu, which imports CuPy on first use), Dask arrays
through lnfast._dask (which imports Dask; its blocks come back here).  The
backends take the same arguments and check them (lnfast._checks)
themselves; this only looks at the arrays' types, so that a bad argument
is still worded by the checks.
"""
cimport numpy as cnp

from lnfast import _checks, _kernels


def _kind(a):
    if _checks.is_cupy(a):
        return "cupy.ndarray"
    return "dask.array.Array" if _checks.is_dask(a) else "numpy.ndarray"


def backend(str names, x, *others):
    """The kernels module for x's kind; every other array must be the same kind.

    names: the arguments' names, x's first, separated by spaces (read only
    to word an error).  (Compiled: this runs on every call.)"""
    if type(x) is cnp.ndarray:
        for a in others:
            if a is not None and type(a) is not cnp.ndarray:
                break
        else:
            return _kernels             # the common case, decided quickly
    x_name, *other_names = names.split()
    kind = _kind(x)
    if kind == "dask.array.Array":      # (which checks the others' kinds)
        from lnfast import _dask

        return _dask
    for name, a in zip(other_names, others):
        if a is not None and _kind(a) != kind:
            raise TypeError(
                f"{name} is a {_kind(a)} but {x_name} is a {kind}: "
                "pass all arrays of one call on the same device")
    if kind == "cupy.ndarray":
        from lnfast import _gpu

        return _gpu
    return _kernels
