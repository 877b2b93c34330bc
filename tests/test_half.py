"""float16 and bfloat16 inputs: float32 arithmetic inside, outputs rounded
once to the input dtype, statistics and default gradients in float32."""
import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _cpu, _kernels
from lnfast import reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALVES = [F16, BF16]
UNIT_ROUNDOFF = {F16: 2.0**-11, BF16: 2.0**-8}
# the 16-bit conversion code, best first (_cpu.simd_path)
PATHS = ["best", "avx512", "avx2", "portable"]


def ids(dt):
    return np.dtype(dt).name


# --- the row conversions ------------------------------------------------------

@pytest.fixture(params=PATHS)
def conversion_path(request):
    _cpu.simd_path(request.param)
    yield request.param
    _cpu.simd_path("best")


def widen(a):
    """a as float32, through NumPy.  Every 16-bit pattern includes the
    signalling NaNs, whose conversion raises the invalid flag on some CPUs
    (arm64), which NumPy would report as a warning."""
    with np.errstate(invalid="ignore"):
        return a.astype(np.float32)


def special_floats(rng):
    """float32 values over every exponent, with halfway cases for both types."""
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    halves = np.arange(2**16, dtype=np.uint32)
    f16 = widen(halves.astype(np.uint16).view(np.float16))
    f16 = f16[np.isfinite(f16)]
    ties16 = (f16[:-1] + np.diff(f16) / 2).astype(np.float32)    # exact midpoints
    bf = (halves << 16).view(np.float32)
    bf = bf[np.isfinite(bf)]
    tiesbf = ((halves << 16) | 0x8000).view(np.float32)           # exact midpoints
    tiny = np.array([6.0e-8, 5.96e-8, 2.98e-8, 1e-45, -1e-45, 65504, 65519.99, 65520,
                     3.4e38, np.inf, -np.inf, 0.0, -0.0], np.float32)
    return np.concatenate([x, f16, ties16, tiesbf[np.isfinite(tiesbf)], tiny])


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_narrowing_rounds_to_nearest_even(rng, dtype, conversion_path):
    src = special_floats(rng)
    got = np.empty(src.size, dtype)
    _cpu.convert(src, got)
    with np.errstate(over="ignore"):
        want = src.astype(dtype)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_widening_is_exact(dtype, conversion_path):
    src = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(dtype)
    got = np.empty(src.size, np.float32)
    _cpu.convert(src, got)
    want = widen(src)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_sweeps_convert_like_numpy(rng, dtype, conversion_path):
    # Contiguous 16-bit rows are converted inside the row sweeps.  The fused
    # add's z = x + residual is widened, added in float32 and rounded once:
    # bit for bit NumPy's float32 add and cast, on every 16-bit pattern
    # (NaN aside), sums landing on ties, in the subnormal range and past the
    # largest finite value.
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = bits.view(dtype)
    x = x[np.isfinite(widen(x))]
    for r in (np.zeros_like(x), x[::-1], np.roll(x, 1), x[::7]):
        n = min(x.size, r.size) // 64 * 64
        xs = np.ascontiguousarray(x[:n]).reshape(-1, 64)
        rs = np.ascontiguousarray(r[:n]).reshape(-1, 64)
        with np.errstate(all="ignore"):
            _, z, _, _ = lnfast.add_layer_norm_forward(xs, rs)
            want = (xs.astype(np.float32) + rs.astype(np.float32)).astype(dtype)
        assert np.array_equal(z.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_sweeps_round_like_numpy(rng, dtype, conversion_path):
    # RMSNorm of a row of ones with eps = 0 has rstd = 1, so y = 1 * 1 * w:
    # float32 weights reach the sweeps' narrowing unchanged.  Every exponent,
    # ties of both types, float32 subnormals (which AVX512-BF16 flushes and
    # the sweep must not), overflow: NumPy's cast, bit for bit.
    w = special_floats(rng)
    w = w[: w.size // 64 * 64].reshape(-1, 64)
    ones = np.ones((1, 64), dtype)
    got = np.concatenate([lnfast.rms_norm(ones, row, eps=0.0) for row in w])
    with np.errstate(over="ignore"):
        want = w.astype(dtype)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_nan_stays_nan_and_strided_rows_convert(rng, dtype, conversion_path):
    src = np.array([np.nan, -np.nan, 1.0, 2.5], np.float32)
    got = np.empty(4, dtype)
    _cpu.convert(src, got)
    assert np.isnan(got[:2].astype(np.float32)).all()
    wide = np.zeros(8, dtype)
    _cpu.convert(src, wide[::2])                         # strided destination
    assert np.array_equal(wide[::2].astype(np.float32)[2:], [1.0, 2.5])
    back = np.empty(4, np.float32)
    _cpu.convert(wide[::2], back)                        # strided source
    assert np.array_equal(back[2:], [1.0, 2.5])


# --- every function -----------------------------------------------------------

def make(rng, shape, dtype, wdtype):
    D = shape[-1]
    x = rng.standard_normal(shape).astype(dtype)
    w = (rng.standard_normal(D) + 1).astype(wdtype)
    b = rng.standard_normal(D).astype(wdtype)
    return x, w, b


def check_grads(got, want, dtype, wdtype):
    """dweight/dbias: 1e-4 when float32; one rounding to a 16-bit weight dtype."""
    bar = 1e-4 if wdtype == np.float32 else UNIT_ROUNDOFF[np.dtype(wdtype)]
    for g, w in zip(got, want):
        assert g.dtype == wdtype
        assert ref.rel_error(g, w) <= bar


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
@pytest.mark.parametrize("wkind", ["same", "float32"])
@pytest.mark.parametrize("D", [3, 64, 1000, 4097])
def test_layer_norm(rng, dtype, wkind, D):
    wdtype = dtype if wkind == "same" else np.dtype(np.float32)
    u = UNIT_ROUNDOFF[dtype]
    x, w, b = make(rng, (33, D), dtype, wdtype)
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b)
    assert y.dtype == dtype and mean.dtype == rstd.dtype == np.float32
    ry, rmean, rrstd = ref.layer_norm_forward(x, w, b)
    assert ref.rel_error(y, ry) <= 1.5 * u
    assert ref.rel_error(rstd, rrstd) <= 1e-6
    dy = rng.standard_normal(x.shape).astype(dtype)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    rdx, rdw, rdb = ref.layer_norm_backward(dy, x, rmean, rrstd, w)
    assert dx.dtype == dtype
    assert ref.rel_error(dx, rdx) <= 2 * u
    check_grads((dw, db), (rdw, rdb), dtype, wdtype)


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_rounded_once_from_the_float32_computation(rng, dtype):
    # The 16-bit path is the float32 kernel on the widened rows, rounded once.
    x, w, b = make(rng, (40, 300), dtype, np.float32)
    x32 = x.astype(np.float32)
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b)
    y32, mean32, rstd32 = lnfast.layer_norm_forward(x32, w, b)
    assert np.array_equal(y.view(np.uint16), y32.astype(dtype).view(np.uint16))
    assert np.array_equal(mean, mean32) and np.array_equal(rstd, rstd32)
    dy = rng.standard_normal(x.shape).astype(dtype)
    dx, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    dx32, dw32, db32 = lnfast.layer_norm_backward(dy.astype(np.float32), x32, mean, rstd, w)
    assert np.array_equal(dx.view(np.uint16), dx32.astype(dtype).view(np.uint16))
    assert np.array_equal(dw, dw32) and np.array_equal(db, db32)
    yr = lnfast.rms_norm(x, w)
    assert np.array_equal(yr.view(np.uint16), lnfast.rms_norm(x32, w).astype(dtype).view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
@pytest.mark.parametrize("wkind", ["same", "float32", "none"])
def test_add_layer_norm(rng, dtype, wkind):
    wdtype = {"same": dtype, "float32": np.dtype(np.float32), "none": None}[wkind]
    u = UNIT_ROUNDOFF[dtype]
    x, w, b = make(rng, (21, 512), dtype, wdtype or np.float32)
    if wdtype is None:
        w = b = None
    r = rng.standard_normal(x.shape).astype(dtype)
    y, z, mean, rstd = lnfast.add_layer_norm_forward(x, r, w, b)
    assert y.dtype == z.dtype == dtype and mean.dtype == np.float32
    assert np.array_equal(z.view(np.uint16),
                          (x.astype(np.float32) + r.astype(np.float32)).astype(dtype).view(np.uint16))
    # y normalizes the z that is returned.
    assert np.array_equal(y.view(np.uint16), lnfast.layer_norm(z, w, b).view(np.uint16))
    ry, _, _ = ref.layer_norm_forward(z, w, b)
    assert ref.rel_error(y, ry) <= 1.5 * u
    dy, dz = (rng.standard_normal(x.shape).astype(dtype) for _ in range(2))
    dsum, dw, db = lnfast.add_layer_norm_backward(dy, z, mean, rstd, w, dz=dz)
    _, zm, zr = ref.layer_norm_forward(z, w, b)
    rdsum, rdw, rdb = ref.add_layer_norm_backward(dy, z, zm, zr, w, dz)
    assert dsum.dtype == dtype and ref.rel_error(dsum, rdsum) <= 2 * u
    check_grads((dw, db), (rdw, rdb), dtype, wdtype or np.dtype(np.float32))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
@pytest.mark.parametrize("wkind", ["same", "float32", "none"])
def test_rms_norm(rng, dtype, wkind):
    wdtype = {"same": dtype, "float32": np.dtype(np.float32), "none": None}[wkind]
    u = UNIT_ROUNDOFF[dtype]
    x = rng.standard_normal((25, 768)).astype(dtype)
    w = None if wdtype is None else (rng.standard_normal(768) + 1).astype(wdtype)
    y, rstd = lnfast.rms_norm_forward(x, w)
    assert y.dtype == dtype and rstd.dtype == np.float32
    ry, rrstd = ref.rms_norm_forward(x, w)
    assert ref.rel_error(y, ry) <= 1.5 * u
    dy = rng.standard_normal(x.shape).astype(dtype)
    dx, dw = lnfast.rms_norm_backward(dy, x, rstd, w)
    rdx, rdw = ref.rms_norm_backward(dy, x, rrstd, w)
    assert ref.rel_error(dx, rdx) <= 2 * u
    check_grads((dw,), (rdw,), dtype, wdtype or np.dtype(np.float32))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_strided_and_in_place(rng, dtype):
    base = rng.standard_normal((8, 3, 128)).astype(dtype)
    x = base[::-1, :, ::2]
    w = rng.standard_normal(64).astype(np.float32)
    want = lnfast.layer_norm(np.ascontiguousarray(x), w)
    assert np.array_equal(lnfast.layer_norm(x, w).view(np.uint16), want.view(np.uint16))
    lnfast.layer_norm(x, w, out=x)
    assert np.array_equal(x.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_16bit_weights_of_any_layout(rng, dtype):
    # Weights of the input's dtype are widened by the row conversions:
    # strided, reversed, broadcast and unaligned ones give the bytes of a
    # contiguous copy, forward and backward.
    D = 37
    x = rng.standard_normal((5, D)).astype(dtype)
    base = rng.standard_normal(3 * D).astype(dtype)
    buf = np.zeros(2 * D + 1, np.uint8)
    unaligned = np.frombuffer(buf.data, dtype, D, offset=1)
    unaligned[...] = base[:D]
    y, mean, rstd = lnfast.layer_norm_forward(x)
    for w in (base[::2][:D], base[::-1][:D], np.broadcast_to(base[0], (D,)), unaligned):
        c = np.ascontiguousarray(w)
        got = [lnfast.layer_norm(x, w, w), *lnfast.layer_norm_backward(x, x, mean, rstd, w)]
        want = [lnfast.layer_norm(x, c, c), *lnfast.layer_norm_backward(x, x, mean, rstd, c)]
        assert all(np.array_equal(g.view(np.uint16), v.view(np.uint16))
                   for g, v in zip(got, want))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_16bit_weights_act_as_their_float32_values(rng, dtype, threads, layout):
    # Each thread widens 16-bit weight and bias for itself: y, z and dx have
    # the bytes they have with the float32 weights of the same values, on
    # one thread and on three, with weight and bias 16-bit or one of each.
    lnfast.set_num_threads(threads)
    x = rng.standard_normal((64, 4096)).astype(dtype)
    r, dy = (rng.standard_normal(x.shape).astype(dtype) for _ in range(2))
    if layout == "strided":
        x, r, dy = (np.repeat(a, 2, axis=1)[:, ::2] for a in (x, r, dy))
    w16, b16 = ((rng.standard_normal(4096) + 1).astype(dtype) for _ in range(2))
    w32, b32 = w16.astype(np.float32), b16.astype(np.float32)

    def outputs(w, b):
        y, mean, rstd = lnfast.layer_norm_forward(x, w, b)
        fused = lnfast.add_layer_norm_forward(x, r, w, b)
        ry, rrstd = lnfast.rms_norm_forward(x, w)
        return (y, lnfast.layer_norm_backward(dy, x, mean, rstd, w)[0],
                *fused[:2], lnfast.add_layer_norm_backward(dy, fused[1], *fused[2:], w, dz=dy)[0],
                ry, lnfast.rms_norm_backward(dy, x, rrstd, w)[0])

    want = outputs(w32, b32)
    for w, b in ((w16, b16), (w16, b32), (w32, b16)):
        for g, v in zip(outputs(w, b), want):
            assert g.view(np.uint16).tobytes() == v.view(np.uint16).tobytes()


def test_overflow_gives_inf_in_that_row_only():
    x = np.tile(np.array([1, -1], np.float16), (3, 32))    # xhat = +-1 everywhere
    x[1, 0] = 40                                  # row 1: one xhat near 7.9
    w = np.full(64, 30000, np.float16)            # 7.9 * 30000 > 65504
    y = lnfast.layer_norm(x, w).astype(np.float32)
    assert np.isinf(y[1, 0]) and np.isfinite(y[1, 1:]).all()
    assert np.isfinite(y[[0, 2]]).all()
    # z = x + residual past the maximum: that row's z is inf and its y NaN.
    big = np.zeros((3, 16), np.float16)
    big[2] = 60000
    y, z, _, _ = lnfast.add_layer_norm_forward(big, big)
    assert np.isinf(z[2].astype(np.float32)).all() and np.isnan(y[2].astype(np.float32)).all()
    assert np.isfinite(y[:2].astype(np.float32)).all()


# Not bfloat16 with eps=0: its subnormals are float32 subnormals, and their
# rstd (~1e39) is past float32's range, as for float32 data (docs/api.md).
@pytest.mark.parametrize("dtype,eps", [(F16, 1e-5), (F16, 0.0), (BF16, 1e-5)],
                         ids=["float16", "float16-eps0", "bfloat16"])
def test_subnormal_inputs(rng, dtype, eps):
    tiny = float((ml_dtypes.finfo if dtype == BF16 else np.finfo)(dtype).smallest_normal)
    x = (rng.standard_normal((6, 256)) * tiny / 8).astype(dtype)
    assert (np.abs(x.astype(np.float32)) < tiny).all() and (x.astype(np.float32) != 0).any()
    u = UNIT_ROUNDOFF[dtype]
    y = lnfast.layer_norm(x, eps=eps)
    assert ref.rel_error(y, ref.layer_norm_forward(x, eps=eps)[0]) <= 1.5 * u
    yr = lnfast.rms_norm(x, eps=eps)
    assert ref.rel_error(yr, ref.rms_norm_forward(x, eps=eps)[0]) <= 1.5 * u


def test_bad_16bit_combinations(rng):
    x = rng.standard_normal((2, 8)).astype(np.float16)
    with pytest.raises(TypeError, match="weight"):
        lnfast.layer_norm(x, np.ones(8, BF16))          # neither x's dtype nor float32
    with pytest.raises(TypeError, match="weight"):
        lnfast.layer_norm(x, np.ones(8, np.float64))
    with pytest.raises(TypeError, match="dy"):
        _, m, r = lnfast.layer_norm_forward(x)
        lnfast.layer_norm_backward(x.astype(BF16), x, m, r)
    with pytest.raises(TypeError, match="out"):
        lnfast.layer_norm(x, out=np.empty((2, 8), np.float32))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_gradients_round_once(rng, dtype):
    # float64 dweight/dbias -> 16 bits in one rounding: the float64 value's
    # own nearest (ties to even), never float32's nearest and then the 16-bit
    # type's.  Values next to every tie, in the subnormal range and past the
    # largest finite value.
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):                        # the NaN patterns
        vals = bits.view(dtype).astype(np.float64)
    keep = np.isfinite(vals) & ~((vals == 0) & (bits != 0))   # one zero
    order = np.argsort(vals[keep])
    grid, gbits = vals[keep][order], bits[keep][order]
    mids = (grid[:-1] + grid[1:]) / 2                         # exact ties
    a = np.concatenate([
        rng.standard_normal(20_000) * 10.0 ** rng.integers(-40, 38, 20_000),
        mids, mids + np.abs(mids) * 2.0**-40, mids - np.abs(mids) * 2.0**-40])
    a = a[(a > grid[0]) & (a < grid[-1])]
    hi = np.searchsorted(grid, a)                             # grid[hi - 1] < a <= grid[hi]
    dlo, dhi = a - grid[hi - 1], grid[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (gbits[hi] % 2 == 0))
    want = np.where(pick_hi, grid[hi], grid[hi - 1])
    got = _cpu.round_sums(a, dtype).astype(np.float64)
    assert np.array_equal(got, want)
    special = _cpu.round_sums(np.array([np.nan, np.inf, -np.inf, 1e39, -1e39, -0.0]), dtype)
    assert np.isnan(special[0])
    assert list(special[1:5].astype(np.float64)) == [np.inf, -np.inf, np.inf, -np.inf]
    assert np.signbit(special[5])


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
@pytest.mark.parametrize("wkind", ["same", "float32"])
@pytest.mark.parametrize("M", [1, 16, 300])
def test_dweight_dbias_are_the_rounded_float64_sums(rng, dtype, wkind, M):
    # dweight/dbias come back as the kernel's float64 sums (asked for with a
    # float64 output) rounded once to the weight's dtype, bit for bit; up to
    # 16 rows (one float32 run) they are rounded from the run itself.
    x, w, _ = make(rng, (M, 77), dtype, np.float32)
    dy = rng.standard_normal(x.shape).astype(dtype)
    _, mean, rstd = lnfast.layer_norm_forward(x, w)
    wd = w.astype(dtype) if wkind == "same" else w
    _, dw, db = lnfast.layer_norm_backward(dy, x, mean, rstd, wd)
    dx = np.empty_like(x)
    sums = np.empty((2, 77))
    _cpu.backward(dy, x, None, mean, rstd, wd.astype(np.float32), dx, sums,
                  _kernels.num_chunks(M, 77), True, 1)
    if wkind == "same":
        want = _cpu.round_sums(sums, dtype)
    else:
        want = sums.astype(np.float32)
    assert dw.dtype == db.dtype == wd.dtype
    bits = np.uint16 if wkind == "same" else np.uint32
    assert np.array_equal(dw.view(bits), want[0].view(bits))
    assert np.array_equal(db.view(bits), want[1].view(bits))


@pytest.mark.parametrize("dtype", HALVES, ids=ids)
def test_nan_payloads_are_the_same_on_every_path(dtype):
    # Every NaN bit pattern, through the fused add's z (rounded to the input
    # dtype inside the sweeps) and through a strided out= (the row
    # conversions): the same bytes whichever conversion code runs.
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        nans = bits[np.isnan(bits.view(dtype).astype(np.float32))]
    x = np.ones((nans.size // 32 + 1) * 32, np.uint16)
    x[:nans.size] = nans
    x = x.view(dtype).reshape(-1, 32)
    got = []
    for path in PATHS:
        _cpu.simd_path(path)
        try:
            z = lnfast.add_layer_norm_forward(x, np.zeros_like(x))[1]
            strided = np.zeros((x.shape[0], 64), dtype)[:, ::2]
            lnfast.layer_norm(x, out=strided)
            got += [z.view(np.uint16), np.ascontiguousarray(strided).view(np.uint16),
                    lnfast.layer_norm(x).view(np.uint16)]
        finally:
            _cpu.simd_path("best")
    assert all(np.array_equal(g, got[0]) for g in got[::3])
    assert all(np.array_equal(g, got[1]) for g in got[1::3] + got[2::3])
    with np.errstate(invalid="ignore"):
        assert np.isnan(got[0].view(dtype).astype(np.float32).ravel()[:nans.size]).all()
