"""The dispatch layer: backend by array type, CuPy imported lazily, mixing
NumPy and CuPy arrays in one call a TypeError.  Runs without CuPy or a GPU."""
import subprocess
import sys

import numpy as np
import pytest

import lnfast


def run_python(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_import_does_not_import_cupy():
    p = run_python("import sys, numpy as np, lnfast\n"
                   "lnfast.layer_norm(np.ones((2, 3)))\n"
                   "assert 'cupy' not in sys.modules, 'cupy imported'\n")
    assert p.returncode == 0, p.stderr


def test_works_where_cupy_is_absent():
    # sys.modules[name] = None makes every `import cupy` fail.
    p = run_python("import sys; sys.modules['cupy'] = None\n"
                   "import numpy as np, lnfast\n"
                   "x = np.random.rand(4, 8)\n"
                   "y, m, r = lnfast.layer_norm_forward(x)\n"
                   "lnfast.layer_norm_backward(x, x, m, r)\n"
                   "lnfast.show_config()\n")
    assert p.returncode == 0, p.stderr
    assert "CuPy is not installed" in p.stdout


class FakeCupyArray:
    """Looks like a cupy.ndarray to the dispatch layer (no CuPy needed)."""

    def __init__(self, a):
        self._a = a
        self.dtype, self.shape, self.ndim = a.dtype, a.shape, a.ndim
        self.strides, self.flags = a.strides, a.flags


FakeCupyArray.__name__ = "ndarray"
FakeCupyArray.__module__ = "cupy._core.core"


@pytest.mark.parametrize("name", ["weight", "bias", "out"])
def test_mixing_numpy_and_cupy_is_a_type_error(name):
    x = np.ones((3, 4))
    kwargs = {name: FakeCupyArray(np.ones((3, 4) if name == "out" else 4))}
    with pytest.raises(TypeError, match=rf"{name} is a cupy.ndarray but x is a numpy.ndarray"):
        lnfast.layer_norm(x, **kwargs)


def test_mixing_in_backward_and_fused_calls():
    x = np.random.rand(3, 4)
    y, mean, rstd = lnfast.layer_norm_forward(x)
    with pytest.raises(TypeError, match="dy is a cupy.ndarray"):
        lnfast.layer_norm_backward(FakeCupyArray(x), x, mean, rstd)
    with pytest.raises(TypeError, match="residual is a cupy.ndarray"):
        lnfast.add_layer_norm_forward(x, FakeCupyArray(x))
    with pytest.raises(TypeError, match="rstd is a cupy.ndarray"):
        lnfast.rms_norm_backward(x, x, FakeCupyArray(rstd))
    fake_x = FakeCupyArray(x)
    with pytest.raises(TypeError, match="weight is a numpy.ndarray but x is a cupy.ndarray"):
        lnfast.rms_norm(fake_x, np.ones(4))


def test_numpy_arrays_use_the_cpu_kernels():
    from lnfast import _dispatch, _kernels

    x = np.ones((2, 2))
    assert _dispatch.backend("x weight", x, None) is _kernels
