"""The float64 reference itself: finite differences and the explicit Jacobian."""
import numpy as np
import pytest

from lnfast import reference as ref


@pytest.mark.parametrize("D", [1, 2, 3, 7, 16])
def test_reference_backward_matches_finite_differences(rng, D):
    x = rng.standard_normal((3, D))
    w, b = rng.standard_normal(D), rng.standard_normal(D)
    dy = rng.standard_normal((3, D))
    eps = 1e-3

    def loss_x(xv):
        return np.sum(dy * ref.layer_norm_forward(xv, w, b, eps)[0])

    def loss_w(wv):
        return np.sum(dy * ref.layer_norm_forward(x, wv, b, eps)[0])

    def loss_b(bv):
        return np.sum(dy * ref.layer_norm_forward(x, w, bv, eps)[0])

    _, mean, rstd = ref.layer_norm_forward(x, w, b, eps)
    dx, dw, db = ref.layer_norm_backward(dy, x, mean, rstd, w)
    assert np.allclose(dx, ref.finite_difference(loss_x, x), rtol=1e-6, atol=1e-8)
    assert ref.rel_error(dw, ref.finite_difference(loss_w, w)) <= 1e-7
    assert ref.rel_error(db, ref.finite_difference(loss_b, b)) <= 1e-7


@pytest.mark.parametrize("D", [3, 5, 33])
def test_dx_is_g_times_jacobian(rng, D):
    x = rng.standard_normal(D) * 3 + 1
    w = rng.standard_normal(D)
    dy = rng.standard_normal(D)
    J = ref.layer_norm_jacobian(x)
    assert np.allclose(J, J.T)
    _, mean, rstd = ref.layer_norm_forward(x)
    dx = ref.layer_norm_backward(dy, x, mean, rstd, w)[0]
    assert ref.rel_error(dx, (dy * w) @ J) <= 1e-13


def test_jacobian_matches_finite_differences(rng):
    x = rng.standard_normal(6)
    J = ref.layer_norm_jacobian(x)
    for i in range(6):
        col = ref.finite_difference(lambda v: ref.layer_norm_forward(v)[0][i], x)
        assert np.allclose(J[i], col, atol=1e-7)


def test_weight_is_inside_the_row_sums(rng):
    # Pulling a vector weight out of the sums gives a different (wrong) dx.
    x, dy = rng.standard_normal(4), rng.standard_normal(4)
    w = np.array([1.0, 2.0, 3.0, 4.0])
    _, mean, rstd = ref.layer_norm_forward(x)
    right = ref.layer_norm_backward(dy, x, mean, rstd, w)[0]
    wrong = w * ref.layer_norm_backward(dy, x, mean, rstd)[0]
    assert not np.allclose(right, wrong)
    assert np.allclose(right, (dy * w) @ ref.layer_norm_jacobian(x))


def test_rel_error_never_passes_nan():
    assert not ref.rel_error([np.nan, 1.0], [1.0, 1.0]) <= 1.0
