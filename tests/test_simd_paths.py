"""Every instruction set gives the same bytes.

The row sweeps are built for AVX-512, AVX2 and the baseline (SSE2; NEON on
aarch64), each with vectors of its own width, and picked at run time.
`_cpu.simd_path` makes the tests run a path below the best the CPU has (a
path the CPU lacks falls back to the next one down), so on one machine
every built path is compared with the others, in every dtype and function.
"""
import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _cpu
from lnfast import reference as ref

PATHS = ["best", "avx512", "avx2", "portable"]
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16),
          np.dtype(ml_dtypes.bfloat16)]
# blocks of 64, single vectors of 16, a tail; one of each alone; D = 1
SIZES = [1, 3, 16, 64, 100, 777]


@pytest.fixture
def on_path():
    """Run a callable under each path; the outputs' bytes, per path."""
    def run(call):
        got = {}
        try:
            for path in PATHS:
                _cpu.simd_path(path)
                got[path] = [np.ascontiguousarray(a).tobytes() for a in call()]
        finally:
            _cpu.simd_path("best")
        return got
    return run


def every_function(x, dy, w, axis=-1):
    y, mean, rstd = lnfast.layer_norm_forward(x, w, w, axis=axis)
    ry, rrstd = lnfast.rms_norm_forward(x, w, axis=axis)
    return (y, mean, rstd, *lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis),
            *lnfast.add_layer_norm_forward(x, dy, w, w, axis=axis),
            *lnfast.add_layer_norm_backward(dy, x, mean, rstd, w, dz=y, axis=axis),
            ry, rrstd, *lnfast.rms_norm_backward(dy, x, rrstd, w, axis=axis))


@pytest.mark.parametrize("D", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_every_path_gives_the_same_bytes(rng, on_path, dtype, D):
    x = (rng.standard_normal((37, D)) * 3 + 5).astype(dtype)
    dy = rng.standard_normal((37, D)).astype(dtype)
    w = rng.standard_normal(D).astype(np.float64 if dtype == np.float64 else np.float32)
    got = on_path(lambda: every_function(x, dy, w))
    for path in PATHS[1:]:
        assert got[path] == got["best"], path


# rows far apart (channels-first tiles: full, and a short one copied; 17
# normalized elements, one past a group of blocks; more than 16 tiles to a
# chunk of the backward) and axes gathered; a constant row and one far
# from its shift among them (rows redone in float64)
@pytest.mark.parametrize("shape,axis", [((3, 17, 5, 7), 1), ((2, 40, 4, 4), -3),
                                        ((2, 8, 128, 72), 1), ((2, 6, 4, 10), (1, 3))])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_every_path_gives_the_same_bytes_over_axes(rng, on_path, dtype, shape, axis):
    x = (rng.standard_normal(shape) * 3 + 5).astype(dtype)
    ax = tuple(np.atleast_1d(axis) % len(shape))
    rows = np.moveaxis(x, ax, tuple(range(len(shape) - len(ax), len(shape))))
    lead = len(shape) - len(ax)
    rows[(0,) * lead] = 7
    rows[(1,) * (lead - 1) + (2,)] += 3e4 if np.dtype(dtype).itemsize > 2 else 300
    dy = rng.standard_normal(shape).astype(dtype)
    norm = tuple(np.take(shape, np.atleast_1d(axis)))
    w = rng.standard_normal(norm).astype(np.float64 if dtype == np.float64 else np.float32)
    got = on_path(lambda: every_function(x, dy, w, axis))
    for path in PATHS[1:]:
        assert got[path] == got["best"], path


@pytest.mark.parametrize("dtype", DTYPES[:2], ids=lambda d: d.name)
def test_every_path_matches_float64(rng, dtype):
    # Not only the same bytes: each path's forward is right.
    x = rng.standard_normal((64, 4097)).astype(dtype)
    want = ref.layer_norm_forward(x)[0]
    errors = {}
    try:
        for path in PATHS:
            _cpu.simd_path(path)
            errors[path] = ref.rel_error(lnfast.layer_norm(x), want)
    finally:
        _cpu.simd_path("best")
    limit = 1e-6 if dtype == np.float32 else 1e-14
    assert all(e <= limit for e in errors.values()), errors


def test_paths_run_the_builds_the_cpu_has():
    # The tests above compare real builds: each path the CPU supports runs
    # its own sweeps, and "portable" always the baseline.
    try:
        runs = {path: _cpu.simd_path(path) for path in PATHS}
    finally:
        _cpu.simd_path("best")
    assert runs["portable"] == "baseline"
    assert runs["best"] == runs["avx512"]
    simd = _cpu.build_info()["simd"]
    if "AVX-512 (runtime dispatch)" in simd:
        assert (runs["avx512"], runs["avx2"]) == ("avx512", "avx2")
    elif "AVX2 (runtime dispatch)" in simd:
        assert (runs["avx512"], runs["avx2"]) == ("avx2", "avx2")
    else:
        assert set(runs.values()) == {"baseline"}


def test_unknown_path_is_refused():
    with pytest.raises(KeyError):
        _cpu.simd_path("avx1024")
