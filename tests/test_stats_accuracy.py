"""The row statistics' accuracy where it is hardest for a one-pass sum:
rows whose first values lie several deviations from the mean, short rows,
and both kernels (rows side by side in memory; channels-first rows far
apart, taken by tiles).  rstd against an exact reference (mpmath), in units
in the last place of the result's dtype."""
import mpmath
import numpy as np
import pytest

import lnfast

EPS = 1e-5


def exact_rstd(rows):
    """1/sqrt(var + EPS) of each row, from 40-digit sums, as float64."""
    mpmath.mp.dps = 40
    out = []
    for row in rows.astype(np.float64):
        v = [mpmath.mpf(float(t)) for t in row]
        m = mpmath.fsum(v) / len(v)
        var = mpmath.fsum((t - m) ** 2 for t in v) / len(v)
        out.append(1 / mpmath.sqrt(var + mpmath.mpf(EPS)))
    return out


def ulps(got, exact, dtype):
    """|got - exact| in units of the last place of `dtype` at exact."""
    spacing = [float(np.spacing(dtype(float(e)))) for e in exact]
    return np.array([float(abs(mpmath.mpf(float(g)) - e)) / s
                     for g, e, s in zip(got, exact, spacing)])


def hard_rows(rng, n, D, z, k, dtype):
    """n rows of D normal values, the first k moved to z deviations from
    the rest's mean, alternately above and below: the values a one-pass sum
    about the first values cancels worst."""
    rows = rng.standard_normal((n, D))
    rest = rows[:, k:]
    sign = np.where(np.arange(n) % 2 == 0, 1.0, -1.0)[:, None]
    rows[:, :k] = rest.mean(1)[:, None] + z * sign * rest.std(1)[:, None]
    return rows.astype(dtype)


def rstd_of(rows, kernel):
    """rstd of each row through the row kernels, or through the tile
    kernels (the rows as the channels of a channels-first array)."""
    if kernel == "rows":
        return lnfast.layer_norm_forward(rows)[2]
    n, D = rows.shape
    x = np.ascontiguousarray(rows.reshape(n // 32, 32, D).transpose(0, 2, 1))
    return lnfast.layer_norm_forward(x, axis=1)[2].reshape(n)


# float32 (and float16/bfloat16, which compute as float32): the float64
# statistics of float32 sums land within a few rounding steps of the
# exact rstd; float64 within a few of its own.
BOUND = {np.float32: 2.5, np.float64: 5.0}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel", ["rows", "tiles"])
@pytest.mark.parametrize("D", [3, 8, 16, 33, 64, 96, 768])
@pytest.mark.parametrize("z", [0.0, 1.5, 2.6, 3.9])
@pytest.mark.parametrize("k", [1, 4])
def test_rstd_within_a_few_ulps(dtype, kernel, D, z, k):
    rng = np.random.default_rng([D, int(10 * z), k])
    rows = hard_rows(rng, 64, D, z, min(k, D - 1), dtype)
    got = rstd_of(rows, kernel)
    err = ulps(got, exact_rstd(rows), dtype)
    assert err.max() <= BOUND[dtype], (err.max(), int(err.argmax()))


@pytest.mark.parametrize("kernel", ["rows", "tiles"])
def test_one_value_far_off(kernel):
    # 4095 ones after one -2**-12: the shift's mean lies far from the row's,
    # and the row is summed again about its mean
    rows = np.ones((32, 4096), np.float32)
    rows[:, 0] = -(2.0 ** -12)
    got = rstd_of(rows, kernel)
    assert ulps(got, exact_rstd(rows[:1]) * 32, np.float32).max() <= 1.0


@pytest.mark.parametrize("kernel", ["rows", "tiles"])
def test_large_common_offset(kernel):
    # differences from a shift near the values are exact: the offset costs
    # nothing
    rng = np.random.default_rng(3)
    rows = (1e5 + rng.standard_normal((64, 96))).astype(np.float32)
    got = rstd_of(rows, kernel)
    assert ulps(got, exact_rstd(rows), np.float32).max() <= BOUND[np.float32]
