"""Every function on CuPy arrays, against the float64 reference and the CPU
kernels, on the CPU tests' cases.  Skipped where CuPy finds no GPU."""
import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import reference as ref
from tests.helpers import (BACKWARD_TOL, DTYPES, FORWARD_TOL, REDO_ROWS, TINY_SPREAD_ROWS,
                           UNDERFLOWED_PRODUCT_ROWS, assert_backward_exact,
                           assert_dx_within_its_terms, assert_tiny_spread_row_exact,
                           assert_underflowed_products_redone, dx_of_rows_with_bad_dy,
                           exact_backward, float64_rows_near_the_top, float64_rows_of_tiny_terms)

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def gpu(*arrays):
    return [None if a is None else cp.asarray(a) for a in arrays]


def host(*arrays):
    return [cp.asnumpy(a) for a in arrays]


def check_device_results(*arrays):
    for a in arrays:
        assert isinstance(a, cp.ndarray) and a.flags.c_contiguous


def make(rng, shape, dtype):
    D = shape[-1]
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    w = (rng.standard_normal(D) + 1).astype(dtype)
    b = rng.standard_normal(D).astype(dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 3, 7, 8, 64, 768, 4097, 16384])
def test_layer_norm_matches_reference_and_cpu(rng, dtype, D):
    x, w, b = make(rng, (19, D), dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    gx, gw, gb, gdy = gpu(x, w, b, dy)
    y, mean, rstd = lnfast.layer_norm_forward(gx, gw, gb)
    check_device_results(y, mean, rstd)
    ry, rmean, rrstd = ref.layer_norm_forward(x, w, b)
    for got, want in zip(host(y, mean, rstd), (ry, rmean, rrstd)):
        assert ref.rel_error(got, want) <= FORWARD_TOL[dtype]
    cpu = lnfast.layer_norm_forward(x, w, b)
    assert ref.rel_error(host(y)[0], cpu[0]) <= FORWARD_TOL[dtype]
    assert cp.array_equal(lnfast.layer_norm(gx, gw, gb), y)

    dx, dw, db = lnfast.layer_norm_backward(gdy, gx, mean, rstd, gw)
    check_device_results(dx, dw, db)
    rdx, rdw, rdb = ref.layer_norm_backward(dy, x, rmean, rrstd, w)
    for got, want in zip(host(dx, dw, db), (rdx, rdw, rdb)):
        if D > 2 or want is not rdx:
            assert ref.rel_error(got, want) <= BACKWARD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 7, 768, 4097, 16384])
def test_add_layer_norm_matches_cpu(rng, dtype, D):
    x, w, b = make(rng, (13, D), dtype)
    r, dy, dz = (rng.standard_normal(x.shape).astype(dtype) for _ in range(3))
    gx, gr, gw, gb, gdy, gdz = gpu(x, r, w, b, dy, dz)
    y, z, mean, rstd = lnfast.add_layer_norm_forward(gx, gr, gw, gb)
    check_device_results(y, z, mean, rstd)
    assert cp.array_equal(z, gx + gr)
    ry, _, _, _ = ref.add_layer_norm_forward(x, r, w, b)
    assert ref.rel_error(host(y)[0], ry) <= FORWARD_TOL[dtype]
    dsum, dw, db = lnfast.add_layer_norm_backward(gdy, z, mean, rstd, gw, dz=gdz)
    zh = host(z)[0]
    _, zm, zr = ref.layer_norm_forward(zh, w, b)
    want = ref.add_layer_norm_backward(dy, zh, zm, zr, w, dz)
    for got, exp in zip(host(dsum, dw, db), want):
        assert ref.rel_error(got, exp) <= BACKWARD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 3, 768, 4097, 16384])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_reference(rng, dtype, D, with_weight):
    x, w, _ = make(rng, (11, D), dtype)
    w = w if with_weight else None
    dy = rng.standard_normal(x.shape).astype(dtype)
    gx, gw, gdy = gpu(x, w, dy)
    y, rstd = lnfast.rms_norm_forward(gx, gw)
    ry, rrstd = ref.rms_norm_forward(x, w)
    assert ref.rel_error(host(y)[0], ry) <= FORWARD_TOL[dtype]
    assert cp.array_equal(lnfast.rms_norm(gx, gw), y)
    dx, dw = lnfast.rms_norm_backward(gdy, gx, rstd, gw)
    rdx, rdw = ref.rms_norm_backward(dy, x, rrstd, w)
    if D > 1:
        assert ref.rel_error(host(dx)[0], rdx) <= BACKWARD_TOL[dtype]
    assert ref.rel_error(host(dw)[0], rdw) <= BACKWARD_TOL[dtype]


# The same non-contiguous views of a (6, 5, 80) array, for NumPy and CuPy.
VIEWS = {
    "every other element": lambda a: a[:, :, ::2],
    "negative strides": lambda a: a[::-1, :, ::-2],
    "transposed leading axes": lambda a: a[..., :40].transpose(1, 0, 2).copy().transpose(1, 0, 2),
    "feature axis transposed": lambda a: a[..., :40].transpose(2, 0, 1).copy().transpose(1, 2, 0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_strided_inputs(rng, dtype, view):
    base = rng.standard_normal((6, 5, 80)).astype(dtype)
    dy = rng.standard_normal((6, 5, 40)).astype(dtype)
    w = rng.standard_normal(40).astype(dtype)
    x, gx = VIEWS[view](base), VIEWS[view](cp.asarray(base))
    got = lnfast.layer_norm_forward(gx, cp.asarray(w))
    same = lnfast.layer_norm_forward(cp.ascontiguousarray(gx), cp.asarray(w))
    cpu = lnfast.layer_norm_forward(x, w)
    for g, s, c in zip(got, same, cpu):
        # Bits may differ from the contiguous copy: its rows take 16-byte loads.
        assert ref.rel_error(host(g)[0], host(s)[0]) <= FORWARD_TOL[dtype]
        assert ref.rel_error(host(g)[0], c) <= FORWARD_TOL[dtype]
    back = lnfast.layer_norm_backward(cp.asarray(dy), gx, got[1], got[2], cp.asarray(w))
    cpu_back = lnfast.layer_norm_backward(dy, x, cpu[1], cpu[2], w)
    for g, c in zip(back, cpu_back):
        assert ref.rel_error(host(g)[0], c) <= BACKWARD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_common_offset(rng, dtype):
    x = (1e5 + rng.standard_normal((8, 4096))).astype(dtype)
    y = lnfast.layer_norm(cp.asarray(x))
    assert ref.rel_error(host(y)[0], ref.layer_norm_forward(x)[0]) <= 1e-6


def test_rows_far_from_their_first_value_or_with_a_large_offset(rng):
    # The kernels' sums run about each row's first value; float64 rows far
    # from it are summed again, and the float64 mean keeps its rounding
    # error as lo (as on the CPU).
    x = rng.standard_normal((4, 1024))
    x[0], x[0, 0] = 1.0, -2.0**-12
    x[1, 0] = 3.0
    x[2:] = 1e4 + 1e-2 * x[2:]
    for dtype, tol in ((np.float32, 2e-7), (np.float64, 1e-14)):
        xd = x.astype(dtype)
        y, _, rstd = lnfast.layer_norm_forward(cp.asarray(xd), eps=0.0)
        ry, _, rrstd = ref.layer_norm_forward(xd, eps=0.0)
        assert ref.rel_error(host(y)[0], ry) <= tol
        assert ref.rel_error(host(rstd)[0], rrstd) <= tol


def test_float32_rows_past_float32s_range_match_the_cpu():
    # Deviations or rstd outside float32's range, or dy * w past it: such
    # rows are done in float64, as the CPU does (a float32 map gave inf and
    # NaN here).
    x = np.array([[3e38, 3e38, -3e38], [1e-25, -1e-25, 0.0]], np.float32)
    for fn in (lnfast.layer_norm_forward, lnfast.rms_norm_forward):
        cpu = fn(x, eps=0.0)
        got = fn(cp.asarray(x), eps=0.0)
        assert np.isfinite(host(got[0])[0]).all()
        assert ref.rel_error(host(got[0])[0], cpu[0]) <= 2e-6
    x = np.array([[1.0, 2.0, 3.0, 4.0], [1.0, -2.0, 0.5, 3.0]], np.float32)
    w = np.full(4, 3e38, np.float32)            # dy * w = 6e38 throughout: dx = 0
    dy = np.full(x.shape, 2.0, np.float32)
    _, mean, rstd = lnfast.layer_norm_forward(x, w)
    cpu = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    got = lnfast.layer_norm_backward(*gpu(dy, x, mean, rstd, w))
    assert np.isfinite(host(got[0])[0]).all()
    for g, c in zip(got, cpu):
        assert ref.rel_error(host(g)[0], c) <= 2e-6


def float64_rows_past_their_sums_range(rng):
    """Rows whose squares leave float64's range, as the CPU's tests have
    them: deviations of 1e200 and of 1e-170, a spread below 2**-1022, values
    of opposite sign near float64's maximum (x - x[0] overflows); and long
    rows of such values, which the blocks reduce over several warps and
    read two at a time."""
    short = [np.array([[1.0, -1.0, 0.3, 0.25], [3.0, -3.0, 0.0, 1.0]]) * s for s in (1e200, 1e-170)]
    short += [np.array([[0.0, 1e-310]]), np.array([[1e-310, 0.0, 3e-310]]),
              np.array([[-1e308, 1e308, 0.0, 5e307]])]
    long = rng.standard_normal((5, 4096))
    long[0] *= 1e200
    long[1] *= 1e-170
    long[2] = long[2] / np.abs(long[2]).max() * 1.7e308
    long[3] = 1e-310 * (long[3] > 0)
    return short + [long]           # (long[4]: an ordinary row among them)


def assert_close(got, want, tol, label=None):
    """max |got - want| within tol of max |want|, which may be near float64's
    top (where a norm's squares would overflow); infinities the same."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    inf = np.isinf(want)
    assert np.array_equal(got[inf], want[inf]), label
    scale = np.abs(want[~inf]).max(initial=0.0)
    assert np.abs(got[~inf] - want[~inf]).max(initial=0.0) <= tol * scale, label


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_float64_rows_whose_squares_leave_float64_match_the_cpu(rng, eps):
    # Redone as the CPU redoes them (row_exact), every term scaled by a
    # power of two: where the sums overflowed or underflowed, y was NaN,
    # infinite or zero.
    # Within the SPEC's bar of the CPU's results: y and rstd, and the mean
    # within it of the row's largest value.  (rstd itself passes float64's
    # top where eps=0 meets a subnormal spread.)
    tol = FORWARD_TOL[np.float64]
    for x in float64_rows_past_their_sums_range(rng):
        for fn in (lnfast.layer_norm_forward, lnfast.rms_norm_forward):
            got, cpu = host(*fn(cp.asarray(x), eps=eps)), fn(x, eps=eps)
            assert np.isfinite(got[0]).all()
            for r in range(x.shape[0]):
                label = (x.shape, r, fn.__name__)
                assert_close(got[0][r], cpu[0][r], tol, label)
                assert_close(got[-1][r], cpu[-1][r], tol, label)
                if len(got) == 3:
                    assert abs(got[1][r] - cpu[1][r]) <= tol * np.abs(x[r]).max(), label


@pytest.mark.parametrize("centered", [True, False], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows", ["near the top", "tiny terms", "long"])
def test_float64_backward_rows_past_float64s_range_match_mpmath(rng, centered, rows):
    # The CPU tests' float64 rows that the backward redoes with its terms
    # scaled (backward_exact): dx and dweight against mpmath, each dweight
    # within rounding of its terms; and long rows of two such kinds, with an
    # ordinary one (whose dweight terms the rounding of the mean and rstd
    # can outweigh): within 1e-14 of each row's dx and of dweight.
    if rows == "near the top":
        (x, dy), eps = float64_rows_near_the_top(rng), 1e-5
    elif rows == "tiny terms":
        (x, dy), eps = float64_rows_of_tiny_terms(rng), 0.0
    else:
        x, dy = rng.standard_normal((3, 1024)), rng.standard_normal((3, 1024))
        x[0] = x[0] / np.abs(x[0]).max() * 1.7e308
        dy[0] *= 1e300
        x[1] *= 1e-150
        dy[1] *= 1e-200
        eps = 0.0
    fwd, bwd = ((lnfast.layer_norm_forward, lnfast.layer_norm_backward) if centered else
                (lnfast.rms_norm_forward, lnfast.rms_norm_backward))
    gx, gdy = gpu(x, dy)
    dx, dw = host(*bwd(gdy, gx, *fwd(gx, eps=eps)[1:])[:2])
    want = exact_backward(x, dy, eps, centered)
    if rows != "long":
        assert_backward_exact(dx, dw, want)
        return
    as_float = np.vectorize(float)
    for r in range(x.shape[0]):
        assert_close(dx[r], as_float(want[0][r]), 1e-14, r)
    assert_close(dw, as_float(np.array(want[1], object)), 1e-14)


@pytest.mark.parametrize("x, dy, w, centered, eps", REDO_ROWS)
def test_float64_backward_redo_keeps_each_term(x, dy, w, centered, eps):
    # The CPU tests' rows whose dy * weight spans hundreds of orders of
    # magnitude: each dx within rounding of its own terms and of the row
    # sums' in any order (the blocks add them in a tree).
    x, dy = np.array([x]), np.array([dy])
    gx, gdy, gw = gpu(x, dy, None if w is None else np.array(w))
    if centered:
        _, mean, rstd = lnfast.layer_norm_forward(gx, gw, eps=eps)
        dx = lnfast.layer_norm_backward(gdy, gx, mean, rstd, gw)[0]
    else:
        _, rstd = lnfast.rms_norm_forward(gx, gw, eps=eps)
        dx = lnfast.rms_norm_backward(gdy, gx, rstd, gw)[0]
    assert_dx_within_its_terms(host(dx)[0][0], x[0], dy[0], w, eps, centered, any_order=True)


@pytest.mark.parametrize("x, eps, w", TINY_SPREAD_ROWS)
def test_float64_rows_of_tiny_spread_against_a_large_eps(x, eps, w):
    # The CPU test's rows, whose rstd / sc underflowed before the product
    # with the weight (y zero) where eps sc^2 overflows.
    assert_tiny_spread_row_exact(x, eps, w, cp.asarray, cp.asnumpy)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("axis", [-1, 1], ids=["rows", "tiles"])
def test_an_infinity_or_nan_in_dy_makes_every_dx_of_its_row_nan(rng, dtype, axis):
    # As on the CPU: every dx of such a row NaN, where some came out -inf.
    dxs, bad = dx_of_rows_with_bad_dy(rng, dtype, axis, cp.asarray, cp.asnumpy)
    for dx in dxs:
        assert np.isnan(dx[bad]).all()
        assert np.isfinite(dx[~bad]).all()


@pytest.mark.parametrize("x, dy, w, eps, dtype", UNDERFLOWED_PRODUCT_ROWS)
def test_rows_whose_products_all_underflow_are_not_taken_for_padding(x, dy, w, eps, dtype):
    # As on the CPU; float32 products of 1e-40 are flushed here (-ftz=true),
    # so that such a row's g summed to zero and its dx came out 0.
    assert_underflowed_products_redone(x, dy, w, eps, dtype, cp.asarray, cp.asnumpy)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_subnormal_values_are_read_and_written_as_on_the_cpu(rng, dtype):
    # CuPy compiles with -ftz=true, so float32 arithmetic reads and writes
    # subnormals as zero (as the emulation's launches do too); rows of
    # values this small take the kernels' float64 paths instead.
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
    tol = 1.5 * 2.0**-8 if dtype == "bfloat16" else 2e-6
    tiny = float(np.finfo(np.float32).smallest_normal)
    x, r, dy = ((rng.standard_normal((6, 256)) * tiny / 8).astype(dt) for _ in range(3))
    x[5] += np.float32(1.0).astype(dt)            # one row of normal values
    assert (x[:5] != 0).any() and (np.abs(x[:5].astype(np.float32)) < tiny).all()
    gx, gr, gdy = gpu(x, r, dy)
    for forward, backward in ((lnfast.layer_norm_forward, lnfast.layer_norm_backward),
                              (lnfast.rms_norm_forward, lnfast.rms_norm_backward)):
        stats = forward(gx)                 # y, (mean,) rstd
        cpu_stats = forward(x)
        for got, want in zip(host(*stats), cpu_stats):
            assert ref.rel_error(got, want) <= tol
        for got, want in zip(host(*backward(gdy, gx, *stats[1:])),
                             backward(dy, x, *cpu_stats[1:])):
            assert ref.rel_error(got, want) <= 2 * tol
    y, z, _, _ = lnfast.add_layer_norm_forward(gx, gr)
    cpu_y, cpu_z, _, _ = lnfast.add_layer_norm_forward(x, r)
    assert np.array_equal(host(z)[0].view(np.uint16 if dt.itemsize == 2 else np.uint32),
                          cpu_z.view(np.uint16 if dt.itemsize == 2 else np.uint32))
    assert ref.rel_error(host(y)[0], cpu_y) <= tol


def test_a_float32_weight_on_16_not_32_bytes_beside_16_bit_rows(rng):
    # 16-bit rows read the float32 weight 8 at a time: in 16-byte packs,
    # which a weight at an odd multiple of 16 bytes allows.
    import ml_dtypes

    x = rng.standard_normal((8, 1024)).astype(ml_dtypes.bfloat16)
    w = cp.asarray(rng.standard_normal(1032).astype(np.float32))
    k = next(k for k in range(8) if (w.data.ptr + 4 * k) % 32 == 16)
    y = lnfast.layer_norm(cp.asarray(x), w[k:k + 1024])
    assert cp.array_equal(y, lnfast.layer_norm(cp.asarray(x), w[k:k + 1024].copy()))


def test_arrays_on_a_second_device(rng):
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU")
    x = rng.standard_normal((8, 256)).astype(np.float32)
    want = lnfast.layer_norm_forward(cp.asarray(x))
    with cp.cuda.Device(1):
        x1 = cp.asarray(x)
    got = lnfast.layer_norm_forward(x1)          # the current device is 0
    assert all(a.device.id == 1 for a in got)
    for g, w in zip(got, want):
        assert np.array_equal(host(g)[0], host(w)[0])


def test_out_in_place_and_zero_rows(rng):
    x, w, b = make(rng, (16, 256), np.float32)
    gx = cp.asarray(x)
    want = lnfast.layer_norm(gx, cp.asarray(w), cp.asarray(b))
    lnfast.layer_norm(gx, cp.asarray(w), cp.asarray(b), out=gx)
    assert cp.array_equal(gx, want)
    out = cp.empty((16, 512), np.float32)[:, ::2]
    lnfast.layer_norm(cp.asarray(x), cp.asarray(w), cp.asarray(b), out=out)
    assert cp.array_equal(out, want)
    empty = cp.empty((0, 32), np.float32)
    y, mean, rstd = lnfast.layer_norm_forward(empty)
    dx, dw, db = lnfast.layer_norm_backward(empty, empty, mean, rstd)
    assert y.shape == (0, 32) and not dw.any() and not db.any()


def test_results_repeat_bit_for_bit(rng):
    x, w, b = make(rng, (4096, 1024), np.float32)
    gx, gw, gb = gpu(x, w, b)
    gdy = cp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    _, mean, rstd = lnfast.layer_norm_forward(gx, gw, gb)
    first = lnfast.layer_norm_backward(gdy, gx, mean, rstd, gw)
    for _ in range(3):
        again = lnfast.layer_norm_backward(gdy, gx, mean, rstd, gw)
        for a, e in zip(again, first):
            assert cp.array_equal(a, e)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("wdtype", ["same", "float32"])
def test_half_precision(rng, dtype, wdtype):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    wdt = dt if wdtype == "same" else np.dtype(np.float32)
    u = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    x = rng.standard_normal((37, 1024)).astype(dt)
    r = rng.standard_normal(x.shape).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    w = (rng.standard_normal(1024) + 1).astype(wdt)
    b = rng.standard_normal(1024).astype(wdt)
    gx, gr, gdy, gw, gb = gpu(x, r, dy, w, b)
    y, mean, rstd = lnfast.layer_norm_forward(gx, gw, gb)
    assert y.dtype == dt and mean.dtype == rstd.dtype == np.float32
    ry, rmean, rrstd = ref.layer_norm_forward(x, w, b)
    assert ref.rel_error(host(y)[0], ry) <= 1.5 * u
    dx, dw, db = lnfast.layer_norm_backward(gdy, gx, mean, rstd, gw)
    rdx, rdw, rdb = ref.layer_norm_backward(dy, x, rmean, rrstd, w)
    assert dx.dtype == dt and dw.dtype == wdt
    assert ref.rel_error(host(dx)[0], rdx) <= 2 * u
    gbar = 1e-4 if wdt == np.float32 else u
    assert ref.rel_error(host(dw)[0], rdw) <= gbar and ref.rel_error(host(db)[0], rdb) <= gbar
    y2, z, _, _ = lnfast.add_layer_norm_forward(gx, gr, gw, gb)
    assert cp.array_equal(y2, lnfast.layer_norm(z, gw, gb))
    yr = lnfast.rms_norm(gx, gw)
    assert ref.rel_error(host(yr)[0], ref.rms_norm_forward(x, w)[0]) <= 1.5 * u


def test_mixing_numpy_and_cupy_is_a_type_error():
    with pytest.raises(TypeError, match="weight is a numpy.ndarray but x is a cupy.ndarray"):
        lnfast.layer_norm(cp.ones((2, 4)), np.ones(4))
    with pytest.raises(TypeError, match="dy is a cupy.ndarray but x is a numpy.ndarray"):
        x = np.ones((2, 4))
        _, m, r = lnfast.layer_norm_forward(x)
        lnfast.layer_norm_backward(cp.asarray(x), x, m, r)


def test_show_config_reports_the_gpu(capsys):
    lnfast.show_config()
    assert "gpu" in capsys.readouterr().out


@pytest.mark.parametrize("shape,axis", [((3, 24, 5, 7), 1), ((4, 6, 5, 7), (2, 3)),
                                        ((4, 6, 5, 7), (1, 3)), ((2, 3, 40), (0, 2))])
def test_any_axis_matches_cpu(rng, shape, axis):
    """SPEC "Axes" on CuPy arrays: shapes, C order, values of the CPU's."""
    ax = axis if isinstance(axis, tuple) else (axis,)
    norm = tuple(shape[k] for k in ax)
    x = rng.standard_normal(shape).astype(np.float32)
    r, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    w = (1 + 0.2 * rng.standard_normal(norm)).astype(np.float32)
    b = rng.standard_normal(norm).astype(np.float32)
    gx, gr, gdy, gw, gb = gpu(x, r, dy, w, b)
    y, z, mean, rstd = lnfast.add_layer_norm_forward(gx, gr, gw, gb, axis=axis)
    dx, dw, db = lnfast.add_layer_norm_backward(gdy, z, mean, rstd, gw, axis=axis)
    check_device_results(y, z, mean, rstd, dx, dw, db)
    cy, cz, cmean, crstd = lnfast.add_layer_norm_forward(x, r, w, b, axis=axis)
    cdx, cdw, cdb = lnfast.add_layer_norm_backward(dy, cz, cmean, crstd, w, axis=axis)
    assert mean.shape == cmean.shape and dw.shape == w.shape
    for g, c in zip(host(y, z, rstd, dx, dw, db), (cy, cz, crstd, cdx, cdw, cdb)):
        np.testing.assert_allclose(g, c, rtol=1e-4, atol=1e-4)
    out = cp.empty_like(gx)
    assert lnfast.rms_norm(gx, gw, axis=axis, out=out) is out
    np.testing.assert_allclose(host(out)[0], lnfast.rms_norm(x, w, axis=axis), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="axis"):
        lnfast.layer_norm(gx, axis=(1, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
def test_dask_arrays_of_cupy_blocks(rng, dtype):
    # Dask arrays whose blocks are CuPy arrays reach the CUDA kernels;
    # rows are the same bits as the call on the whole CuPy array.  (The
    # synchronous scheduler: the CPU emulation runs one launch at a time.)
    da = pytest.importorskip("dask.array")
    import dask

    x, w, b = make(rng, (40, 64), dtype)
    dy = rng.standard_normal(x.shape).astype(dtype)
    gx, gw, gb, gdy = gpu(x, w, b, dy)
    X = da.from_array(gx, chunks=(16, 64), asarray=False)
    DY = da.from_array(gdy, chunks=(16, 64), asarray=False)
    y, mean, rstd = lnfast.layer_norm_forward(X, gw, gb)
    assert isinstance(y._meta, cp.ndarray)
    with dask.config.set(scheduler="sync"):
        got = dask.compute(y, mean, rstd)
        check_device_results(*got)
        for g, want in zip(got, lnfast.layer_norm_forward(gx, gw, gb)):
            assert cp.array_equal(g, want)
        dx, dw, db = dask.compute(*lnfast.layer_norm_backward(DY, X, mean, rstd, gw))
        check_device_results(dx, dw, db)
        assert cp.array_equal(dx, lnfast.layer_norm_backward(gdy, gx, got[1], got[2], gw)[0])
        _, rmean, rrstd = ref.layer_norm_forward(x, w, b)
        rdx, rdw, rdb = ref.layer_norm_backward(dy, x, rmean, rrstd, w)
        tol = BACKWARD_TOL.get(dtype, 1e-2)
        for g, want in zip(host(dw, db), (rdw, rdb)):
            assert ref.rel_error(g, want) <= tol
        # one block: its float64 sums rounded once are the CuPy call's bytes
        one = da.from_array(gx, chunks=-1, asarray=False)
        _, m1, r1 = lnfast.layer_norm_forward(one, gw, gb)
        got1 = dask.compute(*lnfast.layer_norm_backward(
            da.from_array(gdy, chunks=-1, asarray=False), one, m1, r1, gw))
        for g, want in zip(got1, lnfast.layer_norm_backward(gdy, gx, got[1], got[2], gw)):
            assert g.dtype == want.dtype and cp.array_equal(g, want)
        # blocks of another kind are an error at call time
        with pytest.raises(TypeError, match="dy's blocks are numpy.ndarrays but the blocks "
                                            "of x are cupy.ndarrays"):
            lnfast.layer_norm_backward(da.from_array(dy, chunks=(16, 64)), X, mean, rstd, gw)
