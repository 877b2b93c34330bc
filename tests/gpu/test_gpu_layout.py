"""The GPU launcher's row layout (lnfast._gpu._rows and friends), checked on
NumPy views without CuPy: the kernels' row_offset formula applied to what
_rows returns must land on every row's first element, for every array."""
import numpy as np
import pytest

from lnfast import _gpu


def address(a):
    return a.__array_interface__["data"][0]


def kernel_row_offset(r, n, st):
    """norm.cu's row_offset(): element offset of row r."""
    i2 = r % n[2]
    r //= n[2]
    return (r // n[1]) * st[0] + (r % n[1]) * st[1] + i2 * st[2]


def views(rng):
    base = rng.standard_normal((4, 6, 5, 40))
    yield "contiguous", base
    yield "every other element", base[..., ::2]
    yield "negative strides", base[::-1, :, ::-1, ::-2]
    yield "transposed leading axes", base.transpose(2, 0, 1, 3)
    yield "feature axis transposed", np.ascontiguousarray(base.transpose(3, 0, 1, 2)).transpose(1, 2, 3, 0)
    yield "broadcast rows", np.broadcast_to(base[0, 0, 0], (4, 6, 5, 40))
    yield "one row", base[0, 0, 0]
    yield "unit axes", base[:1, :, :1]


@pytest.mark.parametrize("name", [n for n, _ in views(np.random.default_rng(0))])
def test_row_offsets_land_on_every_row(rng, name):
    a = dict(views(rng))[name]
    other = np.ascontiguousarray(a)          # a second array of another layout
    lead = a.shape[:-1]
    layout = _gpu._rows([a, other], lead)
    if layout is None:                       # only for > 3 unmergeable axes
        assert len([n for n in lead if n != 1]) > 3
        return
    n, per = layout
    assert int(np.prod(n)) == int(np.prod(lead))
    for arr, st in zip((a, other), per):
        assert st[3] * arr.itemsize == arr.strides[-1]
        for r, idx in enumerate(np.ndindex(*lead)):     # rows in C order
            got = address(arr) + kernel_row_offset(r, n, st) * arr.itemsize
            assert got == address(arr[idx]), (name, r)


def test_four_unmergeable_axes_ask_for_a_copy(rng):
    a = rng.standard_normal((3, 4, 5, 6, 7))[::2, ::2, ::2, ::2]
    assert _gpu._rows([a], a.shape[:-1]) is None


def test_threads_per_row():
    for D in (1, 7, 64, 768, 4096, 16384, 65536, 10**6):
        for vec in (1, 2, 4, 8):
            t = _gpu._threads(D, vec)
            assert t % 32 == 0 and 32 <= t <= 512


def test_instantiation_names_are_the_launch_names():
    names = set(_gpu.name_expressions())
    for dtype in _gpu._CTYPES:
        for vec in _gpu._vec_widths(dtype):
            for centered in (True, False):
                assert _gpu._name("norm_forward", dtype, vec, centered) in names
                assert _gpu._name("norm_backward_partial", dtype, vec, centered) in names
    assert set(_gpu._REDUCE.values()) <= names
