"""layer_norm, layer_norm_forward and layer_norm_backward against the float64
reference (SPEC "The math", "Arrays and devices", "Functions")."""
import numpy as np
import pytest

import lnfast
from lnfast import reference as ref

from tests.helpers import BACKWARD_TOL, DTYPES, FORWARD_TOL


def make(rng, shape, dtype, weight=True, bias=True):
    D = shape[-1]
    x = rng.standard_normal(shape).astype(dtype) * 2 + 0.5
    w = (rng.standard_normal(D) + 1).astype(dtype) if weight else None
    b = rng.standard_normal(D).astype(dtype) if bias else None
    return x, w, b


def check_forward(x, w, b, eps=1e-5):
    tol = FORWARD_TOL[x.dtype.type]
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b, eps=eps)
    ry, rmean, rrstd = ref.layer_norm_forward(x, w, b, eps)
    assert y.shape == x.shape and y.dtype == x.dtype and y.flags.c_contiguous
    assert mean.shape == rstd.shape == x.shape[:-1]
    assert mean.dtype == rstd.dtype == x.dtype
    assert ref.rel_error(y, ry) <= tol
    assert ref.rel_error(mean, rmean) <= tol
    assert ref.rel_error(rstd, rrstd) <= tol
    assert np.array_equal(lnfast.layer_norm(x, w, b, eps=eps), y)
    return y, mean, rstd


def check_backward(dy, x, w, eps=1e-5):
    tol = BACKWARD_TOL[x.dtype.type]
    _, mean, rstd = lnfast.layer_norm_forward(x, w, eps=eps)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    _, rmean, rrstd = ref.layer_norm_forward(x, w, eps=eps)
    rdx, rdw, rdb = ref.layer_norm_backward(dy, x, rmean, rrstd, w)
    D = x.shape[-1]
    gdtype = np.dtype(x.dtype if w is None else w.dtype)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dx.flags.c_contiguous
    assert dw.shape == db.shape == (D,) and dw.dtype == db.dtype == gdtype
    if D > 2:
        assert ref.rel_error(dx, rdx) <= tol
    else:
        # D == 1: dx is exactly zero.  D == 2: xhat = +-sqrt(var / (var + eps))
        # and dx is O(eps / var) left over from cancelling O(rstd * g) terms,
        # so the error is measured against the size of those terms.
        g = dy if w is None else dy * w.astype(np.float64)
        assert np.linalg.norm(dx - rdx) <= tol * np.linalg.norm(g * rrstd[..., None])
    gtol = BACKWARD_TOL[gdtype.type]      # float32 weight: float32 results
    assert ref.rel_error(dw, rdw) <= gtol
    assert ref.rel_error(db, rdb) <= gtol
    return dx, dw, db


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 2, 3, 7, 8, 9, 64, 768, 4097])
def test_forward_and_backward_match_reference(rng, dtype, D):
    x, w, b = make(rng, (37, D), dtype)
    check_forward(x, w, b)
    check_backward(rng.standard_normal(x.shape).astype(dtype), x, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight,bias", [(False, False), (True, False), (False, True)])
def test_optional_weight_and_bias(rng, dtype, weight, bias):
    x, w, b = make(rng, (20, 33), dtype, weight, bias)
    check_forward(x, w, b)
    check_backward(rng.standard_normal(x.shape).astype(dtype), x, w)


def test_none_means_ones_and_zeros(rng):
    x, _, _ = make(rng, (5, 12), np.float64)
    ones, zeros = np.ones(12), np.zeros(12)
    assert np.array_equal(lnfast.layer_norm(x), lnfast.layer_norm(x, ones, zeros))
    dy = rng.standard_normal(x.shape)
    _, mean, rstd = lnfast.layer_norm_forward(x)
    for a, b in zip(lnfast.layer_norm_backward(dy, x, mean, rstd),
                    lnfast.layer_norm_backward(dy, x, mean, rstd, ones)):
        assert np.array_equal(a, b)


def test_float32_weight_with_float64_x(rng):
    x, _, _ = make(rng, (9, 40), np.float64)
    w = rng.standard_normal(40).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    y = lnfast.layer_norm(x, w, b)
    assert y.dtype == np.float64
    assert ref.rel_error(y, ref.layer_norm_forward(x, w, b)[0]) <= 1e-12
    dx, dw, db = check_backward(rng.standard_normal(x.shape), x, w)
    assert dw.dtype == db.dtype == np.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_axes(rng, dtype):
    x, w, b = make(rng, (2, 3, 4, 50), dtype)
    y, mean, rstd = check_forward(x, w, b)
    assert mean.shape == (2, 3, 4)
    check_backward(rng.standard_normal(x.shape).astype(dtype), x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_dimensional_x_is_one_row(rng, dtype):
    x, w, b = make(rng, (100,), dtype)
    y, mean, rstd = check_forward(x, w, b)
    assert mean.shape == rstd.shape == ()
    check_backward(rng.standard_normal(100).astype(dtype), x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows(rng, dtype):
    x = np.empty((0, 16), dtype)
    y, mean, rstd = lnfast.layer_norm_forward(x)
    assert y.shape == (0, 16) and mean.shape == rstd.shape == (0,)
    dx, dw, db = lnfast.layer_norm_backward(x, x, mean, rstd)
    assert dx.shape == (0, 16)
    assert np.array_equal(dw, np.zeros(16)) and np.array_equal(db, np.zeros(16))
    y = lnfast.layer_norm(np.empty((3, 0, 8), dtype))
    assert y.shape == (3, 0, 8)


def strided_views(rng, dtype):
    """(name, view) pairs of non-contiguous layouts of a (6, 5, 40) shape."""
    big = rng.standard_normal((6, 5, 80)).astype(dtype)
    yield "every other element", big[:, :, ::2]
    yield "negative strides", big[::-1, :, ::-2]
    yield "transposed leading axes", np.ascontiguousarray(
        big[:, :, :40].transpose(1, 0, 2)).transpose(1, 0, 2)
    yield "feature axis transposed", np.ascontiguousarray(
        big[:, :, :40].transpose(2, 0, 1)).transpose(1, 2, 0)
    yield "broadcast rows", np.broadcast_to(big[0, 0, :40], (6, 5, 40))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs(rng, dtype):
    for name, x in strided_views(rng, dtype):
        assert x.shape == (6, 5, 40), name
        contiguous = np.ascontiguousarray(x)
        w = rng.standard_normal(40).astype(dtype)
        dy_c = rng.standard_normal(x.shape).astype(dtype)
        dy = np.flip(np.flip(dy_c, 0).copy(), 0)          # negative-stride dy
        # rows far apart whose neighbours are adjacent take the tile kernels,
        # whose last bits are their own (docs/api.md, "Axes"); other views
        # are gathered into rows, the bits of contiguous rows
        tiles = name == "feature axis transposed"
        got = lnfast.layer_norm_forward(x, w, w[::-1])
        want = lnfast.layer_norm_forward(contiguous, w, w[::-1].copy())
        for g, e in zip(got, want):
            assert (ref.rel_error(g, e) <= FORWARD_TOL[dtype] if tiles
                    else np.array_equal(g, e)), name
        back = lnfast.layer_norm_backward(dy, x, got[1], got[2], w[::-1])
        back_c = lnfast.layer_norm_backward(dy_c, contiguous, want[1], want[2],
                                            w[::-1].copy())
        for g, e in zip(back, back_c):
            assert (ref.rel_error(g, e) <= BACKWARD_TOL[dtype] if tiles
                    else np.array_equal(g, e)), name
        check_forward(x, w, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_only_inputs(rng, dtype):
    x, w, b = make(rng, (8, 30), dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    for a in (x, w, b, dy):
        a.flags.writeable = False
    check_forward(x, w, b)
    check_backward(dy, x, w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_and_in_place(rng, dtype):
    x, w, b = make(rng, (16, 70), dtype)
    expected = lnfast.layer_norm(x, w, b)
    out = np.empty_like(x)
    assert lnfast.layer_norm(x, w, b, out=out) is out
    assert np.array_equal(out, expected)
    x2 = x.copy()
    assert lnfast.layer_norm(x2, w, b, out=x2) is x2
    assert np.array_equal(x2, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_strided_and_overlapping(rng, dtype):
    x, w, b = make(rng, (16, 70), dtype)
    expected = lnfast.layer_norm(x, w, b)
    big = np.zeros((16, 140), dtype)
    out = big[:, ::2]                                  # strided out
    lnfast.layer_norm(x, w, b, out=out)
    assert np.array_equal(out, expected) and not big[:, 1::2].any()
    xs = np.ascontiguousarray(x[:, ::-1])[:, ::-1]     # in place, negative stride
    lnfast.layer_norm(xs, w, b, out=xs)
    assert np.array_equal(xs, expected)
    buf = np.concatenate([x, x[:1]])                   # out overlaps x shifted by a row
    lnfast.layer_norm(buf[:-1], w, b, out=buf[1:])
    assert np.array_equal(buf[1:], expected)


@pytest.mark.parametrize("offset", [1e3, 1e4, 1e5])
def test_float32_large_common_offset(rng, offset):
    x = (offset + rng.standard_normal((64, 4096))).astype(np.float32)
    y, mean, rstd = lnfast.layer_norm_forward(x)
    assert ref.rel_error(y, ref.layer_norm_forward(x)[0]) <= 1e-6
    check_backward(rng.standard_normal(x.shape).astype(np.float32), x, None)


def test_catastrophic_cancellation_rows():
    # E[x^2] - E[x]^2 in float32 gives a variance of 0 or below for this row.
    x = np.array([[40000, 40001, 40002, 40003]], np.float32)
    y = lnfast.layer_norm(x, eps=0.0)
    assert np.all(np.isfinite(y))
    assert ref.rel_error(y, ref.layer_norm_forward(x, eps=0.0)[0]) <= 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows(dtype):
    x = np.full((3, 10), 7.0, dtype)
    y, mean, rstd = lnfast.layer_norm_forward(x, bias=np.arange(10, dtype=dtype))
    assert np.array_equal(y, np.tile(np.arange(10, dtype=dtype), (3, 1)))
    assert np.all(mean == 7) and np.allclose(rstd, 1 / np.sqrt(1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_stay_in_their_row(rng, dtype, bad):
    x, w, b = make(rng, (6, 50), dtype)
    x[2, 17] = bad
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b)
    assert np.all(np.isnan(y[2]))
    clean = np.delete(np.arange(6), 2)
    assert np.array_equal(y[clean], lnfast.layer_norm(x[clean], w, b))
    dy = rng.standard_normal(x.shape).astype(dtype)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    assert np.all(np.isnan(dx[2]))
    assert np.array_equal(dx[clean], lnfast.layer_norm_backward(
        dy[clean], x[clean], mean[clean], rstd[clean], w)[0])
    assert np.all(np.isnan(dw))          # NaN reaches the reductions
    assert np.all(np.isfinite(db))       # dbias does not read x


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_rows_use_every_chunk(rng, dtype):
    # More rows than chunks and threads: exercises the chunked reduction.
    x, w, b = make(rng, (3001, 24), dtype)
    check_forward(x, w, b)
    check_backward(rng.standard_normal(x.shape).astype(dtype), x, w)


def test_eps_is_used(rng):
    x = rng.standard_normal((4, 16))
    check_forward(x, None, None, eps=0.5)
    check_backward(rng.standard_normal(x.shape), x, None, eps=0.5)
    check_forward(x, None, None, eps=0)
