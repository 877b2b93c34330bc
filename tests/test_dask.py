"""Dask arrays (SPEC "Frameworks and engines"): every function against the
NumPy call on the whole array, lazily; the chunking rule; dweight/dbias
bitwise identical on every scheduler and on dask.distributed with 1 and 2
worker processes; task names that tell calls apart."""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _threads, reference
from tests.helpers import data, same

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def grad_error(got, ref):
    return np.abs(np.asarray(got, np.float64) - ref).max()


def check_grads(got, numpy_call, ref):
    """dweight/dbias from Dask: float64 sums of the blocks' float64 sums,
    rounded once; at least as accurate as the NumPy call's, with one unit
    in the last place of the result's dtype of slack (float64: the float64
    reference's own error is of that order, so a relative 1e-13)."""
    assert got.dtype == numpy_call.dtype and got.shape == numpy_call.shape
    top = np.abs(ref).max()
    slack = {np.dtype(np.float64): 1e-13, np.dtype(np.float32): 2.0 ** -23,
             np.dtype(np.float16): 2.0 ** -10, np.dtype(ml_dtypes.bfloat16): 2.0 ** -7}
    assert grad_error(got, ref) <= grad_error(numpy_call, ref) + slack[got.dtype] * top


def check_layer_norm(X, DY, x, dy, w, b, eps):
    """layer_norm_forward and _backward on Dask X and DY against the NumPy
    calls on x and dy: bitwise, dweight/dbias as check_grads says."""
    got = dask.compute(*lnfast.layer_norm_forward(X, w, b, eps=eps))
    want = lnfast.layer_norm_forward(x, w, b, eps=eps)
    for g, v in zip(got, want):
        same(g, v)
    _, mean, rstd = lnfast.layer_norm_forward(X, w, b, eps=eps)
    dx, dw, db = dask.compute(*lnfast.layer_norm_backward(DY, X, mean, rstd, w))
    DX, DW, DB = lnfast.layer_norm_backward(dy, x, want[1], want[2], w)
    same(dx, DX)
    ref = reference.layer_norm_backward(dy, x, want[1], want[2], w)
    check_grads(dw, DW, ref[1])
    check_grads(db, DB, ref[2])


# --- every function, every dtype ----------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_the_numpy_call(rng, dtype):
    x = data(rng, (301, 40), dtype, 3.0, 5.0)
    w, b = data(rng, 40, dtype), data(rng, 40, dtype)
    dy = data(rng, (301, 40), dtype)
    X, DY = da.from_array(x, chunks=(64, 40)), da.from_array(dy, chunks=(50, 40))
    y = lnfast.layer_norm(X, w, b, eps=1e-4)
    assert isinstance(y, da.Array) and y.chunks == X.chunks
    same(y.compute(), lnfast.layer_norm(x, w, b, eps=1e-4))
    check_layer_norm(X, DY, x, dy, w, b, 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_the_numpy_call(rng, dtype):
    x = data(rng, (7, 33, 24), dtype)
    w = data(rng, 24, np.float32)
    dy = data(rng, (7, 33, 24), dtype)
    X = da.from_array(x, chunks=(3, 10, 24))
    same(lnfast.rms_norm(X, w).compute(), lnfast.rms_norm(x, w))
    y, rstd = lnfast.rms_norm_forward(X, w)
    Y, RSTD = lnfast.rms_norm_forward(x, w)
    same(y.compute(), Y)
    same(rstd.compute(), RSTD)
    dx, dw = dask.compute(*lnfast.rms_norm_backward(da.from_array(dy, chunks=(2, 33, 24)), X,
                                                    rstd, w))
    DX, DW = lnfast.rms_norm_backward(dy, x, RSTD, w)
    same(dx, DX)
    check_grads(dw, DW, reference.rms_norm_backward(dy, x, RSTD, w)[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_matches_the_numpy_call(rng, dtype):
    x, r, dy, dz = (data(rng, (130, 48), dtype) for _ in range(4))
    w, b = data(rng, 48, dtype), data(rng, 48, dtype)
    X, R = da.from_array(x, chunks=(40, 48)), da.from_array(r, chunks=(25, 48))
    out = lnfast.add_layer_norm_forward(X, R, w, b)
    want = lnfast.add_layer_norm_forward(x, r, w, b)
    for g, v in zip(dask.compute(*out), want):
        same(g, v)
    _, z, mean, rstd = out
    got = dask.compute(*lnfast.add_layer_norm_backward(
        da.from_array(dy, chunks=(40, 48)), z, mean, rstd, w,
        dz=da.from_array(dz, chunks=(13, 48))))
    DS, DW, DB = lnfast.add_layer_norm_backward(dy, want[1], want[2], want[3], w, dz=dz)
    same(got[0], DS)
    ref = reference.add_layer_norm_backward(dy, want[1], want[2], want[3], w, dz)
    check_grads(got[1], DW, ref[1])
    check_grads(got[2], DB, ref[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_block_gives_the_numpy_calls_gradients(rng, dtype):
    # one block: its float64 sums, rounded once, are the NumPy call's bytes
    x, dy = data(rng, (300, 24), dtype), data(rng, (300, 24), dtype)
    w = data(rng, 24, np.float32)
    X = da.from_array(x, chunks=-1)
    _, mean, rstd = lnfast.layer_norm_forward(X, w)
    got = dask.compute(*lnfast.layer_norm_backward(da.from_array(dy, chunks=-1), X, mean, rstd,
                                                   w))
    for g, v in zip(got, lnfast.layer_norm_backward(dy, x, *lnfast.layer_norm_forward(x, w)[1:],
                                                    w)):
        same(g, v)


def test_no_weight_gives_gradients_of_the_compute_dtype(rng):
    x = data(rng, (64, 16), np.float16)
    X = da.from_array(x, chunks=(16, 16))
    _, mean, rstd = lnfast.layer_norm_forward(X)
    dx, dw, db = lnfast.layer_norm_backward(X, X, mean, rstd)
    assert dw.dtype == db.dtype == np.float32 == dw.compute().dtype
    _, dw2 = lnfast.rms_norm_backward(X, X, lnfast.rms_norm_forward(X)[1])
    assert dw2.compute().dtype == np.float32


# --- axes, chunks, layouts --------------------------------------------------------

@pytest.mark.parametrize("axis, chunks", [
    (1, (2, 12, 3, 5)),             # channels-first, chunked over N and H
    (1, (1, 12, 7, 2)),             # ... and over W
    ((-2, -1), (3, 2, 7, 5)),       # the last two
    ((1, 3), (1, 12, 4, 5)),        # gathered
    (0, (5, 4, 7, 5)),              # the first
])
def test_any_axis_matches_the_numpy_call(rng, axis, chunks):
    x = data(rng, (5, 12, 7, 5), np.float32, 2.0, 1.0)
    ax = lnfast._checks.axes(axis, 4)
    shape = tuple(x.shape[k] for k in ax)
    w, b = data(rng, shape, np.float32), data(rng, shape, np.float32)
    dy = data(rng, x.shape, np.float32)
    X = da.from_array(x, chunks=chunks)
    y, mean, rstd = lnfast.layer_norm_forward(X, w, b, axis=axis)
    Y, MEAN, RSTD = lnfast.layer_norm_forward(x, w, b, axis=axis)
    for g, v in zip(dask.compute(y, mean, rstd), (Y, MEAN, RSTD)):
        same(g, v)
    dx, dw, db = dask.compute(*lnfast.layer_norm_backward(da.from_array(dy, chunks=chunks), X,
                                                          mean, rstd, w, axis=axis))
    DX, DW, DB = lnfast.layer_norm_backward(dy, x, MEAN, RSTD, w, axis=axis)
    same(dx, DX)
    assert dw.shape == db.shape == shape
    np.testing.assert_allclose(dw, DW, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, DB, rtol=1e-5, atol=1e-5)


def test_weight_as_a_dask_array(rng):
    x, dy = data(rng, (50, 20), np.float64), data(rng, (50, 20), np.float64)
    w, b = data(rng, 20, np.float64), data(rng, 20, np.float64)
    X = da.from_array(x, chunks=(7, 20))
    W, B = (da.from_array(a, chunks=20) for a in (w, b))
    same(lnfast.layer_norm(X, W, B).compute(), lnfast.layer_norm(x, w, b))
    _, mean, rstd = lnfast.layer_norm_forward(X, W, B)
    dx, dw, _ = dask.compute(*lnfast.layer_norm_backward(da.from_array(dy, chunks=(9, 20)), X,
                                                         mean, rstd, W))
    DX, DW, _ = lnfast.layer_norm_backward(dy, x, *lnfast.layer_norm_forward(x, w, b)[1:], w)
    same(dx, DX)
    np.testing.assert_allclose(dw, DW, rtol=1e-13)


def test_zero_rows(rng):
    X = da.zeros((0, 8), dtype=np.float32, chunks=(4, 8))
    y, mean, rstd = dask.compute(*lnfast.layer_norm_forward(X))
    assert y.shape == (0, 8) and mean.shape == rstd.shape == (0,)
    dx, dw, db = dask.compute(*lnfast.layer_norm_backward(X, X, *lnfast.layer_norm_forward(X)[1:]))
    assert dx.shape == (0, 8)
    same(dw, np.zeros(8, np.float32))
    same(db, np.zeros(8, np.float32))


def test_a_chunked_normalized_axis_is_an_error_saying_how_to_rechunk(rng):
    X = da.from_array(data(rng, (8, 6, 10), np.float32), chunks=(4, 3, 5))
    with pytest.raises(ValueError, match=r"x must be a single chunk .*x\.rechunk\(\{2: -1\}\)"):
        lnfast.layer_norm(X)
    with pytest.raises(ValueError, match=r"x\.rechunk\(\{1: -1, 2: -1\}\)"):
        lnfast.layer_norm(X, axis=(1, 2))
    with pytest.raises(ValueError, match=r"z must be a single chunk"):
        lnfast.add_layer_norm_backward(X, X, X[..., 0], X[..., 0])
    ok = X.rechunk({2: -1})
    same(lnfast.layer_norm(ok).compute(), lnfast.layer_norm(ok.compute()))


def test_every_array_is_a_single_chunk_along_the_normalized_axes(rng):
    """Not x alone (SPEC, Dask): residual, dy and dz split along a
    normalized axis, or a Dask weight or bias split at all, are a
    ValueError naming them and saying how to rechunk, as
    dask.array.apply_gufunc treats a core dimension; arguments unchanged.
    Their rows may be chunked unlike x's."""
    x = data(rng, (8, 6, 10), np.float32)
    X = da.from_array(x, chunks=(4, 6, 10))
    split = da.from_array(x, chunks=(4, 3, 5))
    rows = da.from_array(x, chunks=(2, 6, 10))
    w = da.from_array(data(rng, 10, np.float32), chunks=5)
    _, mean, rstd = lnfast.layer_norm_forward(X)
    _, z, zmean, zrstd = lnfast.add_layer_norm_forward(X, X)
    before = [a.chunks for a in (X, split, w)]
    with pytest.raises(ValueError,
                       match=r"residual must be a single chunk .*residual\.rechunk\(\{2: -1\}\)"):
        lnfast.add_layer_norm_forward(X, split)
    with pytest.raises(ValueError, match=r"residual\.rechunk\(\{1: -1, 2: -1\}\)"):
        lnfast.add_layer_norm_forward(X, split, axis=(1, 2))
    with pytest.raises(ValueError, match=r"dy must be a single chunk .*dy\.rechunk\(\{2: -1\}\)"):
        lnfast.layer_norm_backward(split, X, mean, rstd)
    with pytest.raises(ValueError, match=r"dy must be a single chunk"):
        lnfast.rms_norm_backward(split, X, rstd)
    with pytest.raises(ValueError, match=r"dz must be a single chunk .*dz\.rechunk"):
        lnfast.add_layer_norm_backward(X, z, zmean, zrstd, dz=split)
    with pytest.raises(ValueError, match=r"weight must be a single chunk.*weight\.rechunk\(-1\)"):
        lnfast.layer_norm(X, w)
    with pytest.raises(ValueError, match=r"bias must be a single chunk.*bias\.rechunk\(-1\)"):
        lnfast.layer_norm(X, None, w)
    with pytest.raises(ValueError, match=r"weight must be a single chunk"):
        lnfast.layer_norm_backward(X, X, mean, rstd, w)
    assert [a.chunks for a in (X, split, w)] == before
    # (rows chunked unlike x's: rechunked to x's)
    same(lnfast.add_layer_norm_forward(X, rows)[0].compute(),
         lnfast.add_layer_norm_forward(x, x)[0])
    same(lnfast.layer_norm_backward(rows, X, mean, rstd)[0].compute(),
         lnfast.layer_norm_backward(x, x, *lnfast.layer_norm_forward(x)[1:])[0])


def test_bad_input_names_the_argument(rng):
    x = data(rng, (8, 6), np.float32)
    X = da.from_array(x, chunks=(4, 6))
    _, mean, rstd = lnfast.layer_norm_forward(X)
    with pytest.raises(TypeError, match="dy is a numpy.ndarray but x is a dask.array.Array"):
        lnfast.layer_norm_backward(x, X, mean, rstd)
    with pytest.raises(TypeError, match="residual is a numpy.ndarray"):
        lnfast.add_layer_norm_forward(X, x)
    with pytest.raises(TypeError, match="out must be None for Dask arrays"):
        lnfast.layer_norm(X, out=X)
    with pytest.raises(TypeError, match="dy is a dask.array.Array but x is a numpy.ndarray"):
        lnfast.layer_norm_backward(X, x, np.zeros(8, np.float32), np.ones(8, np.float32))
    with pytest.raises(ValueError, match="weight must have shape"):
        lnfast.layer_norm(X, np.ones(5, np.float32))
    with pytest.raises(TypeError, match="weight must have dtype"):
        lnfast.layer_norm(X, da.ones(6, dtype=np.int32))
    with pytest.raises(ValueError, match="eps"):
        lnfast.rms_norm(X, eps=-1.0)
    with pytest.raises(ValueError, match="axis"):
        lnfast.layer_norm(X, axis=(1, 1))
    with pytest.raises(TypeError, match="x must have dtype"):
        lnfast.layer_norm(da.ones((4, 4), dtype=np.int64))
    # masked blocks, refused at call time as NumPy's masked arrays are
    m = np.ma.masked_array(x, mask=x > 1)
    M = da.from_array(m, chunks=(4, 6), asarray=False)
    with pytest.raises(TypeError, match="blocks of x must be NumPy or CuPy arrays.*masks"):
        lnfast.layer_norm(M)
    with pytest.raises(TypeError, match="dy's blocks are numpy.ma.MaskedArrays"):
        lnfast.layer_norm_backward(M, X, mean, rstd)
    with pytest.raises(TypeError, match="weight is a numpy.ma.MaskedArray"):
        lnfast.layer_norm(X, np.ma.masked_array(np.ones(6, np.float32)))


def test_gradients_are_ordinary_dask_arrays(rng):
    # results of the reduction tree can be computed on, sliced and stacked
    x = data(rng, (40, 8), np.float32)
    X = da.from_array(x, chunks=(10, 8))
    _, mean, rstd = lnfast.layer_norm_forward(X)
    dx, dw, db = lnfast.layer_norm_backward(X, X, mean, rstd)
    DX, DW, DB = lnfast.layer_norm_backward(x, x, *lnfast.layer_norm_forward(x)[1:])
    got = dask.compute(dw * 2, dw[:3], da.stack([dw, db]), dx.sum() + dw.sum())
    np.testing.assert_allclose(got[0], 2 * DW, rtol=1e-6, atol=1e-6)
    same(got[1], dask.compute(dw)[0][:3])
    assert got[2].shape == (2, 8)
    _, rstd2 = lnfast.rms_norm_forward(X)
    dw2 = lnfast.rms_norm_backward(X, X, rstd2)[1]
    assert (dw2 + 1).compute().shape == (8,)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_rows_of_unknown_size(rng, dtype):
    # rows picked by a mask (or a DataFrame's to_dask_array()) have chunks
    # of unknown size: a row-wise call runs on them as blockwise does
    x, r, dy = (data(rng, (200, 24), dtype, 2.0) for _ in range(3))
    w, b = data(rng, 24, dtype), data(rng, 24, dtype)
    keep = rng.random(200) > 0.4
    X, R, DY = (da.from_array(a, chunks=(64, 24))[da.from_array(keep, chunks=64)]
                for a in (x, r, dy))
    assert np.isnan(X.shape[0]) and len(X.chunks[0]) == 4
    x, r, dy = x[keep], r[keep], dy[keep]
    y = lnfast.layer_norm(X, w, b)
    assert len(y.chunks[0]) == 4 and np.isnan(y.shape[0]) and y.chunks[1] == (24,)
    same(y.compute(), lnfast.layer_norm(x, w, b))
    check_layer_norm(X, DY, x, dy, w, b, 1e-5)
    for g, v in zip(dask.compute(*lnfast.add_layer_norm_forward(X, R, w, b)),
                    lnfast.add_layer_norm_forward(x, r, w, b)):
        same(g, v)
    _, RS = lnfast.rms_norm_forward(X, w)
    same(lnfast.rms_norm_backward(DY, X, RS, w)[0].compute(),
         lnfast.rms_norm_backward(dy, x, lnfast.rms_norm_forward(x, w)[1], w)[0])


def test_rows_of_unknown_size_over_a_middle_axis(rng):
    x = data(rng, (30, 8, 5), np.float32, 1.0)
    keep = rng.random(30) > 0.5
    X = da.from_array(x, chunks=(8, 8, 5))[da.from_array(keep, chunks=8)]
    for g, v in zip(dask.compute(*lnfast.layer_norm_forward(X, axis=1)),
                    lnfast.layer_norm_forward(x[keep], axis=1)):
        same(g, v)


def test_unknown_sizes_elsewhere_are_an_error(rng):
    x = data(rng, (40, 8), np.float32)
    X = da.from_array(x, chunks=(10, 8))
    cols = X[:, da.from_array(x[0] > -10, chunks=8)]         # every column, of unknown count
    with pytest.raises(ValueError, match=r"x has chunks of unknown size along the normalized "
                                         r"axes .*x\.compute_chunk_sizes\(\)"):
        lnfast.layer_norm(cols)
    W = da.from_array(np.ones(8, np.float32), chunks=8)
    with pytest.raises(ValueError, match=r"weight has chunks of unknown size .*weight\."
                                         r"compute_chunk_sizes"):
        lnfast.layer_norm(X, W[W > 0])
    # the checks of a NumPy call come first, in its order
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        lnfast.layer_norm(da.from_array(np.float32(1)))
    with pytest.raises(TypeError, match="x must have dtype"):
        lnfast.layer_norm(cols.astype(np.int32), axis=5)


def test_rows_of_unknown_size_with_other_axes_chunked_otherwise(rng):
    # the known axes of residual, dy and mean are rechunked to x's
    x, r, dy = (data(rng, (40, 6, 8), np.float32) for _ in range(3))
    keep = da.from_array(rng.random(40) > 0.3, chunks=10)
    X, R, DY = (da.from_array(a, chunks=(10, c, 8))[keep] for a, c in ((x, 3), (r, 6), (dy, 2)))
    k = keep.compute()
    for g, v in zip(dask.compute(*lnfast.add_layer_norm_forward(X, R)),
                    lnfast.add_layer_norm_forward(x[k], r[k])):
        same(g, v)
    _, mean, rstd = lnfast.layer_norm_forward(DY)           # rows chunked (nan,) x (2, 2, 2)
    got = lnfast.layer_norm_backward(DY, X, mean, rstd)[0]
    same(got.compute(), lnfast.layer_norm_backward(dy[k], x[k],
                                                   *lnfast.layer_norm_forward(dy[k])[1:])[0])


def test_rows_of_unknown_size_must_be_chunked_alike(rng):
    x = data(rng, (40, 8), np.float32)
    X = da.from_array(x, chunks=(10, 8))
    every, most = np.ones(40, bool), np.arange(40) % 10 != 0
    rows = X[da.from_array(every, chunks=10)]               # 4 blocks of unknown size
    other = da.from_array(x, chunks=(20, 8))[da.from_array(every, chunks=20)]     # 2 blocks
    with pytest.raises(ValueError, match=r"residual has 2 chunks along axis 0 where x has 4, "
                                         r"of unknown size there.*compute_chunk_sizes"):
        lnfast.add_layer_norm_forward(rows, other)
    with pytest.raises(ValueError, match=r"residual's rows \(40,\) are of unknown size where "
                                         r"x's \(nan,\) are not, or the reverse"):
        lnfast.add_layer_norm_forward(rows, X)              # known against unknown
    _, mean, rstd = lnfast.layer_norm_forward(rows)
    with pytest.raises(ValueError, match=r"dy has 2 chunks along axis 0 where x has 4"):
        lnfast.layer_norm_backward(other, rows, mean, rstd)
    with pytest.raises(ValueError, match=r"rstd's rows \(40,\) are of unknown size where x's"):
        lnfast.layer_norm_backward(rows, rows, mean, lnfast.layer_norm_forward(X)[2])
    # as many chunks, but known where x's are unknown, or the reverse
    part = da.concatenate([X[:10], X[10:][da.from_array(every[10:], chunks=10)]])
    assert part.chunks[0][0] == 10 and len(part.chunks[0]) == 4
    with pytest.raises(ValueError, match=r"dy's chunks along axis 0 \(10, nan, nan, nan\) are "
                                         r"not x's \(nan, nan, nan, nan\).*compute_chunk_sizes"):
        lnfast.layer_norm_backward(part, rows, mean, rstd)
    with pytest.raises(ValueError, match=r"residual's chunks along axis 0 \(nan, nan, nan, nan\) "
                                         r"are not x's \(10, nan, nan, nan\)"):
        lnfast.add_layer_norm_forward(part, rows)
    same(lnfast.add_layer_norm_forward(part, part)[0].compute(),
         lnfast.add_layer_norm_forward(x, x)[0])
    # as many blocks of unknown size, of other lengths (10 rows against 9):
    # each block's own check, when it runs
    y = lnfast.add_layer_norm_forward(rows, X[da.from_array(most, chunks=10)])[0]
    with pytest.raises(ValueError, match=r"residual must have the shape of x \(10, 8\), "
                                         r"got \(9, 8\)"):
        y.compute(scheduler="sync")


def test_weight_is_read_at_call_time(rng):
    x, w = data(rng, (16, 8), np.float32), data(rng, 8, np.float32)
    y = lnfast.layer_norm(da.from_array(x, chunks=(4, 8)), w)
    want = lnfast.layer_norm(x, w)
    w *= 3
    same(y.compute(), want)


def test_calls_are_lazy(rng):
    def boom(block):
        raise AssertionError("computed")

    X = da.from_array(data(rng, (8, 6), np.float32), chunks=(4, 6)).map_blocks(
        boom, meta=np.empty((0, 0), np.float32))
    y, mean, rstd = lnfast.layer_norm_forward(X)
    lnfast.layer_norm_backward(X, X, mean, rstd)
    lnfast.add_layer_norm_forward(X, X)
    with pytest.raises(AssertionError, match="computed"):
        y.compute()


# --- names -----------------------------------------------------------------------

def test_calls_differing_in_any_argument_have_their_own_tasks(rng):
    x = data(rng, (64, 8), np.float32, 0.01)
    X = da.from_array(x, chunks=(16, 8))
    whole = da.from_array(x, chunks=(64, 8))
    calls = [lnfast.layer_norm(X, eps=1e-5), lnfast.layer_norm(X, eps=1e-1),
             lnfast.rms_norm(X, eps=1e-5), lnfast.layer_norm(whole, eps=1e-5, axis=0),
             lnfast.layer_norm(whole, eps=1e-5, axis=1),
             lnfast.layer_norm(X, np.full(8, 2, np.float32), eps=1e-5)]
    assert len({c.name for c in calls}) == len(calls)
    assert lnfast.layer_norm(X, eps=1e-5).name == calls[0].name       # (the same call)
    got = dask.compute(*calls)          # one graph, every call's tasks in it
    want = [lnfast.layer_norm(x, eps=1e-5), lnfast.layer_norm(x, eps=1e-1),
            lnfast.rms_norm(x, eps=1e-5), lnfast.layer_norm(x, eps=1e-5, axis=0),
            lnfast.layer_norm(x, eps=1e-5, axis=1),
            lnfast.layer_norm(x, np.full(8, 2, np.float32), eps=1e-5)]
    for g, v in zip(got, want):
        same(g, v)
    assert not np.array_equal(got[0], got[1])


def test_backward_names_tell_calls_apart(rng):
    x, dy = data(rng, (32, 8), np.float32), data(rng, (32, 8), np.float32)
    X, DY = da.from_array(x, chunks=(8, 8)), da.from_array(dy, chunks=(8, 8))
    _, mean, rstd = lnfast.layer_norm_forward(X)
    a = lnfast.layer_norm_backward(DY, X, mean, rstd)
    b = lnfast.layer_norm_backward(DY, X, mean, rstd, np.full(8, 3, np.float32))
    assert a[0].name != b[0].name and a[1].name != b[1].name
    dxa, dxb = dask.compute(a[0], b[0])
    same(dxa, a[0].compute())
    same(dxb, b[0].compute())
    assert not np.array_equal(dxa, dxb)


# --- schedulers and workers ----------------------------------------------------------

def grads_graph(rng, n_rows=6000, dtype=np.float32):
    x = data(rng, (n_rows, 96), dtype, 4.0, 100.0)
    dy = data(rng, (n_rows, 96), dtype)
    w = data(rng, 96, dtype)
    X, DY = da.from_array(x, chunks=(250, 96)), da.from_array(dy, chunks=(250, 96))
    _, mean, rstd = lnfast.layer_norm_forward(X, w)
    return lnfast.layer_norm_backward(DY, X, mean, rstd, w)[1:]


def test_gradients_are_bitwise_the_same_on_every_scheduler(rng):
    dw, db = grads_graph(rng)
    first = dask.compute(dw, db, scheduler="sync")
    for scheduler in ("threads", "processes"):
        for _ in range(2):
            got = dask.compute(dw, db, scheduler=scheduler)
            same(got[0], first[0])
            same(got[1], first[1])


def test_gradients_are_bitwise_the_same_on_dask_distributed(rng):
    """Also over a non-last axis, whose layout chooses the kernel: the
    workers may get blocks from the network unaligned."""
    distributed = pytest.importorskip("distributed")
    graph = list(grads_graph(rng))
    x = da.from_array(data(rng, (300, 24, 16), np.float32, 3.0, 4.0), chunks=(100, 24, 16))
    dy = da.from_array(data(rng, x.shape, np.float32), chunks=x.chunks)
    y, mean, rstd = lnfast.layer_norm_forward(x, axis=1)
    graph += [y, rstd, *lnfast.layer_norm_backward(dy, x, mean, rstd, axis=1)]
    first = dask.compute(*graph, scheduler="sync")
    for workers in (1, 2):
        with distributed.LocalCluster(n_workers=workers, threads_per_worker=2, processes=True,
                                      host="127.0.0.1", dashboard_address=None) as cluster, \
                distributed.Client(cluster) as client:
            got = client.compute(graph, sync=True)
            for a, e in zip(got, first):
                same(a, e)


# --- threads -------------------------------------------------------------------

def test_task_threads(monkeypatch):
    import threading

    monkeypatch.delenv("LNFAST_NUM_THREADS", raising=False)
    default = _threads.get_num_threads()
    seen = {}

    def task(key):
        with _threads.task_threads():
            seen[key] = _threads.get_num_threads()
        seen[key + " after"] = _threads.get_num_threads()

    task("main")                        # the main thread: as without
    for key in ("worker", "chosen"):
        if key == "chosen":
            lnfast.set_num_threads(3)   # the user's choice holds everywhere
        t = threading.Thread(target=task, args=(key,))
        t.start()
        t.join()
    assert seen == {"main": default, "main after": default, "worker": 1,
                    "worker after": default, "chosen": 3, "chosen after": 3}


@pytest.mark.parametrize("scheduler, want", [("threads", 1), ("sync", None)])
def test_dask_tasks_run_lnfast_on_one_thread_on_the_threaded_scheduler(
        rng, monkeypatch, scheduler, want):
    monkeypatch.delenv("LNFAST_NUM_THREADS", raising=False)
    default = _threads.get_num_threads()
    counts = []
    real = _threads.get_num_threads

    def recording():
        counts.append(real())
        return counts[-1]

    monkeypatch.setattr(_threads, "get_num_threads", recording)
    X = da.from_array(data(rng, (4 * 512, 64), np.float32), chunks=(512, 64))
    _, mean, rstd = lnfast.layer_norm_forward(X)
    dask.compute(*lnfast.layer_norm_backward(X, X, mean, rstd), scheduler=scheduler)
    assert counts and set(counts) == {want or default}


def test_import_lnfast_does_not_import_dask():
    code = "import sys, lnfast; print('dask' in sys.modules)"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.strip() == "False", p.stderr


def test_transposed_blocks_give_the_numpy_calls_bits(rng):
    # blocks of a transposed array are Fortran-ordered views, whose rows lie
    # far apart; the computed array is C-ordered, and its call the reference
    a = data(rng, (8, 30), np.float32)
    X = da.from_array(a, chunks=(8, 10)).T
    x = X.compute()
    w, b = data(rng, 8, np.float32), data(rng, 8, np.float32)
    same(lnfast.layer_norm(X, w, b).compute(), lnfast.layer_norm(x, w, b))
    dy = data(rng, (30, 8), np.float32)
    y, m, r = lnfast.layer_norm_forward(x, w, b)
    DY = da.from_array(dy.T.copy(), chunks=(8, 10)).T
    M, R = da.from_array(m, chunks=10), da.from_array(r, chunks=10)
    got = lnfast.layer_norm_backward(DY, X, M, R, w)
    same(got[0].compute(), lnfast.layer_norm_backward(dy, x, m, r, w)[0])
