"""SPEC "Axes": axis= on every function, checked against float64 references
computed over the same axes moved last (reference.py), the SPEC's shape and
bad-input rules, out= and views, and the tile kernels of channels-first
rows (thread counts, hard rows, short tiles)."""
import math
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _threads
from lnfast import reference as ref
from lnfast._checks import axes as norm_axes

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
FWD_TOL = {np.float32: 2e-6, np.float64: 1e-12, np.float16: 2e-3, ml_dtypes.bfloat16: 1.6e-2}
BWD_TOL = {np.float32: 2e-5, np.float64: 1e-10, np.float16: 1e-2, ml_dtypes.bfloat16: 6e-2}
# (shape, axis): channels-first, trailing pairs, non-neighbours, all axes
CASES = [((3, 24, 5, 7), 1), ((2, 40, 16), -2), ((4, 6, 5, 7), (2, 3)), ((4, 6, 5, 7), (1, 2)),
         ((4, 6, 5, 7), (1, 3)), ((4, 6, 5, 7), (0, 2)), ((5, 3, 33), (-1, 0)),
         ((2, 3, 4), (0, 1, 2)), ((7, 9), 0), ((2, 17, 40), 1)]


def moved(a, ax):
    """a with axes `ax` last and merged (a copy): the reference's rows."""
    others = [k for k in range(a.ndim) if k not in ax]
    t = np.moveaxis(a, ax, range(a.ndim - len(ax), a.ndim))
    return t.reshape([a.shape[k] for k in others] + [-1])


def back(rows, shape, ax):
    others = [k for k in range(len(shape)) if k not in ax]
    t = rows.reshape([shape[k] for k in others] + [shape[k] for k in ax])
    return np.moveaxis(t, range(len(shape) - len(ax), len(shape)), ax)


def err(out, expected):
    return ref.rel_error(np.asarray(out, np.float64), expected)


def data(rng, shape, dtype, ax):
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    norm = tuple(shape[k] for k in ax)
    w = (1 + 0.2 * rng.standard_normal(norm)).astype(dtype)
    b = (0.2 * rng.standard_normal(norm)).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", CASES)
def test_layer_norm_over_axes(rng, dtype, shape, axis):
    ax = norm_axes(axis, len(shape))
    x, w, b, dy = data(rng, shape, dtype, ax)
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=axis)
    ry, rmean, rrstd = ref.layer_norm_forward(moved(x, ax), w.reshape(-1), b.reshape(-1))
    lead = tuple(n for k, n in enumerate(shape) if k not in ax)
    assert y.shape == x.shape and y.dtype == x.dtype and y.flags.c_contiguous
    assert mean.shape == rstd.shape == lead
    assert err(y, back(ry, shape, ax)) < FWD_TOL[dtype]
    assert err(rstd, rrstd.reshape(lead)) < FWD_TOL[dtype]
    assert np.array_equal(lnfast.layer_norm(x, w, b, axis=axis), y)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis)
    rdx, rdw, rdb = ref.layer_norm_backward(moved(dy, ax), moved(x, ax), mean,
                                            rstd, w.reshape(-1))
    assert dx.shape == x.shape and dx.flags.c_contiguous
    assert dw.shape == db.shape == w.shape and dw.dtype == w.dtype
    assert err(dx, back(rdx, shape, ax)) < BWD_TOL[dtype]
    assert err(dw, rdw.reshape(w.shape)) < BWD_TOL[dtype]
    assert err(db, rdb.reshape(w.shape)) < BWD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", CASES[:6])
def test_rms_and_add_layer_norm_over_axes(rng, dtype, shape, axis):
    ax = norm_axes(axis, len(shape))
    x, w, b, dy = data(rng, shape, dtype, ax)
    y, rstd = lnfast.rms_norm_forward(x, w, axis=axis)
    ry, rrstd = ref.rms_norm_forward(moved(x, ax), w.reshape(-1))
    assert err(y, back(ry, shape, ax)) < FWD_TOL[dtype]
    assert np.array_equal(lnfast.rms_norm(x, w, axis=axis), y)
    dx, dw = lnfast.rms_norm_backward(dy, x, rstd, w, axis=axis)
    rdx, rdw = ref.rms_norm_backward(moved(dy, ax), moved(x, ax), rstd, w.reshape(-1))
    assert err(dx, back(rdx, shape, ax)) < BWD_TOL[dtype]
    assert dw.shape == w.shape and err(dw, rdw.reshape(w.shape)) < BWD_TOL[dtype]

    r = rng.standard_normal(shape).astype(dtype)
    y, z, mean, rstd = lnfast.add_layer_norm_forward(x, r, w, b, axis=axis)
    wide = x + r if dtype in (np.float32, np.float64) else x.astype(np.float32) + r.astype(np.float32)
    assert z.flags.c_contiguous and np.array_equal(z, wide.astype(dtype))
    assert np.array_equal(y, lnfast.layer_norm(z, w, b, axis=axis))
    dz = rng.standard_normal(shape).astype(dtype)
    ds, dw, db = lnfast.add_layer_norm_backward(dy, z, mean, rstd, w, dz=dz, axis=axis)
    dx, dw2, db2 = lnfast.layer_norm_backward(dy, z, mean, rstd, w, axis=axis)
    assert np.array_equal(dw, dw2) and np.array_equal(db, db2)
    assert err(ds, dx.astype(np.float64) + dz) < BWD_TOL[dtype]


@pytest.mark.parametrize("axis", [-1, 2, (2,), (-1,)])
def test_last_axis_spellings_give_the_same_bits(rng, axis):
    x, w, b, dy = data(rng, (4, 5, 33), np.float32, (2,))
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=axis)
    y0, mean0, rstd0 = lnfast.layer_norm_forward(x, w, b)
    assert np.array_equal(y, y0) and np.array_equal(rstd, rstd0)
    g = lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis)
    for a, e in zip(g, lnfast.layer_norm_backward(dy, x, mean0, rstd0, w)):
        assert np.array_equal(a, e)


def test_merged_trailing_axes_equal_a_reshape(rng):
    x, w, b, dy = data(rng, (8, 6, 64, 32), np.float32, (2, 3))
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=(-2, -1))
    y2, mean2, rstd2 = lnfast.layer_norm_forward(x.reshape(8, 6, -1), w.reshape(-1),
                                                 b.reshape(-1))
    assert np.array_equal(y, y2.reshape(x.shape)) and np.array_equal(rstd, rstd2)


@pytest.mark.parametrize("axis", [1, (1, 2), (1, 3)])
def test_out_and_in_place(rng, axis):
    ax = norm_axes(axis, 4)
    x, w, b, _ = data(rng, (3, 20, 6, 5), np.float32, ax)
    expected = lnfast.layer_norm(x, w, b, axis=axis)
    out = np.full_like(x, np.nan)
    assert lnfast.layer_norm(x, w, b, axis=axis, out=out) is out
    assert np.array_equal(out, expected)
    fortran = np.asfortranarray(np.full_like(x, np.nan))
    lnfast.layer_norm(x, w, b, axis=axis, out=fortran)
    assert np.array_equal(fortran, expected)
    x2 = x.copy()
    assert lnfast.layer_norm(x2, w, b, axis=axis, out=x2) is x2
    assert np.array_equal(x2, expected)
    x3 = x.copy()
    lnfast.rms_norm(x3, w, axis=axis, out=x3)
    assert np.array_equal(x3, lnfast.rms_norm(x, w, axis=axis))


def test_strided_and_read_only_inputs(rng):
    base = rng.standard_normal((6, 40, 9, 14)).astype(np.float32)
    x = base[::2, :, :, ::2]                    # a strided view
    w = np.linspace(0.5, 1.5, 40, dtype=np.float32)
    contiguous = np.ascontiguousarray(x)
    y = lnfast.layer_norm(x, w, axis=1)     # (rows gathered: other bits than by tiles)
    assert err(y, lnfast.layer_norm(contiguous.astype(np.float64), w, axis=1)) < 2e-6
    ro = contiguous.copy()
    ro.flags.writeable = False
    y2, mean, rstd = lnfast.layer_norm_forward(ro, w, axis=1)
    assert np.array_equal(y2, lnfast.layer_norm(contiguous, w, axis=1))
    g = lnfast.layer_norm_backward(ro, ro, mean, rstd, w, axis=1)
    h = lnfast.layer_norm_backward(contiguous, contiguous, mean, rstd, w, axis=1)
    for a, e in zip(g, h):
        assert np.array_equal(a, e)
    t = np.transpose(contiguous, (0, 2, 3, 1)).copy().transpose(0, 3, 1, 2)   # channels-last
    assert err(lnfast.layer_norm(t, w, axis=1), y.astype(np.float64)) < 2e-6


def at_offset(a, offset):
    """A copy of `a`, strides and all, starting `offset` bytes into a
    64-byte line (1: not aligned to its elements)."""
    lo = sum(st * (n - 1) for st, n in zip(a.strides, a.shape) if st < 0)
    hi = sum(st * (n - 1) for st, n in zip(a.strides, a.shape) if st > 0)
    buf = np.zeros(hi - lo + a.itemsize + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    b = np.ndarray(a.shape, a.dtype, buf, start - lo, a.strides)
    b[...] = a
    return b


def unaligned(a):
    """at_offset(a, 1), checked."""
    u = at_offset(a, 1)
    assert not u.flags.aligned and u.strides == a.strides
    return u


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
@pytest.mark.parametrize("layout", ["C", "channels-last", "reversed", "sparse"])
def test_unaligned_inputs_give_the_bits_of_aligned_ones(rng, dtype, layout):
    """The layout chooses the kernel (tiles for channels first): an
    unaligned input, as a Dask worker may get from the network, gives the
    bits of an aligned one of the same strides, any argument of it."""
    x, w, b, dy = data(rng, (3, 40, 6, 7), dtype, (1,))
    r = rng.standard_normal(x.shape).astype(dtype)
    if layout == "channels-last":
        x, dy, r = (np.transpose(a, (0, 2, 3, 1)).copy().transpose(0, 3, 1, 2) for a in (x, dy, r))
    elif layout == "reversed":
        x, dy, r = x[:, ::-1, ::-1], dy[:, ::-1, ::-1], r[:, ::-1, ::-1]
    elif layout == "sparse":                      # compacted when copied, in its own order
        x, dy, r = (np.repeat(a, 3, axis=3)[..., ::3] for a in (x, dy, r))

    def run(x, dy, r):
        y, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=1)
        return ((y, mean, rstd) + lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=1)
                + lnfast.add_layer_norm_forward(x, r, w, b, axis=1)
                + lnfast.rms_norm_forward(x, w, axis=1)
                + lnfast.rms_norm_backward(dy, x, rstd, w, axis=1))

    expected = run(x, dy, r)
    for args in [(unaligned(x), dy, r), (x, unaligned(dy), r), (x, dy, unaligned(r)),
                 (unaligned(x), unaligned(dy), unaligned(r))]:
        got = run(*args)
        for a, e in zip(got, expected):
            if layout == "sparse":
                assert err(a, e.astype(np.float64)) < BWD_TOL[dtype]
            else:
                assert np.array_equal(a, e)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_tile_columns_anywhere_on_their_lines(rng, dtype):
    """The backward's tiles read x and dy with a carry where their columns
    all sit alike on their lines (tileops.h, tv_load_carry): the same bits
    wherever on its line each starts, for any thread count (threads' rows
    end where the carry must stop), runs of 6 tiles of 16 rows."""
    x, w, _, dy = data(rng, (5, 40, 8, 12), dtype, (1,))
    dz = rng.standard_normal(x.shape).astype(dtype)
    mean = rng.standard_normal((5, 8, 12)).astype(dtype)
    rstd = (1 + rng.random((5, 8, 12))).astype(dtype)

    def run(x, dy):
        return (lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=1)
                + lnfast.add_layer_norm_backward(dy, x, mean, rstd, w, axis=1, dz=dz)
                + lnfast.rms_norm_backward(dy, x, rstd, w, axis=1))

    expected = run(at_offset(x, 0), at_offset(dy, 0))
    rdx, rdw, rdb = ref.layer_norm_backward(moved(dy, (1,)), moved(x, (1,)), mean, rstd, w)
    assert err(expected[0], back(rdx, x.shape, (1,))) < BWD_TOL[dtype]
    assert err(expected[1], rdw) < BWD_TOL[dtype] and err(expected[2], rdb) < BWD_TOL[dtype]
    for threads in (1, 2, 3, 5):
        lnfast.set_num_threads(threads)
        for ox, ody in [(0, 0), (16, 16), (4, 60), (60, 32), (8, 0)]:
            got = run(at_offset(x, ox), at_offset(dy, ody))
            for a, e in zip(got, expected):
                assert np.array_equal(a, e)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16])
def test_tiles_are_the_same_for_any_thread_count(rng, dtype):
    """Channels-first rows run by tiles; runs of 7x7 = 49 rows end in short
    tiles; a few hard rows (constant, offset, subnormal) are redone."""
    x = rng.standard_normal((6, 72, 7, 7)).astype(dtype)
    x[1, :, 2, 3] = 5.0
    x[2, :, 4, 4] += 3000
    if dtype != ml_dtypes.bfloat16:
        x[3, :, 0, 1] = np.float64(1e-42 if dtype == np.float32 else 1e-310)
    dy = rng.standard_normal(x.shape).astype(dtype)
    w = rng.standard_normal(72).astype(dtype)
    results = []
    for n in (1, 2, 3):
        lnfast.set_num_threads(n)
        y, mean, rstd = lnfast.layer_norm_forward(x, w, w, axis=1)
        results.append((y, mean, rstd) + lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=1)
                       + lnfast.rms_norm_backward(dy, x, rstd, w, axis=1))
    for other in results[1:]:
        for a, e in zip(results[0], other):
            assert np.array_equal(a, e, equal_nan=True)
    y, mean, rstd = results[0][:3]
    ry, _, rrstd = ref.layer_norm_forward(moved(x, (1,)), w, w)
    assert err(y, back(ry, x.shape, (1,))) < FWD_TOL[dtype]
    rdx, rdw, _ = ref.layer_norm_backward(moved(dy, (1,)), moved(x, (1,)), mean,
                                          rstd, w)
    assert err(results[0][3], back(rdx, x.shape, (1,))) < BWD_TOL[dtype]
    assert err(results[0][4], rdw) < BWD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hw", [(7, 7), (6, 6), (2, 3), (1, 3), (5, 5)])
@pytest.mark.parametrize("layout", ["C", "out channels-last", "out=x"])
def test_forward_ends_of_runs_taken_together_give_each_images_bits(rng, dtype, hw, layout):
    """The forward takes the short ends of several images' runs (7x7: 1 row
    of 49 past three full tiles; 6x6: 4; 2x3: all 6; 1x3 rows one apart)
    together in one tile, each row's arithmetic its own: every image
    normalized in the batch gives the bits of that image alone, with a
    residual too, for any thread count and any output layout, hard rows
    (an offset, a constant row) included in the ends.  5x5 (9 rows past a
    tile) takes its ends one at a time."""
    N, C = 19, 24
    x = (rng.standard_normal((N, C) + hw) + 0.5).astype(dtype)
    r = rng.standard_normal(x.shape).astype(dtype)
    x[2, :, -1, -1] += 3000 if dtype != np.float16 else 300     # in an end
    x[5, :, -1, -1] = 2.0
    w = (1 + 0.2 * rng.standard_normal(C)).astype(dtype)
    b = (0.2 * rng.standard_normal(C)).astype(dtype)

    def alone(n):
        return (lnfast.layer_norm_forward(x[n:n + 1], w, b, axis=1)
                + lnfast.add_layer_norm_forward(x[n:n + 1], r[n:n + 1], w, b, axis=1)
                + lnfast.rms_norm_forward(x[n:n + 1], w, axis=1))

    want = [alone(n) for n in range(N)]
    for threads in (1, 2, 3):
        lnfast.set_num_threads(threads)
        xx = x.copy()
        if layout == "C":
            got = (lnfast.layer_norm_forward(xx, w, b, axis=1)
                   + lnfast.add_layer_norm_forward(xx, r, w, b, axis=1)
                   + lnfast.rms_norm_forward(xx, w, axis=1))
        else:
            if layout == "out=x":
                out = xx
            else:
                out = np.empty((N,) + hw + (C,), dtype).transpose(0, 3, 1, 2)
            y = lnfast.layer_norm(xx, w, b, axis=1, out=out)
            assert y is out
            got = (y,)
        for n in range(N):
            for a, e in zip(got, want[n]):
                assert np.array_equal(a[n:n + 1], e, equal_nan=True), (threads, n)
    ry, _, _ = ref.layer_norm_forward(moved(x, (1,)), w, b)
    assert err(want[0][0], back(ry, x.shape, (1,))[:1]) < FWD_TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_tile_forward_redoes_the_rows_it_cannot_take(rng, dtype):
    """Rows the channels-first forward's tiles turn down are redone in
    float64, one at a time, as the last-axis rows are: rows whose squares
    underflow (float32 and bfloat16 values near 1e-30, float64 subnormals),
    which with eps = 0 would otherwise divide by a variance of 0. Runs of
    35 rows hold two full tiles and a short one; such rows sit in each, and
    in the first tile alone of the second run (where two tiles go at once,
    the second's tests must not hide the first's).
    Their y, mean and rstd are what the row kernels give for the same rows,
    bit for bit, and finite (but float64's rstd, past float64's range); the
    other rows are within the tolerance of the float64 reference."""
    x = (rng.standard_normal((2, 40, 5, 7)) * 2 + 0.5).astype(dtype)
    # rows 3 (tile 0), 23 (tile 1), 69 (short); 42 (tile 0 of the second run)
    hard = [(0, 0, 3), (0, 3, 2), (1, 4, 6), (1, 1, 0)]
    for n, h, w_ in hard:
        x[n, :, h, w_] = (rng.standard_normal(40) * (1e-310 if dtype == np.float64 else 1e-30)
                          ).astype(dtype)
    w = (1 + 0.2 * rng.standard_normal(40)).astype(dtype)
    b = (0.2 * rng.standard_normal(40)).astype(dtype)
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b, eps=0.0, axis=1)
    ry, rmean, rrstd = lnfast.layer_norm_forward(np.ascontiguousarray(moved(x, (1,))), w, b,
                                                 eps=0.0)
    for n, h, w_ in hard:
        assert np.array_equal(y[n, :, h, w_], ry[n, h, w_]), (n, h, w_)
        assert np.array_equal(mean[n, h, w_], rmean[n, h, w_]), (n, h, w_)
        assert np.array_equal(rstd[n, h, w_], rrstd[n, h, w_]), (n, h, w_)
    for a in (y, mean) if dtype == np.float64 else (y, mean, rstd):    # (1 / 1e-310: inf)
        assert np.isfinite(a.astype(np.float64)).all()
    easy = np.ones(x.shape, bool)       # (the reference's float64 squares underflow too)
    for n, h, w_ in hard:
        easy[n, :, h, w_] = False
    with np.errstate(divide="ignore", invalid="ignore"):
        want = back(ref.layer_norm_forward(moved(x, (1,)), w, b, eps=0.0)[0], x.shape, (1,))
    assert err(y[easy], want[easy]) < FWD_TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float64])
def test_tile_backward_redoes_the_rows_it_cannot_take(rng, dtype):
    """Rows the channels-first backward's tiles turn down are redone in
    float64, one at a time, as the last-axis rows are: float32 (and 16-bit)
    rows whose terms dy * w * (x - mean) pass float32's range, float64 rows
    whose terms are subnormal on average. Runs of 35 rows hold two full
    tiles and a short one; such rows sit in each. Their dx is what the row
    kernels give for the same rows, bit for bit (the float64 row is the
    same computation), and finite where the reference is."""
    x = (rng.standard_normal((2, 40, 5, 7)) * 2 + 0.5).astype(dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    w = (1 + 0.2 * rng.standard_normal(40)).astype(dtype)
    hard = [(0, 0, 3), (0, 3, 2), (1, 4, 6)]       # rows 3 (tile 0), 23 (tile 1), 69 (short)
    for n, h, w_ in hard:
        if dtype == np.float64:
            x[n, :, h, w_] = rng.standard_normal(40) * 1e-310
        else:
            x[n, :, h, w_] = (rng.standard_normal(40) * 1e20).astype(dtype)
            dy[n, :, h, w_] = (rng.standard_normal(40) * 1e20).astype(dtype)
    _, mean, rstd = lnfast.layer_norm_forward(x, w, axis=1)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=1)
    rows = lnfast.layer_norm_backward(np.ascontiguousarray(moved(dy, (1,))),
                                      np.ascontiguousarray(moved(x, (1,))), mean, rstd, w)[0]
    rdx = ref.layer_norm_backward(moved(dy, (1,)), moved(x, (1,)), mean, rstd, w)[0]
    for n, h, w_ in hard:
        assert np.array_equal(dx[n, :, h, w_], rows[n, h, w_]), (n, h, w_)
    assert np.isfinite(dx.astype(np.float64)).all()
    assert err(dx, back(rdx, x.shape, (1,))) < BWD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_tiles_two_at_once_or_one_by_one(rng, dtype):
    """The forward takes two full tiles of a run at once where it can
    (forward_tiles; AVX-512 float32 and 16-bit). Runs of 63 rows (three
    full tiles and a short one) split between threads pair other tiles
    ((0, 1) on one thread, (1, 2) where a thread starts at tile 1: 20160
    elements, enough for several threads), and an output in another layout
    has every tile copied and taken alone: the same bits every way. Hard
    rows (constant, offset, summed again about their mean) sit in the
    first and second tiles of pairs."""
    x = (rng.standard_normal((8, 40, 7, 9)) * 2 + 0.5).astype(dtype)
    # rows redone in float64: squares that underflow (float32, float64) or
    # overflow (bfloat16; float16 has no such rows)
    scale = {np.float32: 1e-40, np.float64: 1e-300, ml_dtypes.bfloat16: 1e37}.get(dtype)
    for n, h, w_ in [(0, 0, 3), (0, 2, 0), (1, 3, 1)]:     # rows 3 (tile 0), 18, 28 (tile 1)
        if scale is not None:
            x[n, :, h, w_] = (rng.standard_normal(40) * scale).astype(dtype)
    x[1, :, 0, 4] = 5.0                     # row 4: constant
    x[2, :, 2, 1] += 3000                   # row 19: offset
    x[2, :8, 2, 2] += 40                    # row 20: its shift far from its mean
    x[3, 8:, 0, 5] -= 40                    # row 5
    w = (1 + 0.2 * rng.standard_normal(40)).astype(dtype)
    b = (0.2 * rng.standard_normal(40)).astype(dtype)
    res = rng.standard_normal(x.shape).astype(dtype)

    def run():
        return (lnfast.layer_norm_forward(x, w, b, axis=1)
                + lnfast.rms_norm_forward(x, w, axis=1)
                + lnfast.add_layer_norm_forward(x, res, w, b, axis=1))

    want = run()
    alone = np.asfortranarray(np.empty_like(x))
    assert np.array_equal(lnfast.layer_norm(x, w, b, axis=1, out=alone), want[0])
    assert np.array_equal(lnfast.rms_norm(x, w, axis=1, out=alone), want[3])
    for threads in (2, 3, 4, 5):
        lnfast.set_num_threads(threads)
        assert _threads.threads_for(x.size) == threads
        for a, e in zip(run(), want):
            assert np.array_equal(a, e)
    ry, rmean, rrstd = ref.layer_norm_forward(moved(x, (1,)), w, b)
    assert err(want[0], back(ry, x.shape, (1,))) < FWD_TOL[dtype]
    assert err(want[1], rmean.reshape(want[1].shape)) < FWD_TOL[dtype]
    assert err(want[2], rrstd.reshape(want[2].shape)) < FWD_TOL[dtype]
    z = (x.astype(np.float64) + res).astype(dtype)
    assert np.array_equal(want[6], z)
    ryz = ref.layer_norm_forward(moved(z, (1,)), w, b)[0]
    assert err(want[5], back(ryz, x.shape, (1,))) < FWD_TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_streamed_tiles(rng, dtype):
    """Outputs of 8 MiB or more whose tile columns start on cache lines (as
    lnfast allocates them) are written with streaming stores: the same bits
    as ordinary stores (into a NumPy array, 16 bytes past a line), with hard
    rows stored after."""
    x = rng.standard_normal((2, 256 // np.dtype(dtype).itemsize, 128, 128)).astype(dtype)
    x[0, :, 5, 9] += 3000
    x[1, :, 100, 17] = 2.0
    dy = rng.standard_normal(x.shape).astype(dtype)
    w = rng.standard_normal(x.shape[1]).astype(dtype)
    buf = np.empty(x.size + 64 // x.itemsize, dtype)
    start = (-buf.ctypes.data % 64 + 16) // x.itemsize
    out = buf[start:start + x.size].reshape(x.shape)
    assert x.nbytes >= 1 << 23 and out.ctypes.data % 64 == 16
    y, mean, rstd = lnfast.layer_norm_forward(x, w, w, axis=1)
    assert np.array_equal(lnfast.layer_norm(x, w, w, axis=1, out=out), y)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=1)
    half = lnfast.layer_norm_backward(dy[:1], x[:1], mean[:1], rstd[:1], w, axis=1)[0]
    assert np.array_equal(dx[:1], half)
    ry, _, _ = ref.layer_norm_forward(moved(x, (1,)), w, w)
    assert err(y, back(ry, x.shape, (1,))) < FWD_TOL[dtype]
    rdx, rdw, rdb = ref.layer_norm_backward(moved(dy, (1,)), moved(x, (1,)), mean, rstd, w)
    assert err(dx, back(rdx, x.shape, (1,))) < BWD_TOL[dtype]
    assert err(dw, rdw) < BWD_TOL[dtype] and err(db, rdb) < BWD_TOL[dtype]


@pytest.mark.parametrize("threads", [1, 2, 3, 5, 7])
def test_streamed_tiles_split_between_threads(threads):
    """A run of 48 rows (6x8) split between threads mid-run (at rows 24,
    16, 9, 20 of a run: 16 bytes past any 32-byte line, too): every full
    tile still starts on a cache line (streamed), the bits of one thread."""
    x = np.random.default_rng(5).standard_normal((3, 16384, 6, 8)).astype(np.float32)
    assert x.nbytes >= 1 << 23
    want = lnfast.layer_norm_forward(x, axis=1)
    dy = np.ones_like(x)
    want_back = lnfast.layer_norm_backward(dy, x, want[1], want[2], axis=1)
    lnfast.set_num_threads(threads)
    got = lnfast.layer_norm_forward(x, axis=1)
    back_got = lnfast.layer_norm_backward(dy, x, got[1], got[2], axis=1)
    for a, b in zip(got + back_got, want + want_back):
        assert np.array_equal(a, b)
    ry = ref.layer_norm_forward(moved(x, (1,)))[0]
    assert err(got[0], back(ry, x.shape, (1,))) < FWD_TOL[np.float32]


def test_nan_stays_in_its_row():
    x = np.ones((2, 16, 3, 5), np.float32)
    x[:, 0] = np.arange(2 * 15, dtype=np.float32).reshape(2, 3, 5)
    x[1, 4, 2, 2] = np.nan
    y = lnfast.layer_norm(x, axis=1)
    assert np.isnan(y[1, :, 2, 2]).all()
    y[1, :, 2, 2] = 0
    assert np.isfinite(y).all()


@pytest.mark.parametrize("axis", [1.0, "1", [1], None, (1, 2.0), np.array([1]), True])
def test_axis_of_the_wrong_kind_is_a_type_error(axis):
    x = np.ones((2, 3, 4), np.float32)
    with pytest.raises(TypeError, match="axis"):
        lnfast.layer_norm(x, axis=axis)


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "layer_norm_forward"])
@pytest.mark.parametrize("axis", [3, -4, (0, 3), (1, 1), (1, -2), ()])
def test_bad_axis_is_a_value_error(fn, axis):
    x = np.ones((2, 3, 4), np.float32)
    before = x.copy()
    with pytest.raises(ValueError, match="axis"):
        getattr(lnfast, fn)(x, axis=axis)
    assert np.array_equal(x, before)


def test_numpy_integer_axes_and_axis_error():
    x = np.ones((2, 3, 4), np.float32)
    assert lnfast.layer_norm(x, axis=np.int64(1)).shape == x.shape
    assert lnfast.layer_norm(x, axis=(np.int32(0), 2)).shape == x.shape
    with pytest.raises(np.exceptions.AxisError):
        lnfast.layer_norm(x, axis=5)


def test_weights_and_stats_of_the_wrong_shape(rng):
    x = rng.standard_normal((2, 6, 4, 5)).astype(np.float32)
    with pytest.raises(ValueError, match="weight"):
        lnfast.layer_norm(x, np.ones(5, np.float32), axis=1)
    with pytest.raises(ValueError, match="bias"):
        lnfast.layer_norm(x, None, np.ones((4, 6), np.float32), axis=(1, 2))
    with pytest.raises(ValueError, match="weight"):
        lnfast.rms_norm(x, np.ones(24, np.float32), axis=(1, 2))
    y, mean, rstd = lnfast.layer_norm_forward(x, axis=1)
    dx = np.zeros_like(x)
    with pytest.raises(ValueError, match="mean"):
        lnfast.layer_norm_backward(dx, x, mean[:, :, :1], rstd, axis=1)
    with pytest.raises(ValueError, match="rstd"):
        lnfast.layer_norm_backward(dx, x, mean, rstd[..., :1], axis=1)
    with pytest.raises(ValueError, match="out"):
        lnfast.layer_norm(x, axis=1, out=np.empty((2, 4, 5, 6), np.float32))
    with pytest.raises(ValueError, match="D >= 1"):
        lnfast.layer_norm(np.ones((3, 0, 2), np.float32), axis=1)


def test_empty_rows_over_axes():
    x = np.ones((0, 6, 3), np.float32)
    y, mean, rstd = lnfast.layer_norm_forward(x, axis=1)
    assert y.shape == x.shape and mean.shape == (0, 3)
    dx, dw, db = lnfast.layer_norm_backward(x, x, mean, rstd, axis=1)
    assert dw.shape == (6,) and not dw.any() and not db.any()


# --- axes that do not merge: gathered a block of rows at a time -----------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,axis", [((6, 5, 7, 9), (1, 3)), ((4, 3, 5, 2, 6), (0, 2, 4)),
                                        ((5, 7, 3), (0, 2)), ((6, 4), (1, 0))])
def test_unmerged_axes_by_blocks(rng, monkeypatch, dtype, shape, axis):
    # many small blocks give the rows' bits of one block, gradients that
    # match the reference, and the same bits on any thread count
    from lnfast import _axes
    ax = norm_axes(axis, len(shape))
    x, _, _, dy = data(rng, shape, dtype, ax)
    wdt = np.float64 if dtype == np.float64 else np.float32
    norm = tuple(shape[k] for k in ax)
    w, b = rng.standard_normal(norm).astype(wdt), rng.standard_normal(norm).astype(wdt)
    r = (rng.standard_normal(shape) * 2).astype(dtype)

    def run():
        y, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=axis)
        grads = lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis)
        fused = lnfast.add_layer_norm_forward(x, r, w, b, axis=axis)
        rms = lnfast.rms_norm_forward(x, w, axis=axis)
        return (y, mean, rstd, *grads, *fused, *rms,
                *lnfast.rms_norm_backward(dy, x, rms[1], w, axis=axis))

    whole = run()
    monkeypatch.setattr(_axes, "GATHER_BYTES", 3 * x.dtype.itemsize * math.prod(norm))
    blocks = run()
    for k in (0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 12):       # rows: the same bits
        np.testing.assert_array_equal(blocks[k], whole[k])
    for k in (4, 5, 13):                                 # dweight, dbias: summed by blocks
        assert blocks[k].dtype == whole[k].dtype and blocks[k].shape == norm
        np.testing.assert_allclose(np.asarray(blocks[k], np.float64),
                                   np.asarray(whole[k], np.float64), rtol=BWD_TOL[dtype],
                                   atol=BWD_TOL[dtype])
    _, m64, r64 = ref.layer_norm_forward(moved(x, ax))
    want = ref.layer_norm_backward(moved(dy, ax), moved(x, ax), m64, r64, w.reshape(-1))
    assert err(blocks[4].reshape(-1), want[1]) <= BWD_TOL[dtype]
    assert err(blocks[5].reshape(-1), want[2]) <= BWD_TOL[dtype]
    for threads in (1, 3):
        lnfast.set_num_threads(threads)
        try:
            again = run()
        finally:
            lnfast.set_num_threads(None)
        for got, first in zip(again, blocks):
            np.testing.assert_array_equal(got, first)


@pytest.mark.parametrize("shift", [1, 4096, -4096])
def test_unmerged_axes_with_an_out_overlapping_x(monkeypatch, shift):
    # blocks written into out must not reach x's later blocks before they
    # are read: the answer is that of the non-overlapping call
    from lnfast import _axes
    monkeypatch.setattr(_axes, "GATHER_BYTES", 4096)
    shape = (8, 6, 64, 8)
    n = math.prod(shape)
    buf = np.random.default_rng(1).standard_normal(n + abs(shift)).astype(np.float32)
    x = buf[max(shift, 0):][:n].reshape(shape)
    out = buf[max(-shift, 0):][:n].reshape(shape)
    w = np.linspace(0.5, 1.5, 6 * 8, dtype=np.float32).reshape(6, 8)
    want = lnfast.layer_norm(x.copy(), w, axis=(1, 3))
    np.testing.assert_array_equal(lnfast.layer_norm(x, w, axis=(1, 3), out=out), want)
    x = want.copy()                                     # out=x itself, and a weight inside out
    want = lnfast.rms_norm(x.copy(), x[0, :, 0], axis=(1, 3))
    np.testing.assert_array_equal(lnfast.rms_norm(x, x[0, :, 0], axis=(1, 3), out=x), want)


def test_unmerged_axes_make_no_copy_of_x():
    # SPEC "Axes": no transposed copy of x.  Peak traced memory: the
    # forward's y and the backward's dx, and the blocks (a copy of x, of
    # dy or of the results' rows would each add 64 MiB)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 16, 128, 128), dtype=np.float32)
    dy = rng.standard_normal(x.shape, dtype=np.float32)
    tracemalloc.start()
    try:
        y, mean, rstd = lnfast.layer_norm_forward(x, axis=(1, 3))
        fwd = tracemalloc.get_traced_memory()[1] - y.nbytes
        del y
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, axis=(1, 3))
        bwd = tracemalloc.get_traced_memory()[1] - before - dx.nbytes
    finally:
        tracemalloc.stop()
    assert fwd <= 40 << 20 and bwd <= 40 << 20, (fwd >> 20, bwd >> 20)


def test_against_torch_float64_autograd(rng):
    torch = pytest.importorskip("torch")
    for shape, axis in [((3, 12, 5, 4), 1), ((2, 3, 6, 5), (2, 3)), ((4, 5, 6), (0, 2))]:
        ax = norm_axes(axis, len(shape))
        x, w, b, dy = data(rng, shape, np.float64, ax)
        y, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=axis)
        dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis)
        perm = [k for k in range(len(shape)) if k not in ax] + list(ax)
        tx = torch.tensor(x).permute(perm).contiguous().requires_grad_(True)
        tw, tb = torch.tensor(w).requires_grad_(True), torch.tensor(b).requires_grad_(True)
        ty = torch.nn.functional.layer_norm(tx, w.shape, tw, tb, 1e-5)
        ty.backward(torch.tensor(dy).permute(perm))
        inv = np.argsort(perm)
        assert err(y, ty.detach().permute(*inv).numpy()) < 1e-12
        assert err(dx, tx.grad.permute(*inv).numpy()) < 1e-10
        assert err(dw, tw.grad.numpy()) < 1e-10 and err(db, tb.grad.numpy()) < 1e-10


def _onnx_cases():
    try:
        from onnx.backend.test.case.node import collect_testcases
    except ImportError:
        return []
    with np.errstate(all="ignore"):     # (other operators' cases are built too)
        cases = collect_testcases(None)
    return [c for c in cases
            if c.name.startswith(("test_layer_normalization", "test_rms_normalization"))
            and "expanded" not in c.name]


@pytest.mark.parametrize("case", _onnx_cases() or [None], ids=lambda c: getattr(c, "name", "none"))
def test_onnx_operator_cases(case):
    """ONNX's own LayerNormalization and RMSNormalization cases, through
    axis=tuple(range(k, x.ndim)) with no reshaping."""
    if case is None:
        pytest.skip("onnx is not installed")
    node = case.model.graph.node[0]
    attrs = {a.name: a for a in node.attribute}
    inputs, outputs = case.data_sets[0]
    x = inputs[0]
    k = attrs["axis"].i if "axis" in attrs else -1
    eps = attrs["epsilon"].f if "epsilon" in attrs else 1e-5
    axis = tuple(range(k % x.ndim, x.ndim))
    tol = 1e-5 if x.dtype == np.float32 else 1e-3
    if node.op_type == "LayerNormalization":
        w, b = inputs[1], inputs[2] if len(inputs) > 2 else None
        y, mean, rstd = lnfast.layer_norm_forward(x, w, b, eps=eps, axis=axis)
        np.testing.assert_allclose(y, outputs[0], rtol=tol, atol=tol)
        if len(outputs) > 1:
            np.testing.assert_allclose(mean.reshape(outputs[1].shape), outputs[1], rtol=tol,
                                       atol=tol)
            np.testing.assert_allclose(rstd.reshape(outputs[2].shape), outputs[2], rtol=tol)
    else:
        y = lnfast.rms_norm(x, inputs[1], eps=eps, axis=axis)
        np.testing.assert_allclose(y, outputs[0], rtol=tol, atol=tol)
