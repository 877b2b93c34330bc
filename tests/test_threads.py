"""SPEC "Threads and determinism": thread-count control, and results that are
bitwise identical whatever the thread count."""
import threading

import ml_dtypes
import numpy as np
import pytest

import lnfast


def test_set_and_get_num_threads(monkeypatch):
    monkeypatch.delenv("LNFAST_NUM_THREADS", raising=False)
    default = lnfast.get_num_threads()
    assert default >= 1
    lnfast.set_num_threads(3)
    assert lnfast.get_num_threads() == 3
    lnfast.set_num_threads(None)
    assert lnfast.get_num_threads() == default


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("LNFAST_NUM_THREADS", "5")
    assert lnfast.get_num_threads() == 5
    lnfast.set_num_threads(2)                  # the explicit setting wins
    assert lnfast.get_num_threads() == 2
    lnfast.set_num_threads(None)
    monkeypatch.setenv("LNFAST_NUM_THREADS", "zero")
    with pytest.raises(ValueError, match="LNFAST_NUM_THREADS"):
        lnfast.get_num_threads()
    for bad in ("zero", "0", "1025"):    # small calls (one thread) check it too
        monkeypatch.setenv("LNFAST_NUM_THREADS", bad)
        for shape in ((4, 8), (256, 256)):
            with pytest.raises(ValueError, match="LNFAST_NUM_THREADS"):
                lnfast.layer_norm(np.ones(shape, np.float32))
    monkeypatch.setenv("LNFAST_NUM_THREADS", "1024")
    assert lnfast.get_num_threads() == 1024


def test_threadpoolctl_limits_the_default(monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    monkeypatch.delenv("LNFAST_NUM_THREADS", raising=False)
    if not lnfast._cpu.build_info()["openmp"]:
        pytest.skip("serial build")
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert lnfast.get_num_threads() == 1
    lnfast.set_num_threads(2)           # an explicit setting is not overridden
    with threadpoolctl.threadpool_limits(1, user_api="openmp"):
        assert lnfast.get_num_threads() == 2


@pytest.mark.parametrize("n,exc", [(0, ValueError), (-2, ValueError), (1025, ValueError),
                                   (1.5, TypeError), ("4", TypeError)])
def test_bad_thread_counts(n, exc):
    with pytest.raises(exc, match=r"\bn\b"):
        lnfast.set_num_threads(n)


def all_results(x, w, b, dy):
    """Every function's every output, for one set of inputs."""
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b)
    fused = lnfast.add_layer_norm_forward(x, dy, w, b)
    ry, rrstd = lnfast.rms_norm_forward(x, w)
    return (y, mean, rstd, lnfast.layer_norm(x, w, b),
            *lnfast.layer_norm_backward(dy, x, mean, rstd, w),
            *fused, *lnfast.add_layer_norm_backward(dy, fused[1], fused[2], fused[3],
                                                    w, dz=x),
            ry, rrstd, lnfast.rms_norm(x, w), *lnfast.rms_norm_backward(dy, x, rrstd, w))


# 16-bit data with float32 weights, and with weights of its own dtype (which
# each thread widens for itself)
DTYPES = [(np.float32, np.float32), (np.float64, np.float64),
          (np.float16, np.float32), (ml_dtypes.bfloat16, np.float32),
          (np.float16, np.float16), (ml_dtypes.bfloat16, ml_dtypes.bfloat16)]


@pytest.mark.parametrize("dtype,wdtype", DTYPES,
                         ids=[f"{np.dtype(d).name}-{np.dtype(w).name}" for d, w in DTYPES])
@pytest.mark.parametrize("shape", [(2000, 64), (300, 1000), (7, 5000), (40, 4096)])
def test_bitwise_identical_for_any_thread_count(rng, dtype, wdtype, shape):
    assert_same_for_any_thread_count(rng, dtype, wdtype, shape)


def assert_same_for_any_thread_count(rng, dtype, wdtype, shape):
    """all_results on 2 to 8 threads are the bytes of 1 thread's."""
    x = rng.standard_normal(shape).astype(dtype)
    w = rng.standard_normal(shape[-1]).astype(wdtype)
    b = rng.standard_normal(shape[-1]).astype(wdtype)
    dy = rng.standard_normal(shape).astype(dtype)
    lnfast.set_num_threads(1)
    want = all_results(x, w, b, dy)
    for n in range(2, 9):
        lnfast.set_num_threads(n)
        for got, exp in zip(all_results(x, w, b, dy), want):
            assert got.tobytes() == exp.tobytes(), f"{n} threads"


def test_calls_from_many_python_threads(rng):
    x = rng.standard_normal((512, 256))
    dy = rng.standard_normal((512, 256))
    want = all_results(x, None, None, dy)
    errors = []

    def work():
        try:
            for _ in range(10):
                for got, exp in zip(all_results(x, None, None, dy), want):
                    assert np.array_equal(got, exp)
        except Exception as e:          # reported to the main thread
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
