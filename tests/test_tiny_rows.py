"""dweight and dbias of rows whose values are tiny: deviations from the mean,
or terms dy * xhat, below the smallest normal number of the type.  Checked
against an exact reference (mpmath at 256 bits): the error may be the
rounding of the result to its type (a subnormal dweight keeps few digits)
plus a few units of rounding of the summands, as on ordinary data."""
import mpmath
import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _cpu

BF16 = np.dtype(ml_dtypes.bfloat16)
UNIT = {np.dtype(np.float32): 2.0**-24, np.dtype(np.float64): 2.0**-53, BF16: 2.0**-24}
# Half the smallest spacing of the result's type: the unit of rounding of a
# subnormal summand.
FLOOR = {np.dtype(np.float32): mpmath.mpf(2) ** -150, np.dtype(np.float64): mpmath.mpf(2) ** -1075}
# Allowed error in units of rounding of the summands (each |term| times the
# unit, or FLOOR for subnormal terms), beyond half a unit in the last place
# of the result.  Ordinary
# rows come to 2-4; rows of tiny values came to 50-2000 before they were
# redone in float64.
UNITS = 12


def exact_grads(dy, x, eps, centered, dtype):
    """Exact dweight and dbias per column, and the sums of their terms'
    units of rounding in `dtype` (UNIT, FLOOR), as mpf."""
    u, floor = UNIT[np.dtype(dtype)], FLOOR[np.dtype(dtype)]
    mpmath.mp.prec = 256
    M, D = x.shape
    dw = [mpmath.mpf(0)] * D
    db = [mpmath.mpf(0)] * D
    ab = [mpmath.mpf(0)] * D
    abb = [mpmath.mpf(0)] * D
    for r in range(M):
        xs = [mpmath.mpf(float(v)) for v in x[r]]
        m = sum(xs) / D if centered else mpmath.mpf(0)
        var = sum((v - m) ** 2 for v in xs) / D
        rs = 1 / mpmath.sqrt(var + mpmath.mpf(eps))
        for j in range(D):
            t = mpmath.mpf(float(dy[r, j])) * (xs[j] - m) * rs
            dw[j] += t
            ab[j] += max(u * abs(t), floor)
            db[j] += mpmath.mpf(float(dy[r, j]))
            abb[j] += max(u * abs(mpmath.mpf(float(dy[r, j]))), floor)
    return dw, db, ab, abb


def half_ulp(v, dtype):
    """Half the spacing of `dtype` at v (subnormal spacing included), exact."""
    f = np.abs(np.float64(abs(float(v))).astype(dtype))
    return mpmath.mpf(float(np.spacing(f.astype(np.float32) if dtype == BF16 else f))) / 2


def check(got, exact, units, dtype):
    for j, (g, e, s) in enumerate(zip(got, exact, units)):
        assert np.isfinite(float(g)), j
        err = abs(mpmath.mpf(float(g)) - e)
        assert err <= half_ulp(e, dtype) + UNITS * s, (j, float(g), float(e), float(err / s))


def tiny_rows(rng, shape, scale, dtype):
    return (rng.standard_normal(shape) * scale).astype(dtype)


CASES = [  # (dtype, scale of x, scale of dy)
    (np.float32, 1e-40, 1.0),
    (np.float32, 1e-44, 1.0),
    (np.float32, 1e-36, 1.0),
    (np.float32, 1.0, 1e-40),
    (np.float32, 1.0, 1.0),       # ordinary rows: the same bound holds
    (np.float64, 1e-310, 1.0),
    (np.float64, 1e-320, 1.0),
    (np.float64, 1.0, 1e-315),
    (np.float64, 1.0, 1.0),
    (BF16, 1e-39, 1.0),
]


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows", [4, 40, 150])      # one run; runs and chunks
@pytest.mark.parametrize("dtype,xs,dys", CASES)
def test_dweight_of_tiny_rows_is_exact_to_rounding(rng, dtype, xs, dys, rows, centered):
    D = 24
    x = tiny_rows(rng, (rows, D), xs, dtype)
    dy = tiny_rows(rng, (rows, D), dys, dtype)
    w = None if dtype == BF16 else np.ones(D, dtype)
    if centered:
        y, mean, rstd = lnfast.layer_norm_forward(x, w)
        dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    else:
        y, rstd = lnfast.rms_norm_forward(x, w)
        dx, dw = lnfast.rms_norm_backward(dy, x, rstd, w)
    out = np.float32 if dtype == BF16 else dtype
    ex_dw, ex_db, ab, abb = exact_grads(dy.astype(np.float64), x.astype(np.float64), 1e-5,
                                        centered, out)
    check(dw, ex_dw, ab, out)
    if centered:
        check(db, ex_db, abb, out)


@pytest.mark.parametrize("dtype,xs", [(np.float32, 1e-40), (np.float64, 1e-310)])
def test_tiny_rows_take_every_route_to_the_same_bits(rng, dtype, xs):
    """Tiny rows among ordinary ones, through the pipelined rows, the
    gathered (strided) rows, the fused add's dz, and rows summed by column
    blocks on 1-3 threads: the same bits, and exact to rounding; by tiles
    (Fortran order: rows far apart, neighbours adjacent) exact to rounding
    too."""
    M, D = 70, 40
    x = rng.standard_normal((M, D)).astype(dtype)
    x[::3] *= xs
    dy = rng.standard_normal((M, D)).astype(dtype)
    y, mean, rstd = lnfast.layer_norm_forward(x)
    ref = lnfast.layer_norm_backward(dy, x, mean, rstd)

    def every_other(a):
        v = np.empty((M, 2 * D), dtype)[:, ::2]
        v[...] = a
        return v
    strided = lnfast.layer_norm_backward(every_other(dy), every_other(x), mean, rstd)
    for a, b in zip(ref, strided):
        np.testing.assert_array_equal(a, b)
    ex_dw, _, ab, _ = exact_grads(dy.astype(np.float64), x.astype(np.float64), 1e-5, True, dtype)
    tiles = lnfast.layer_norm_backward(np.asfortranarray(dy), np.asfortranarray(x), mean, rstd)
    check(tiles[1], ex_dw, ab, dtype)
    old = _cpu.blocked_settings(0, 16)     # (summed by blocks: bits of their own)
    try:
        blocked = []
        for n in (1, 2, 3):
            lnfast.set_num_threads(n)
            blocked.append(lnfast.layer_norm_backward(dy, x, mean, rstd))
    finally:
        _cpu.blocked_settings(*old)
        lnfast.set_num_threads(None)
    for got in blocked[1:]:
        for a, b in zip(blocked[0], got):
            np.testing.assert_array_equal(a, b)
    check(blocked[0][1], ex_dw, ab, dtype)
    check(ref[1], ex_dw, ab, dtype)
    dz = rng.standard_normal((M, D)).astype(dtype)
    dsum, dw2, db2 = lnfast.add_layer_norm_backward(dy, x, mean, rstd, dz=dz)
    np.testing.assert_allclose(dsum, ref[0].astype(np.float64) + dz, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(dw2, ref[1])
    np.testing.assert_array_equal(db2, ref[2])
