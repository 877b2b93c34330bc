"""The row statistics' accuracy where it is hardest for a one-pass sum:
rows whose first values lie several deviations from the mean, short rows,
and both kernels (rows side by side in memory; channels-first rows far
apart, taken by tiles).  rstd against an exact reference (mpmath), in units
in the last place of the result's dtype."""
import math

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


def exact_rms_rstd(rows):
    """1/sqrt(mean(x^2)) of each float64 row (eps = 0): every square split
    exactly into two float64 values (Veltkamp), their sum taken exactly
    as hi + lo by math.fsum, the root in mpmath."""
    mpmath.mp.dps = 40
    out = []
    for row in rows:
        c = 134217729.0 * row
        hi_part = c - (c - row)
        lo_part = row - hi_part
        p = row * row
        e = ((hi_part * hi_part - p) + 2 * hi_part * lo_part) + lo_part * lo_part
        terms = list(p) + list(e)
        hi = math.fsum(terms)
        lo = math.fsum(terms + [-hi])
        out.append(1 / mpmath.sqrt((mpmath.mpf(hi) + mpmath.mpf(lo)) / len(row)))
    return out


@pytest.mark.parametrize("kernel", ["rows", "tiles"])
@pytest.mark.parametrize("D", [1024, 1152, 5000, 10000, 16384])
def test_float64_rms_long_rows_of_nearly_equal_squares(kernel, D):
    # every square within a few units of rounding of 1e32: one long running
    # sum per lane rounds the same way at every step (9.9 ulp at D = 10000,
    # 14.9 through the tiles at 16384); the sums' upper levels keep each
    # running sum short
    rng = np.random.default_rng(D)
    rows = 1e16 + 4 * rng.standard_normal((32, D))
    if kernel == "rows":
        got = lnfast.rms_norm_forward(rows, eps=0.0)[1]
    else:
        x = np.ascontiguousarray(rows.T[None])     # (1, D, 32) over axis 1
        got = lnfast.rms_norm_forward(x, eps=0.0, axis=1)[1].ravel()
    assert ulps(got, exact_rms_rstd(rows), np.float64).max() <= 2.5


def documented_sum(terms, lanes, block, group, mid):
    """The float64 sum of each row of `terms` in the order api.md
    ("Numerics") and rowops.h give: lane k takes blocks of `block` terms
    k, k + lanes, ...; block sums are added from zero into groups of
    `group`, groups from zero into mid levels of `mid`, mid levels into the
    lane; then single vectors into the lanes, the lanes folded pairwise,
    the tail (n % lanes terms) added last.  Tiles have one lane, and a
    row's last block may be short (zeros added to it change no bits)."""
    if lanes == 1:
        terms = np.pad(terms, ((0, 0), (0, -terms.shape[1] % block)))
    n, D = terms.shape
    acc = np.zeros((n, lanes))
    step = lanes * block
    full = D // step
    for m0 in range(0, full, group * mid):
        mids = np.zeros((n, lanes))
        for g0 in range(m0, min(full, m0 + group * mid), group):
            grp = np.zeros((n, lanes))
            for s in range(g0, min(full, g0 + group)):
                i = s * step
                blk = terms[:, i:i + lanes].copy()
                for j in range(1, block):
                    blk += terms[:, i + j * lanes:i + (j + 1) * lanes]
                grp += blk
            mids += grp
        acc += mids
    i = full * step
    if lanes > 1:
        for i in range(i, D - lanes + 1, lanes):
            acc += terms[:, i:i + lanes]
        i = full * step + (D - full * step) // lanes * lanes
        h = lanes // 2
        while h:
            acc[:, :h] += acc[:, h:2 * h]
            h //= 2
    tail = np.zeros(n)
    for j in range(i, D):
        tail += terms[:, j]
    return acc[:, 0] + tail


@pytest.mark.parametrize("path", ["best", "avx2", "portable"])
def test_float64_sums_follow_the_documented_order(path):
    # the bits of every instruction set, at the sizes where a group, a mid
    # level or a row's short path ends; RMSNorm with eps = 0: rstd =
    # 1/sqrt(sum(x^2)/D) in float64
    from lnfast import _cpu
    rng = np.random.default_rng(11)
    try:
        _cpu.simd_path(path)
        for D in (100, 1087, 1088, 1151, 1152, 1216, 2048, 16384, 16448, 17472, 33000):
            rows = 7 + 1e3 * rng.standard_normal((16, D))
            want = 1.0 / np.sqrt(documented_sum(rows * rows, 16, 4, 16, 16) / D)
            assert np.array_equal(lnfast.rms_norm_forward(rows, eps=0.0)[1], want), D
        for D in (32, 544, 545, 576, 1000, 4096):
            rows = 7 + 1e3 * rng.standard_normal((16, D))
            want = 1.0 / np.sqrt(documented_sum(rows * rows, 1, 4, 8, 16) / D)
            x = np.ascontiguousarray(rows.T[None])      # tiles: (1, D, 16) over axis 1
            assert np.array_equal(lnfast.rms_norm_forward(x, eps=0.0, axis=1)[1].ravel(),
                                  want), D
    finally:
        _cpu.simd_path("best")
