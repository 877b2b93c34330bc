"""Long backward rows summed by column blocks (docs/performance_cpu.md, "Long
backward rows shared by the threads").  Where a row's working set in the backward
sweep outgrows one core's L2, the threads share each row's columns, block by
block, with a barrier per row.  Each block's sums are added in block order,
so the results are bitwise the same whatever the thread count, and whether
the threads share rows (no more threads than blocks) or take rows of their
own (more).  Most tests shrink the thresholds (_cpu.blocked_settings), so
that small rows take that path with several blocks."""
import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _cpu, reference
from tests.helpers import BACKWARD_TOL
from tests.test_threads import DTYPES, assert_same_for_any_thread_count

DEFAULT = (7 << 18, 4096)       # bytes of a row's working set; columns per block


@pytest.fixture
def blocks_of_64():
    """Every contiguous backward row summed by blocks of 64 columns."""
    old = _cpu.blocked_settings(0, 64)
    assert old == DEFAULT
    yield
    _cpu.blocked_settings(*old)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_settings_are_checked():
    with pytest.raises(ValueError):
        _cpu.blocked_settings(-1, 64)
    with pytest.raises(ValueError):
        _cpu.blocked_settings(0, 0)
    assert _cpu.blocked_settings(*DEFAULT) == DEFAULT


# D = 150: 3 blocks, so 2-3 threads share rows and 4-5 take chunks of their
# own (300 rows are 5 chunks); D = 300: 5 blocks, shared by 2-5 threads;
# D = 1000: 16 blocks over 3 chunks.
@pytest.mark.parametrize("dtype,wdtype", DTYPES,
                         ids=[f"{np.dtype(d).name}-{np.dtype(w).name}" for d, w in DTYPES])
@pytest.mark.parametrize("shape", [(300, 150), (300, 300), (130, 1000)])
def test_bitwise_identical_for_any_thread_count(blocks_of_64, rng, dtype, wdtype, shape):
    assert_same_for_any_thread_count(rng, dtype, wdtype, shape)


# The SPEC's bars: float32/float64 as everywhere; 16-bit dx within 2 u and
# dweight/dbias (float32 weights) within 1e-4.
TOL = {np.float32: (BACKWARD_TOL[np.float32],) * 2, np.float64: (BACKWARD_TOL[np.float64],) * 2,
       np.float16: (2 * 2.0**-11, 1e-4), ml_dtypes.bfloat16: (2 * 2.0**-8, 1e-4)}


@pytest.mark.parametrize("dtype", list(TOL), ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_backward_matches_the_reference(blocks_of_64, rng, dtype, threads):
    lnfast.set_num_threads(threads)
    M, D = 257, 333                     # a partial last block, odd rows
    wdtype = dtype if dtype in (np.float32, np.float64) else np.float32
    x = (rng.standard_normal((M, D)) * 3 + 5).astype(dtype)
    dy, dz = (rng.standard_normal((M, D)).astype(dtype) for _ in range(2))
    w = rng.standard_normal(D).astype(wdtype)
    tol_dx, tol_dw = TOL[dtype]
    _, mean, rstd = lnfast.layer_norm_forward(x, w, w)
    got = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    want = reference.layer_norm_backward(dy, x, mean, rstd, w)
    assert rel(got[0], want[0]) < tol_dx
    assert rel(got[1], want[1]) < tol_dw and rel(got[2], want[2]) < tol_dw
    _, rs = lnfast.rms_norm_forward(x, w)
    got = lnfast.rms_norm_backward(dy, x, rs, w)
    want = reference.rms_norm_backward(dy, x, rs, w)
    assert rel(got[0], want[0]) < tol_dx and rel(got[1], want[1]) < tol_dw
    got = lnfast.add_layer_norm_backward(dy, x, mean, rstd, w, dz=dz)
    want = reference.add_layer_norm_backward(dy, x, mean, rstd, w, dz=dz)
    assert rel(got[0], want[0]) < tol_dx
    assert rel(got[1], want[1]) < tol_dw and rel(got[2], want[2]) < tol_dw


def test_rows_redone_in_float64_inside_shared_rows(blocks_of_64, rng):
    # float32 rows whose gradient sums overflow float32 (x near 1e30, dy
    # near 1e10; every 7th row, so some start or end a chunk or a run of
    # dweight/dbias terms) are redone whole in float64 by one thread between
    # two barriers: the same bytes on 1-6 threads, dx finite and the same as
    # on the unblocked path.
    M, D = 1000, 321
    x = rng.standard_normal((M, D)).astype(np.float32)
    dy = rng.standard_normal((M, D)).astype(np.float32)
    big = np.arange(0, M, 7)
    x[big] *= 1e30
    dy[big] *= 1e10
    _, mean, rstd = lnfast.layer_norm_forward(x)
    results = []
    for n in range(1, 7):
        lnfast.set_num_threads(n)
        results.append(lnfast.layer_norm_backward(dy, x, mean, rstd))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert a.tobytes() == b.tobytes()
    dx, dw, db = results[0]
    assert np.isfinite(dx).all() and np.isfinite(db).all()
    want = reference.layer_norm_backward(dy, x, mean, rstd, None)[0]
    assert rel(dx, want) < BACKWARD_TOL[np.float32]
    _cpu.blocked_settings(*DEFAULT)
    try:
        plain = lnfast.layer_norm_backward(dy, x, mean, rstd)[0]
    finally:
        _cpu.blocked_settings(0, 64)
    assert np.array_equal(dx[big], plain[big])


def test_long_rows_take_the_blocked_path_by_default(rng):
    # 32768 float64 columns: a working set of 1.75 MiB, so 8 blocks of 4096
    # shared by the threads; the same bits on 1 and 2 threads, and as
    # accurate as elsewhere.
    M, D = 64, 32768
    x, dy = rng.standard_normal((M, D)), rng.standard_normal((M, D))
    w = rng.standard_normal(D)
    _, mean, rstd = lnfast.layer_norm_forward(x, w, w)
    results = []
    for n in (1, 2):
        lnfast.set_num_threads(n)
        results.append(lnfast.layer_norm_backward(dy, x, mean, rstd, w))
    for got, exp in zip(*results):
        assert got.tobytes() == exp.tobytes()
    want = reference.layer_norm_backward(dy, x, mean, rstd, w)
    for got, exp in zip(results[0], want):
        assert rel(got, exp) < BACKWARD_TOL[np.float64]
    # ... and the unblocked sums of the same rows differ only in rounding
    old = _cpu.blocked_settings(1 << 40, 4096)
    try:
        plain = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    finally:
        _cpu.blocked_settings(*old)
    assert not np.array_equal(plain[0], results[0][0])
    assert rel(plain[0], results[0][0]) < 1e-14
