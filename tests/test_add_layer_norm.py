"""add_layer_norm_forward / add_layer_norm_backward: z = x + residual,
y = LayerNorm(z); the gradient reaching z goes to both x and residual."""
import numpy as np
import pytest

import lnfast
from lnfast import reference as ref

from tests.helpers import BACKWARD_TOL, DTYPES, FORWARD_TOL


def make(rng, shape, dtype):
    D = shape[-1]
    x = rng.standard_normal(shape).astype(dtype)
    r = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal(D) + 1).astype(dtype)
    b = rng.standard_normal(D).astype(dtype)
    return x, r, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 3, 7, 64, 768, 4097])
@pytest.mark.parametrize("affine", [True, False])
def test_matches_reference(rng, dtype, D, affine):
    x, r, w, b = make(rng, (23, D), dtype)
    if not affine:
        w = b = None
    y, z, mean, rstd = lnfast.add_layer_norm_forward(x, r, w, b)
    ry, rz, _, rrstd = ref.add_layer_norm_forward(x, r, w, b)
    assert z.dtype == y.dtype == mean.dtype == rstd.dtype == dtype
    assert np.array_equal(z, x + r)          # z is the float sum, rounded once
    ftol = FORWARD_TOL[dtype]
    assert ref.rel_error(y, ry) <= ftol
    assert ref.rel_error(rstd, rrstd) <= ftol
    # Same y as the unfused NumPy add followed by layer_norm, to the bit.
    assert np.array_equal(y, lnfast.layer_norm(x + r, w, b))

    dy = rng.standard_normal(x.shape).astype(dtype)
    dz = rng.standard_normal(x.shape).astype(dtype)
    dsum, dw, db = lnfast.add_layer_norm_backward(dy, z, mean, rstd, w, dz=dz)
    # The backward reference starts from the z that was stored (rounded once).
    _, zmean, zrstd = ref.layer_norm_forward(z, w, b)
    rdsum, rdw, rdb = ref.add_layer_norm_backward(dy, z, zmean, zrstd, w, dz)
    btol = BACKWARD_TOL[dtype]
    assert ref.rel_error(dsum, rdsum) <= btol
    assert ref.rel_error(dw, rdw) <= btol
    assert ref.rel_error(db, rdb) <= btol
    dx_plain = lnfast.layer_norm_backward(dy, z, mean, rstd, w)
    assert np.array_equal(lnfast.add_layer_norm_backward(dy, z, mean, rstd, w)[0],
                          dx_plain[0])
    assert np.array_equal(dsum, dx_plain[0] + dz)
    assert np.array_equal(dw, dx_plain[1]) and np.array_equal(db, dx_plain[2])


def test_dsum_is_the_gradient_of_x_and_of_residual(rng):
    # Two-branch loss L = <dy, y> + <dz, z>, checked by finite differences.
    x, r, w, b = make(rng, (3, 6), np.float64)
    dy, dz = rng.standard_normal(x.shape), rng.standard_normal(x.shape)
    eps = 1e-3

    def loss(xv, rv):
        y, z, _, _ = ref.add_layer_norm_forward(xv, rv, w, b, eps)
        return np.sum(dy * y) + np.sum(dz * z)

    grad_x = ref.finite_difference(lambda v: loss(v, r), x)
    grad_r = ref.finite_difference(lambda v: loss(x, v), r)
    _, z, mean, rstd = lnfast.add_layer_norm_forward(x, r, w, b, eps=eps)
    dsum, dw, db = lnfast.add_layer_norm_backward(dy, z, mean, rstd, w, dz=dz)
    assert ref.rel_error(dsum, grad_x) <= 1e-7
    assert ref.rel_error(dsum, grad_r) <= 1e-7
    grad_w = ref.finite_difference(
        lambda v: np.sum(dy * ref.add_layer_norm_forward(x, r, v, b, eps)[0]), w)
    assert ref.rel_error(dw, grad_w) <= 1e-7


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_read_only_and_leading_axes(rng, dtype):
    x, r, w, b = make(rng, (4, 5, 80), dtype)
    xs, rs = x[:, ::-1, ::2], np.asfortranarray(r[..., :40])
    for a in (xs, rs, w, b):
        a.flags.writeable = False
    got = lnfast.add_layer_norm_forward(xs, rs, w[:40], b[:40])
    want = lnfast.add_layer_norm_forward(np.ascontiguousarray(xs),
                                         np.ascontiguousarray(rs), w[:40], b[:40])
    for g, e in zip(got, want):
        assert np.array_equal(g, e) and g.flags.c_contiguous
    dy = rng.standard_normal((4, 5, 80)).astype(dtype)[..., ::2]
    dz = np.asfortranarray(rng.standard_normal((4, 5, 40)).astype(dtype))
    got_b = lnfast.add_layer_norm_backward(dy, got[1][:, ::-1][:, ::-1], got[2], got[3],
                                           w[:40], dz=dz)
    want_b = lnfast.add_layer_norm_backward(np.ascontiguousarray(dy), want[1], want[2],
                                            want[3], w[:40], dz=np.ascontiguousarray(dz))
    for g, e in zip(got_b, want_b):
        assert np.array_equal(g, e)


def test_zero_rows():
    x = np.empty((0, 4, 8), np.float32)
    y, z, mean, rstd = lnfast.add_layer_norm_forward(x, x)
    assert y.shape == z.shape == (0, 4, 8) and mean.shape == (0, 4)
    dsum, dw, db = lnfast.add_layer_norm_backward(x, z, mean, rstd, dz=x)
    assert dsum.shape == (0, 4, 8) and not dw.any() and not db.any()


def test_float32_large_common_offset(rng):
    x = (1e5 + rng.standard_normal((32, 4096))).astype(np.float32)
    r = rng.standard_normal((32, 4096)).astype(np.float32)
    y = lnfast.add_layer_norm_forward(x, r)[0]
    assert ref.rel_error(y, ref.layer_norm_forward(x + r)[0]) <= 1e-6


def test_nan_stays_in_its_row(rng):
    x, r, w, b = make(rng, (5, 30), np.float64)
    r[3, 4] = np.nan
    y, z, mean, rstd = lnfast.add_layer_norm_forward(x, r, w, b)
    assert np.isnan(y[3]).all() and np.isfinite(np.delete(y, 3, 0)).all()
    dsum = lnfast.add_layer_norm_backward(np.ones_like(x), z, mean, rstd, w)[0]
    assert np.isnan(dsum[3]).all() and np.isfinite(np.delete(dsum, 3, 0)).all()


def test_bad_residual_and_dz(rng):
    x, r, w, b = make(rng, (4, 8), np.float64)
    with pytest.raises(ValueError, match="residual"):
        lnfast.add_layer_norm_forward(x, r[:, :7])
    with pytest.raises(TypeError, match="residual"):
        lnfast.add_layer_norm_forward(x, r.astype(np.float32))
    with pytest.raises(TypeError, match="residual"):
        lnfast.add_layer_norm_forward(x, r.tolist())
    for xs in (x, x[:, ::2], x[:0]):       # the one-step path too (contiguous x)
        with pytest.raises(TypeError, match="residual"):
            lnfast.add_layer_norm_forward(xs, None)
    _, z, mean, rstd = lnfast.add_layer_norm_forward(x, r)
    with pytest.raises(ValueError, match="dz"):
        lnfast.add_layer_norm_backward(x, z, mean, rstd, dz=x[:3])
    with pytest.raises(TypeError, match="dz"):
        lnfast.add_layer_norm_backward(x, z, mean, rstd, dz=x.astype(np.float32))
    with pytest.raises(ValueError, match=r"\bz\b"):
        lnfast.add_layer_norm_backward(x, np.ones((4, 0)), mean, rstd)
    with pytest.raises(ValueError, match="mean"):
        lnfast.add_layer_norm_backward(x, z, mean[:2], rstd)
    with pytest.raises(ValueError, match="eps"):
        lnfast.add_layer_norm_forward(x, r, eps=-1.0)
