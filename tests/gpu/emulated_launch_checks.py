"""Checks of the CuPy stand-in itself (tests/gpu/fake_cupy), run by
test_gpu_emulated.py with it on the path: a launch whose arguments do not
match the kernel's parameters is refused, so the GPU tests passing under it
means lnfast._gpu passes every kernel what it takes."""
import numpy as np
import pytest

import cupy
from lnfast import _gpu

pytestmark = pytest.mark.skipif(not cupy.__version__.endswith("emulated"),
                                reason="checks of the CuPy emulation only")

FORWARD = _gpu._name("norm_forward", np.dtype(np.float32), 1, True)
REDUCE = _gpu._REDUCE[np.dtype(np.float64)]


def reduce_args(part, dwdb, G=1, width=8):
    return (part, np.int64(G), np.int64(width), dwdb)


def test_matching_arguments_launch():
    part = cupy.asarray(np.arange(16.0).reshape(2, 8))
    dwdb = cupy.empty(8, np.float64)
    _gpu._kernel(REDUCE)((1,), (32,), reduce_args(part, dwdb, G=2))
    assert cupy.array_equal(dwdb, part[0] + part[1])


TAKES_I64 = r"argument 1: the kernel takes a scalar of 8 bytes \('i'\), "


@pytest.mark.parametrize("bad, message", [
    (np.int32(2), TAKES_I64 + r"got a scalar of 4 bytes \('i'\)"),
    (np.float64(2), TAKES_I64 + r"got a scalar of 8 bytes \('f'\)"),
])
def test_a_scalar_of_the_wrong_type_is_refused(bad, message):
    part, dwdb = cupy.zeros((1, 8), np.float64), cupy.zeros(8, np.float64)
    args = list(reduce_args(part, dwdb))
    args[1] = bad
    with pytest.raises(TypeError, match=message):
        _gpu._kernel(REDUCE)((1,), (32,), tuple(args))


def test_an_array_of_the_wrong_dtype_is_refused():
    part, dwdb = cupy.zeros((1, 8), np.float32), cupy.zeros(8, np.float64)
    with pytest.raises(TypeError, match="argument 0: the kernel takes a pointer to elements of 8"):
        _gpu._kernel(REDUCE)((1,), (32,), reduce_args(part, dwdb))


def test_a_wrong_argument_count_is_refused():
    with pytest.raises(TypeError, match="the kernel takes 21 arguments, got 3"):
        _gpu._kernel(FORWARD)((1,), (32,), (cupy.zeros(4, np.float32),) * 3)


def test_a_null_pointer_must_be_zero():
    part, dwdb = cupy.zeros((1, 8), np.float64), cupy.zeros(8, np.float64)
    with pytest.raises(TypeError, match="argument 3: the kernel takes a pointer"):
        _gpu._kernel(REDUCE)((1,), (32,), reduce_args(part, np.uint64(5)))
    _gpu._kernel(REDUCE)((1,), (32,), reduce_args(part, dwdb))
