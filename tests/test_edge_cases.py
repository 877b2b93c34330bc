"""Corner cases found in review: fork, self-overlapping out=, memory bounds,
values near float32's limits, bfloat16 gradients rounded once, alignment."""
import subprocess
import sys
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import lnfast
from lnfast import _cpu, _kernels, _pool
from lnfast import reference as ref

from .helpers import (REDO_ROWS, TINY_SPREAD_ROWS, UNDERFLOWED_PRODUCT_ROWS,
                      assert_backward_exact, assert_dx_within_its_terms,
                      assert_tiny_spread_row_exact, assert_underflowed_products_redone,
                      dx_of_rows_with_bad_dy, exact_backward, float64_rows_near_the_top,
                      float64_rows_of_tiny_terms, same)


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs fork")
def test_threaded_call_in_a_forked_child_does_not_hang():
    code = ("import os, sys, numpy as np, lnfast\n"
            "x = np.random.rand(4096, 256)\n"
            "lnfast.set_num_threads(2); lnfast.layer_norm(x)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    lnfast.layer_norm(x); os._exit(0 if lnfast.get_num_threads() == 1 else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "sys.exit(os.waitstatus_to_exitcode(status))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr


def test_openmps_default_is_capped_like_the_other_settings():
    # A serial build (LNFAST_OPENMP=0) has no OpenMP default to follow: one thread.
    expected = "1024" if _cpu.build_info()["openmp"] else "1"
    code = "import lnfast; print(lnfast.get_num_threads())"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "40000"}
    env.pop("LNFAST_NUM_THREADS", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 0 and p.stdout.strip() == expected, (p.stdout, p.stderr)


def test_emptying_the_cache_from_two_threads_keeps_its_limit():
    import threading

    limit = _pool.cache_info()[1]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(3):
            threads = [threading.Thread(target=lambda: [lnfast.empty_cache() for _ in range(2000)])
                       for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert _pool.cache_info()[1] == limit
    finally:
        sys.setswitchinterval(switch)


def test_backward_scratch_is_its_partial_rows_and_runs():
    # Scratch beyond the outputs: 64 chunks' float64 partial rows (2 D
    # doubles each) and each thread's float32 runs (2 D floats, 4 D apart).
    x = np.random.default_rng(3).standard_normal((8192, 1024)).astype(np.float32)
    _, mean, rstd = lnfast.layer_norm_forward(x)
    lnfast.set_num_threads(8)
    try:
        tracemalloc.start()
        dx, dw, db = lnfast.layer_norm_backward(x, x, mean, rstd)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        lnfast.set_num_threads(None)
    D = 1024
    scratch = peak - dx.nbytes - 2 * D * 4
    assert scratch <= 64 * 2 * D * 8 + 8 * 4 * D * 4 + 4096


def test_out_is_x_with_rows_sharing_memory(rng):
    b = rng.standard_normal(8)
    x = as_strided(b, (4, 8), (0, 8), writeable=True)   # four rows, one row of memory
    want = lnfast.layer_norm(b[None, :])[0]
    lnfast.layer_norm(x, out=x)
    assert np.array_equal(b, want)
    c = rng.standard_normal(12)
    y = as_strided(c, (5, 8), (8, 8), writeable=True)   # rows overlapping by 7 elements
    want = lnfast.layer_norm(y.copy())
    lnfast.layer_norm(y, out=y)
    assert np.array_equal(y[-1], want[-1])              # the last row written wins
    assert _kernels.self_overlaps(y) and not _kernels.self_overlaps(y.copy())


def test_scratch_is_bounded_by_the_work_not_the_thread_setting(rng):
    x = rng.standard_normal((1, 200_000))[:, ::2]       # one strided row
    lnfast.set_num_threads(64)
    tracemalloc.start()
    lnfast.layer_norm(x)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    row = 8 * 100_000
    # y, the stand-in weight and bias, 4 scratch rows for one thread: 7 rows,
    # not 64 threads x 4 rows.
    assert peak < 10 * row


def test_large_rows_without_weight_keep_no_stand_in_of_their_length():
    lnfast.empty_cache()
    x = np.ones((2, 65537))
    y, mean, rstd = lnfast.layer_norm_forward(x)        # pieces of 65536: kept
    assert _kernels.constants_kept() == 2
    lnfast.layer_norm_backward(x, x, mean, rstd)        # D long: not kept
    assert _kernels.constants_kept() == 2
    lnfast.empty_cache()
    lnfast.layer_norm(np.ones((2, 64)))
    assert _kernels.constants_kept() == 2                  # ones and zeros
    lnfast.empty_cache()
    assert _kernels.constants_kept() == 0


def test_at_most_64_stand_in_vectors_are_kept():
    for D in range(1, 100):
        lnfast.rms_norm(np.ones((1, D), np.float32))
        assert _kernels.constants_kept() <= 64
    ones = _kernels.constant(1.0, 8, np.dtype(np.float32).num)
    assert not ones.flags.writeable and np.array_equal(ones, np.ones(8, np.float32))


def test_float32_rows_near_the_overflow_threshold():
    x = np.array([[3e38, 3e38, -3e38], [1e-38, -1e-38, 3e-38]], np.float32)
    for eps in (1e-5, 0.0):
        y = lnfast.layer_norm(x, eps=0.0 if eps == 0 else 1e-80)
        assert np.isfinite(y).all()
        assert ref.rel_error(y, ref.layer_norm_forward(x, eps=0.0 if eps == 0 else 1e-80)[0]) <= 2e-6
    yr = lnfast.rms_norm(x[:1], eps=0.0)
    assert ref.rel_error(yr, ref.rms_norm_forward(x[:1], eps=0.0)[0]) <= 2e-6


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_float32_backward_rows_whose_terms_overflow(dtype):
    # x near float32's limit (x - mean overflows), then dy * weight past it:
    # such rows are redone in float64, and their true gradients fit.
    x = np.array([[3e38, 3e38, -3e38], [1, 2, 4]], np.float32)
    dy = np.array([[1, -2, .5], [1, -1, 2]], np.float32)
    w = np.array([1.0, 1e10, 3.0], np.float32)
    dy2 = np.array([[1e30, -2e30, 5e29], [1, -1, 2]], np.float32)
    x2 = np.array([[1e6, 2e6, -1e6], [1, 2, 4]], np.float32)
    for x, dy, w, dz in ((x, dy, None, None), (x2, dy2, w, None), (x2, dy2, w, x2)):
        x, dy = x.astype(dtype), dy.astype(dtype)
        _, mean, rstd = lnfast.layer_norm_forward(x, w)
        want = ref.layer_norm_backward(dy, x, mean, rstd, w)
        got = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
        if dz is not None:          # the fused backward adds dz after the map
            dz = dz.astype(dtype)
            got = lnfast.add_layer_norm_backward(dy, x, mean, rstd, w, dz=dz)
            want = (ref._f64(want[0]) + ref._f64(dz), *want[1:])
        u = 2.0**-24 if dtype is np.float32 else 2.0**-8
        for g, r in zip(got, want):
            assert np.isfinite(g.astype(np.float64)).all()
            assert ref.rel_error(g, r) <= 2 * u
        _, rstd_r = lnfast.rms_norm_forward(x, w)
        got = lnfast.rms_norm_backward(dy, x, rstd_r, w)
        want = ref.rms_norm_backward(dy, x, rstd_r, w)
        for g, r in zip(got, want):
            assert np.isfinite(g.astype(np.float64)).all() and ref.rel_error(g, r) <= 2 * u


def test_bfloat16_gradients_are_rounded_once():
    # Three rows of dy in three different float32 runs (cpu/config.h LNF_RUN_ROWS = 16
    # rows each), so their float64 sum is exact, just above a bfloat16 tie.
    bf16 = np.dtype(ml_dtypes.bfloat16)
    x = np.tile(np.array([0.0, 1.0], np.float32), (33, 1))
    dy = np.zeros((33, 2), np.float32)
    dy[0], dy[16], dy[32] = 1.0, 2.0**-8, 2.0**-30
    _, mean, rstd = lnfast.layer_norm_forward(x)
    w = np.ones(2, bf16)
    _, _, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w.astype(np.float32))
    exact = 1 + 2.0**-8 + 2.0**-30
    assert db[0] == np.float32(exact)
    _, _, db16 = lnfast.layer_norm_backward(dy.astype(bf16), x.astype(bf16), mean, rstd, w)
    assert db16.dtype == bf16 and float(db16[0]) == 1.0078125
    assert _cpu.round_sums(np.array([exact]), bf16)[0] == 1.0078125


@pytest.mark.parametrize("M,D", [(1, 5), (15, 5), (16, 5), (17, 5), (300, 5), (5000, 5),
                                 (40, 4096)])
def test_float32_gradient_sums_run_in_float32_then_float64(rng, M, D):
    # float32 dweight/dbias terms are summed in float32 over runs of 16 rows
    # counted from each chunk's first row; the runs are added in float64, in
    # row order within a chunk, then the chunks in order.  dbias's terms are
    # dy itself, so its float64 sum can be rebuilt bit for bit.
    x = rng.standard_normal((M, D)).astype(np.float32)
    dy = (rng.standard_normal((M, D)) * 10.0 ** rng.integers(-3, 4, (M, 1))).astype(np.float32)
    _, mean, rstd = lnfast.layer_norm_forward(x)
    nchunks = _kernels.num_chunks(M, D)
    sums = np.empty((2, D))
    _cpu.backward(dy, x, None, mean, rstd, np.ones(D, np.float32), np.empty_like(x),
                  sums, nchunks, True, 2)
    total = np.zeros(D)
    for c in range(nchunks):
        chunk, part = dy[c * M // nchunks:(c + 1) * M // nchunks], np.zeros(D)
        for r0 in range(0, len(chunk), 16):
            run = np.zeros(D, np.float32)
            for row in chunk[r0:r0 + 16]:
                run += row                      # float32 adds, in row order
            part += run
        total += part
    assert np.array_equal(sums[1], total)
    _, _, db = lnfast.layer_norm_backward(dy, x, mean, rstd, np.ones(D, np.float32))
    assert np.array_equal(db, total.astype(np.float32))     # rounded once


@pytest.mark.parametrize("M,D,chunks", [
    # at least 64 rows a chunk, at most 64 chunks and 16 MiB of partial rows
    (1, 5, 1), (64, 5, 1), (65, 5, 2), (128, 5, 2), (300, 5, 5), (5000, 5, 64),
    (1024, 65536, 16),
    # fewer rows: two chunks from 32 rows and 2**17 elements
    (32, 4096, 2), (64, 2048, 2), (31, 65536, 1), (32, 4095, 1), (64, 1024, 1)])
def test_backward_chunk_counts(M, D, chunks):
    assert _kernels.num_chunks(M, D) == chunks


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_chunks_without_rows_add_nothing(rng, dtype):
    # (only the internal entry point can ask for more chunks than rows)
    M, D = 3, 40
    x, dy = rng.standard_normal((2, M, D)).astype(dtype)
    _, mean, rstd = lnfast.layer_norm_forward(x)
    want = lnfast.layer_norm_backward(dy, x, mean, rstd)
    for nchunks in (M, M + 5):
        for n in range(700, 900):       # (freed memory that the partial rows may reuse)
            np.full(n, np.nan)
        dwdb = np.full((2, D), np.nan, dtype)
        _cpu.backward(dy, x, None, mean, rstd, np.ones(D, dtype), np.empty_like(x), dwdb,
                      nchunks, True, 2)
        np.testing.assert_allclose(dwdb, want[1:], rtol=1e-6, atol=1e-6)


def test_gradient_rows_in_place_or_aligned_give_the_same_bytes(rng):
    # One float64 chunk is summed in the returned array when that starts on
    # a 64-byte line, in aligned partial rows of its own otherwise.
    M, D = 40, 24
    x = rng.standard_normal((M, D))
    dy = rng.standard_normal((M, D))
    _, mean, rstd = lnfast.layer_norm_forward(x)
    _, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd)
    for off in (0, 16):
        buf = np.zeros(2 * D + 16)
        start = ((-buf.ctypes.data) % 64 + off) // 8
        dwdb = buf[start:start + 2 * D].reshape(2, D)
        assert dwdb.ctypes.data % 64 == off
        _cpu.backward(dy, x, None, mean, rstd, np.ones(D), np.empty_like(x), dwdb, 1, True, 1)
        assert np.array_equal(dwdb[0], dw) and np.array_equal(dwdb[1], db)


def test_unaligned_inputs(rng):
    buf = np.zeros(4 * 64 * 33 + 1, np.uint8)
    x = np.frombuffer(buf.data, np.float32, 64 * 32, offset=1).reshape(64, 32)
    w = np.frombuffer(buf.data, np.float32, 32, offset=1 + 4 * 64 * 32)
    assert not x.flags.aligned and not w.flags.aligned
    x[...] = rng.standard_normal(x.shape)
    w[...] = rng.standard_normal(32)
    y, mean, rstd = lnfast.layer_norm_forward(x, w)
    assert np.array_equal(y, lnfast.layer_norm(x.copy(), w.copy()))
    dx = lnfast.layer_norm_backward(x, x, mean, rstd, w)[0]
    assert np.array_equal(dx, lnfast.layer_norm_backward(x.copy(), x.copy(), mean, rstd,
                                                        w.copy())[0])


def test_bad_values_get_the_spec_exceptions():
    x = np.ones((2, 4))
    with pytest.raises(ValueError, match="eps"):
        lnfast.layer_norm(x, eps=10**400)
    with pytest.raises(TypeError, match=r"\bn\b"):
        lnfast.set_num_threads(True)
    with pytest.raises(ValueError, match=r"\bn\b"):
        lnfast.set_num_threads(2**40)
    with pytest.raises(TypeError, match="masked"):
        lnfast.layer_norm(np.ma.masked_array(x, mask=x > 0))
    with pytest.raises(TypeError, match="int16"):
        lnfast._cpu.convert(np.ones(4, np.int16), np.empty(4, np.float32))


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (ml_dtypes.bfloat16, 1.5 * 2.0**-8)])
def test_float32_rows_whose_squares_leave_float32(dtype, tol):
    # Deviations of 1e-21 square to 1e-42 (below float32's normal range) and
    # of 1e20 to 1e40 (past its top): such rows are redone in float64.
    # bfloat16 has float32's range, and its rows take the same float32 path.
    rng = np.random.default_rng(5)
    for scale in (1e-21, 1e20):
        x = (rng.standard_normal((3, 257)) * scale).astype(dtype)
        x[1] += dtype(100 * scale)          # a common offset 100 times the spread
        x64 = x.astype(np.float64)
        for eps in (0.0, 1e-5):
            y, mean, rstd = lnfast.layer_norm_forward(x, eps=eps)
            ry, rmean, rrstd = ref.layer_norm_forward(x64, eps=eps)
            assert np.isfinite(y.astype(np.float64)).all()
            assert ref.rel_error(y.astype(np.float64), ry) <= tol
            assert ref.rel_error(rstd, rrstd) <= 2e-6
        yr, rstd = lnfast.rms_norm_forward(x[::2], eps=0.0)
        assert ref.rel_error(yr.astype(np.float64), ref.rms_norm_forward(x64[::2], eps=0.0)[0]) <= tol


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-5), (ml_dtypes.bfloat16, 2 * 2.0**-8)])
def test_float32_backward_with_terms_past_float32(dtype, tol):
    # dy * w * (x - mean) reaches 1e40 here: the row sums are redone in float64.
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((4, 129)) * 1e20).astype(dtype)
    dy = (rng.standard_normal((4, 129)) * 1e20).astype(dtype)
    _, mean, rstd = lnfast.layer_norm_forward(x)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd)
    rdx, rdw, rdb = ref.layer_norm_backward(dy.astype(np.float64), x.astype(np.float64),
                                            mean, rstd)
    assert np.isfinite(dx.astype(np.float64)).all()
    assert ref.rel_error(dx.astype(np.float64), rdx) <= tol
    assert ref.rel_error(db, rdb) <= 2e-5


def test_zero_rows_among_others_are_exact():
    # Padding rows of zeros take the fast path (their sums are exactly zero).
    x = np.zeros((3, 100), np.float32)
    x[1] = np.linspace(-1, 1, 100)
    y, mean, rstd = lnfast.layer_norm_forward(x)
    assert (y[0] == 0).all() and (y[2] == 0).all() and mean[0] == 0
    assert rstd[0] == np.float32(1 / np.sqrt(1e-5))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("D", [1, 3, 7, 64, 100, 4097])
def test_pipelined_and_gathered_rows_agree_bitwise(rng, dtype, D):
    # Contiguous rows run software-pipelined (one row's map with the next
    # row's sums; 16-bit values converted inside the sweep); strided rows are
    # gathered into float scratch and run one pass at a time.  Both must
    # give the same bits, for every function.
    x, r, dy, dz = (rng.standard_normal((40, D)).astype(dtype) for _ in range(4))
    wdtype = np.float32 if np.dtype(dtype).itemsize == 2 else dtype
    w, b = rng.standard_normal(D).astype(wdtype), rng.standard_normal(D).astype(wdtype)

    def strided(a):
        s = np.empty((a.shape[0], 2 * D), dtype)
        s[:, ::2] = a
        return s[:, ::2]

    def run(f):
        return (
            lnfast.layer_norm_forward(f(x), w, b),
            lnfast.layer_norm_backward(f(dy), f(x), *lnfast.layer_norm_forward(x, w, b)[1:], w),
            lnfast.add_layer_norm_forward(f(x), f(r), w, b),
            lnfast.add_layer_norm_backward(f(dy), f(x), *lnfast.layer_norm_forward(x, w, b)[1:],
                                           w, dz=f(dz)),
            lnfast.rms_norm_forward(f(x), w),
            lnfast.rms_norm_backward(f(dy), f(x), lnfast.rms_norm_forward(x, w)[1], w),
        )

    for got, want in zip(run(strided), run(lambda a: a)):
        for g, e in zip(got, want):
            assert g.tobytes() == e.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_single_element_vectors_and_rows_of_any_stride(rng, dtype):
    # NumPy calls an axis of one element contiguous whatever its stride (a
    # slice, a broadcast, a reversed view): every function takes such a
    # weight, bias, x, dy or out as it takes a compact one, with the same bits.
    D = 1
    wdtype = np.float32 if np.dtype(dtype).itemsize == 2 else dtype
    x, r, dy, dz = (rng.standard_normal((7, 3, D)).astype(dtype) for _ in range(4))
    w, b = (rng.standard_normal(D).astype(wdtype) + 2 for _ in range(2))

    def odd(a):                 # the same values, the last axis 3 elements apart
        s = np.zeros(a.shape[:-1] + (3 * D,), a.dtype)
        s[..., ::3] = a
        return s[..., ::3]

    views = [lambda v: np.broadcast_to(v, (D,)), lambda v: np.repeat(v, 2)[::2],
             lambda v: v[::-1], odd]
    want = None
    for view in [lambda v: v] + views:
        wv, bv = view(w.copy()), view(b.copy())
        xv, dyv = (view(a) if view is odd else a for a in (x, dy))
        y, mean, rstd = lnfast.layer_norm_forward(xv, wv, bv)
        _, rr = lnfast.rms_norm_forward(xv, wv)
        got = (y, mean, rstd, *lnfast.layer_norm_backward(dyv, xv, mean, rstd, wv),
               *lnfast.add_layer_norm_forward(xv, r, wv, bv),
               *lnfast.add_layer_norm_backward(dyv, xv, mean, rstd, wv, dz=dz),
               lnfast.rms_norm(xv, wv), *lnfast.rms_norm_backward(dyv, xv, rr, wv))
        if view is not odd:
            out = odd(np.zeros_like(x))
            lnfast.layer_norm(x, wv, bv, out=out)
            same(out, got[0])
        want = want or got
        for g, e in zip(got, want):
            same(g, e)


@pytest.mark.parametrize("dtype, u", [(np.float32, 2.0**-24), (np.float64, 2.0**-53),
                                      (np.float16, 2.0**-24), (ml_dtypes.bfloat16, 2.0**-24)])
def test_a_first_value_far_from_the_mean_costs_no_accuracy(dtype, u):
    # Rows are summed about their first value; a row whose first value lies
    # far from its mean is summed again about the mean (LNF_RESHIFT, cpu/config.h).
    # 4095 ones after one -2**-12: float32 rstd was off by 1e-4 before.
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 4096))
    x[0], x[0, 0] = 1.0, -2.0**-12
    x[1, 0] = 1000.0
    x[2, 0] = 3.0                   # three deviations off (float64's second pass)
    x[3] = 1e4 + 1e-2 * x[3]
    x[3, 0] = 1e4 - 100
    x = x.astype(dtype)
    x[4:] = np.roll(x[:2], 1, axis=1)   # the same rows, far value second
    for eps in (0.0, 1e-5):
        y, mean, rstd = lnfast.layer_norm_forward(x, eps=eps)
        ry, rmean, rrstd = ref.layer_norm_forward(x, eps=eps)
        assert np.abs(rstd / rrstd - 1).max() <= 8 * u      # u of the arithmetic
        tol = 2.0**-11 if dtype == np.float16 else 2.0**-8 if dtype == ml_dtypes.bfloat16 else 8 * u
        assert ref.rel_error(y.astype(np.float64), ry) <= tol
    zy, z, zmean, zrstd = lnfast.add_layer_norm_forward(np.zeros_like(x), x, eps=eps)
    assert np.array_equal(zrstd, rstd) and np.array_equal(zy, y)


def test_float64_rows_with_a_large_offset_keep_their_digits():
    # x - hi - lo with lo the rounding error of the float64 mean (TwoSum):
    # at mean 1e7 and deviation 1e-3 y was off by 5e-7 before.
    rng = np.random.default_rng(12)
    x = 1e7 + 1e-3 * rng.standard_normal((8, 1024))
    y, mean, rstd = lnfast.layer_norm_forward(x)
    ry, rmean, rrstd = ref.layer_norm_forward(x)
    assert ref.rel_error(y, ry) <= 1e-14
    dx, dw, db = lnfast.layer_norm_backward(x - 1e7, x, mean, rstd)
    for got, want in zip((dx, dw, db), ref.layer_norm_backward(x - 1e7, x, rmean, rrstd)):
        assert ref.rel_error(got, want) <= 1e-13


@pytest.mark.parametrize("fn", [lnfast.layer_norm_forward, lnfast.rms_norm_forward])
def test_float64_rows_whose_squares_leave_float64(fn):
    # Deviations of 1e200 square past float64's top, of 1e-170 below its
    # floor: such rows are redone scaled by a power of two (row_exact).
    for scale in (1e200, 1e-170):
        x = np.array([[1.0, -1.0, 0.3, 0.25], [3.0, -3.0, 0.0, 1.0]]) * scale
        got = fn(x, eps=0.0)
        want = fn(x / scale, eps=0.0)           # without eps the same normalized row
        assert np.allclose(got[0], want[0], rtol=1e-15, atol=0)
        assert np.allclose(got[-1] * scale, want[-1], rtol=1e-15, atol=0)


def test_float64_rows_of_subnormal_spread_or_near_the_top():
    # A spread below 2**-1022 (the scale factor would pass 2**1024) and
    # values of opposite sign near float64's maximum (x - x[0] overflows).
    for x, fn, reference in (
            ([[0.0, 1e-310]], lnfast.layer_norm_forward, ref.layer_norm_forward),
            ([[1e-310, 0.0, 3e-310]], lnfast.rms_norm_forward, ref.rms_norm_forward),
            ([[-1e308, 1e308, 0.0, 5e307]], lnfast.layer_norm_forward, None),
            ([[-1e308, 1e308, 0.0, 5e307]], lnfast.rms_norm_forward, None)):
        x = np.array(x)
        scale = 2.0**1000 if abs(x).max() < 1 else 2.0**-1000
        y = fn(x, eps=0.0)[0]
        assert np.allclose(y, fn(x * scale, eps=0.0)[0], rtol=1e-14, atol=0)   # scaled
        if reference is not None:       # eps swamps the variance: y = (x - mean) / sqrt(eps)
            assert np.allclose(fn(x)[0], reference(x)[0], rtol=1e-12, atol=0)


def check_float64_backward_exactly(x, dy, eps, centered):
    """dx and dweight of float64 rows against mpmath (the SPEC's formulas on
    x and dy as given), by every route: pipelined rows, tiles (Fortran
    order), strided rows and one thread."""
    fwd, bwd = ((lnfast.layer_norm_forward, lnfast.layer_norm_backward) if centered else
                (lnfast.rms_norm_forward, lnfast.rms_norm_backward))
    stats = fwd(x, eps=eps)[1:]
    want = exact_backward(x, dy, eps, centered)
    routes = [bwd(dy, x, *stats), bwd(np.asfortranarray(dy), np.asfortranarray(x), *stats),
              bwd(dy[:, ::-1], x[:, ::-1], *stats)]
    lnfast.set_num_threads(1)
    try:
        routes.append(bwd(dy, x, *stats))
    finally:
        lnfast.set_num_threads(None)
    for k, got in enumerate(routes):
        dx, dw = got[0], got[1]
        if k == 2:
            dx, dw = dx[:, ::-1], dw[::-1]
        assert_backward_exact(dx, dw, want, k)


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_float64_backward_rows_near_the_top(rng, centered):
    # Values of opposite sign near float64's maximum, and dy * weight up to
    # 1e300: deviations from the mean, or their sums with dy, overflow
    # unless scaled.  dx (subnormal where rstd is about 1e-308) and dweight
    # against mpmath, by every route, with ordinary rows among them.
    x, dy = float64_rows_near_the_top(rng)
    check_float64_backward_exactly(x, dy, 1e-5, centered)


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
def test_float64_backward_rows_of_tiny_terms(rng, centered):
    # Normal x and dy whose products dy * (x - mean) underflow (a spread of
    # 1e-150 and dy of 1e-200, eps=0), subnormal dy, and deviations scaled
    # up by 2**1000 with dy large enough that the scaled terms overflowed:
    # dx and dweight are normal numbers all the same.
    x, dy = float64_rows_of_tiny_terms(rng)
    check_float64_backward_exactly(x, dy, 0.0, centered)


@pytest.mark.parametrize("x, dy, w, centered, eps", REDO_ROWS)
def test_float64_backward_redo_keeps_each_term(x, dy, w, centered, eps):
    # Rows redone in float64 whose dy * weight spans hundreds of orders of
    # magnitude: each dx against mpmath on its own, within rounding of its
    # own terms, so that small ones (where xhat is 0, say) count.
    x, dy = np.array([x]), np.array([dy])
    w = None if w is None else np.array(w)
    if centered:
        _, mean, rstd = lnfast.layer_norm_forward(x, w, eps=eps)
        dx = lnfast.layer_norm_backward(dy, x, mean, rstd, w)[0][0]
    else:
        _, rstd = lnfast.rms_norm_forward(x, w, eps=eps)
        dx = lnfast.rms_norm_backward(dy, x, rstd, w)[0][0]
    assert_dx_within_its_terms(dx, x[0], dy[0], w, eps, centered)


def test_rows_whose_squares_all_underflow_are_not_taken_for_constant():
    # Sums of exactly zero come from constant rows and from rows whose every
    # square underflowed; with an eps too small to swamp such a variance
    # the row is redone rather than normalized with rstd = eps**-0.5.
    x = np.array([[0.0, 1e-23, -1e-23]], np.float32)
    rstd = lnfast.layer_norm_forward(x, eps=1e-46)[2]
    want = 1 / np.sqrt(np.mean(x.astype(np.float64) ** 2) + 1e-46)
    assert abs(rstd[0] / want - 1) <= 1e-6
    x = np.array([[1e-23, -1e-23]], np.float32)
    rstd = lnfast.rms_norm_forward(x, eps=1e-47)[1]
    assert abs(rstd[0] / (1 / np.sqrt(1e-46 + 1e-47)) - 1) <= 1e-6


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("axis", [-1, 1], ids=["rows", "tiles"])
def test_an_infinity_or_nan_in_dy_makes_every_dx_of_its_row_nan(rng, dtype, axis):
    # api.md: NaN or infinity in a row makes that row's outputs NaN.  mean(g)
    # is then infinite, and g - mean(g) - xhat mean(g xhat) gave -inf, not
    # NaN, for some elements (which, by the sign of a rounding residual).
    dxs, bad = dx_of_rows_with_bad_dy(rng, dtype, axis)
    for dx in dxs:
        assert np.isnan(dx[bad]).all()
        assert np.isfinite(dx[~bad]).all()


@pytest.mark.parametrize("x, eps, w", TINY_SPREAD_ROWS)
def test_float64_rows_of_tiny_spread_against_a_large_eps(x, eps, w):
    # Deviations far below 1 scaled up by a power of two sc, whose eps sc^2
    # overflows: rstd / sc underflowed there, before the product with w,
    # and y lost its digits (zeros).
    assert_tiny_spread_row_exact(x, eps, w)


@pytest.mark.parametrize("x, dy, w, eps, dtype", UNDERFLOWED_PRODUCT_ROWS)
def test_rows_whose_products_all_underflow_are_not_taken_for_padding(x, dy, w, eps, dtype):
    # g = dy * w sums to exactly zero, as in a padding row (dy zero), but
    # dy and w are not zero: their products underflowed, and dx came out 0
    # where rstd makes the true one normal.  Redone; the padding rows stay 0.
    assert_underflowed_products_redone(x, dy, w, eps, dtype)
