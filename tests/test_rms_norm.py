"""rms_norm, rms_norm_forward, rms_norm_backward: y = x * rstd * weight."""
import numpy as np
import pytest

import lnfast
from lnfast import reference as ref

from tests.helpers import BACKWARD_TOL, DTYPES, FORWARD_TOL


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 2, 3, 7, 64, 768, 4097])
@pytest.mark.parametrize("with_weight", [True, False])
def test_matches_reference(rng, dtype, D, with_weight):
    x = (rng.standard_normal((29, D)) + 0.3).astype(dtype)
    w = (rng.standard_normal(D) + 1).astype(dtype) if with_weight else None
    y, rstd = lnfast.rms_norm_forward(x, w)
    ry, rrstd = ref.rms_norm_forward(x, w)
    assert y.dtype == rstd.dtype == dtype and rstd.shape == (29,)
    assert ref.rel_error(y, ry) <= FORWARD_TOL[dtype]
    assert ref.rel_error(rstd, rrstd) <= FORWARD_TOL[dtype]
    assert np.array_equal(lnfast.rms_norm(x, w), y)

    dy = rng.standard_normal(x.shape).astype(dtype)
    dx, dw = lnfast.rms_norm_backward(dy, x, rstd, w)
    rdx, rdw = ref.rms_norm_backward(dy, x, rrstd, w)
    assert dx.dtype == dw.dtype == dtype and dw.shape == (D,)
    if D > 1:      # D == 1: dx = rstd^3 * eps * g is pure cancellation
        assert ref.rel_error(dx, rdx) <= BACKWARD_TOL[dtype]
    assert ref.rel_error(dw, rdw) <= BACKWARD_TOL[dtype]


@pytest.mark.parametrize("D", [1, 2, 5, 9])
def test_reference_matches_finite_differences(rng, D):
    x = rng.standard_normal((3, D))
    w, dy = rng.standard_normal(D), rng.standard_normal((3, D))
    eps = 1e-2
    _, rstd = ref.rms_norm_forward(x, w, eps)
    dx, dw = ref.rms_norm_backward(dy, x, rstd, w)
    fx = ref.finite_difference(lambda v: np.sum(dy * ref.rms_norm_forward(v, w, eps)[0]), x)
    fw = ref.finite_difference(lambda v: np.sum(dy * ref.rms_norm_forward(x, v, eps)[0]), w)
    assert np.allclose(dx, fx, rtol=1e-6, atol=1e-8)
    assert ref.rel_error(dw, fw) <= 1e-7
    got = lnfast.rms_norm_backward(dy, x, lnfast.rms_norm_forward(x, w, eps=eps)[1], w)
    assert np.allclose(got[0], fx, rtol=1e-6, atol=1e-8)
    assert ref.rel_error(got[1], fw) <= 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_out_and_in_place(rng, dtype):
    base = rng.standard_normal((6, 3, 64)).astype(dtype)
    x = base[::-1, :, ::2]
    w = rng.standard_normal(32).astype(dtype)
    want = lnfast.rms_norm(np.ascontiguousarray(x), w)
    assert np.array_equal(lnfast.rms_norm(x, w), want)
    out = np.empty((6, 3, 32), dtype)
    assert lnfast.rms_norm(x, w, out=out) is out and np.array_equal(out, want)
    lnfast.rms_norm(x, w, out=x)
    assert np.array_equal(x, want)


def test_zero_rows_and_bad_input(rng):
    x = np.empty((0, 8))
    y, rstd = lnfast.rms_norm_forward(x)
    dx, dw = lnfast.rms_norm_backward(x, x, rstd)
    assert dx.shape == (0, 8) and np.array_equal(dw, np.zeros(8))
    x = rng.standard_normal((4, 8))
    with pytest.raises(ValueError, match="weight"):
        lnfast.rms_norm(x, np.ones(7))
    with pytest.raises(TypeError, match=r"\bx\b"):
        lnfast.rms_norm(x.astype(np.int16))
    with pytest.raises(ValueError, match="rstd"):
        lnfast.rms_norm_backward(x, x, np.ones(3))
    with pytest.raises(ValueError, match="dy"):
        lnfast.rms_norm_backward(x[:2], x, np.ones(4))
    with pytest.raises(ValueError, match="out"):
        lnfast.rms_norm(x, out=np.empty((4, 9)))
    with pytest.raises(TypeError):
        lnfast.rms_norm(x, None, 1e-5)        # eps is keyword-only


def test_inf_stays_in_its_row(rng):
    x = rng.standard_normal((4, 16))
    x[1, 2] = np.inf
    y, rstd = lnfast.rms_norm_forward(x)
    assert not np.isfinite(y[1]).all()
    assert np.isfinite(np.delete(y, 1, 0)).all()
