"""Shared test constants, and the exact (mpmath) references of float64 rows
that the kernels redo."""
import numpy as np

# SPEC accuracy bars: relative error ||out - ref|| / ||ref|| against float64.
FORWARD_TOL = {np.float32: 2e-6, np.float64: 1e-12}
BACKWARD_TOL = {np.float32: 2e-5, np.float64: 1e-10}
DTYPES = [np.float32, np.float64]


def data(rng, shape, dtype, scale=1.0, shift=0.0):
    """Normal values * scale + shift, rounded to dtype."""
    return (rng.standard_normal(shape) * scale + shift).astype(dtype)


def same(got, want):
    """Bitwise equal arrays of one dtype and shape (NaN never passes)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not np.isnan(got.astype(np.float64)).any()
    assert got.tobytes() == want.tobytes()


def exact_forward_row(x, w, b, eps, centered):
    """The SPEC's forward of one float64 row in mpmath (256 bits), rounded
    to float64 (b unused where not centered: RMSNorm)."""
    import mpmath

    mpmath.mp.prec = 256
    xs = [mpmath.mpf(float(v)) for v in x]
    D = len(xs)
    m = sum(xs) / D if centered else 0
    rs = 1 / mpmath.sqrt(sum((v - m) ** 2 for v in xs) / D + mpmath.mpf(eps))
    return np.array([float((v - m) * rs * mpmath.mpf(float(w[j]))
                           + (mpmath.mpf(float(b[j])) if centered else 0))
                     for j, v in enumerate(xs)])


def exact_backward_row(x, dy, w, eps, centered):
    """The SPEC's backward of one float64 row in mpmath (256 bits) on x, dy
    and w (None: ones) as given: rstd, xhat, g = dy * w, mean(g) (0 for
    RMSNorm) and mean(g * xhat)."""
    import mpmath

    mpmath.mp.prec = 256
    D = len(x)
    xs = [mpmath.mpf(float(v)) for v in x]
    m = sum(xs) / D if centered else 0
    rs = 1 / mpmath.sqrt(sum((v - m) ** 2 for v in xs) / D + mpmath.mpf(eps))
    xh = [(v - m) * rs for v in xs]
    g = [mpmath.mpf(float(a)) * (1 if w is None else mpmath.mpf(float(w[j])))
         for j, a in enumerate(dy)]
    mg = sum(g) / D if centered else 0
    mgx = sum(a * b for a, b in zip(g, xh)) / D
    return rs, xh, g, mg, mgx


def exact_backward(x, dy, eps, centered):
    """(dx, dweight, dweight's rounding units) of float64 rows x, dy (no
    weight) in mpmath, for assert_backward_exact."""
    import mpmath

    M, D = x.shape
    dx = np.empty((M, D), object)
    dw, units = [mpmath.mpf(0)] * D, [mpmath.mpf(0)] * D
    for r in range(M):
        rs, xh, g, mg, mgx = exact_backward_row(x[r], dy[r], None, eps, centered)
        for j in range(D):
            dx[r, j] = rs * (g[j] - mg - xh[j] * mgx)
            dw[j] += g[j] * xh[j]
            units[j] += abs(g[j] * xh[j]) * 2.0**-53 + mpmath.mpf(2) ** -1075
    return dx, dw, units


def assert_backward_exact(dx, dw, want, label=None):
    """dx within 1e-14 of its row's largest (or 2**-1070) and each dweight
    within a dozen rounding units of its terms, of exact_backward's `want`;
    finite throughout."""
    import mpmath

    dx_want, dw_want, dw_units = want
    assert np.isfinite(dx).all() and np.isfinite(dw).all(), label
    for r in range(dx.shape[0]):
        scale = max(abs(v) for v in dx_want[r])
        err = max(abs(mpmath.mpf(float(a)) - e) for a, e in zip(dx[r], dx_want[r]))
        assert err <= 1e-14 * scale + mpmath.mpf(2) ** -1070, (label, r, float(err / scale))
    for j in range(len(dw_want)):
        err = abs(mpmath.mpf(float(dw[j])) - dw_want[j])
        assert err <= 12 * dw_units[j] + abs(dw_want[j]) * 2.0**-53, (label, j)


def assert_dx_within_its_terms(dx, x, dy, w, eps, centered, any_order=False):
    """Each dx of one float64 row against mpmath on its own, within 1e-14 of
    its own terms (or 2**-1070), so that small ones count.  With any_order,
    also within the rounding of the row sums mean(g) and mean(g xhat) in
    any order of their terms (D units of float64 of their terms' mean
    size): the GPU adds them in a tree, where the CPU's order can be exact."""
    import mpmath

    rs, xh, g, mg, mgx = exact_backward_row(x, dy, w, eps, centered)
    D = len(g)
    amg = sum(abs(a) for a in g) / D if centered else 0
    amgx = sum(abs(a * b) for a, b in zip(g, xh)) / D
    for j in range(D):
        want = rs * (g[j] - mg - xh[j] * mgx)
        bound = 1e-14 * rs * (abs(g[j]) + abs(mg) + abs(xh[j]) * amgx) + mpmath.mpf(2) ** -1070
        if any_order:
            bound += rs * (amg + abs(xh[j]) * amgx) * D * 2.0**-53
        assert abs(mpmath.mpf(float(dx[j])) - want) <= bound, (j, float(dx[j]), float(want))


def float64_rows_near_the_top(rng):
    """(x, dy) of 40 rows of 6 with values of opposite sign near float64's
    maximum and dy * weight up to 1e300 (eps=1e-5), ordinary rows among
    them: deviations from the mean, or their sums with dy, overflow unless
    scaled; dx is subnormal where rstd is about 1e-308."""
    M, D = 40, 6
    x = rng.standard_normal((M, D))
    x[::4] = x[::4] / np.abs(x[::4]).max(axis=1, keepdims=True) * 1.7e308
    x[1::4] *= 1e307
    dy = rng.standard_normal((M, D))
    dy[::4][::2] *= 1e300
    dy[1::4][::2] *= 1e19
    dy[2::4] *= 1e300
    dy[0, 2] = 1e-300                           # a tiny dweight term in a huge row
    return x, dy


def float64_rows_of_tiny_terms(rng):
    """(x, dy) of 48 rows of 5 (eps=0) with normal x and dy whose products
    dy * (x - mean) underflow (a spread of 1e-150 and dy of 1e-200),
    subnormal dy, and deviations scaled up by 2**1000 with dy large enough
    that the scaled terms overflowed: dx and dweight are normal numbers."""
    M, D = 48, 5
    x = rng.standard_normal((M, D))
    dy = rng.standard_normal((M, D))
    for r, (sx, sdy) in enumerate([(1e-150, 1e-200), (1e-100, 1e-250), (1e-50, 1e-300),
                                   (1.0, 1e-310), (1e-150, 1e-310), (1e-275, 1e10),
                                   (1e-290, 1e10), (1e-300, 1e-300)]):
        x[r::8] *= sx
        dy[r::8] *= sdy
    return x, dy


# Rows that the float64 backward redoes, dy * weight spanning hundreds of
# orders of magnitude: (x, dy, weight, centered, eps).
REDO_ROWS = [
    ([0.0, 0.0, 0.0], [1e200, 1e-200, 0.0], None, False, 1e-5),
    ([0.0, 1.0, 1.0], [1e200, 1e-300, 0.0], None, False, 1e-5),
    ([1.0, 1.0, 1.0], [1e200, -1e200, 1e-200], None, True, 1e-5),
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1e150, 1e-200, 1.0], True, 1e-5),
    ([1e-150, -1e-150, 0.0], [1e-200, 2e-200, 3e-300], None, True, 0.0),
    ([1e-275, -1e-275, 0.0], [1e10, 1e10, 1e-100], None, False, 0.0),
    ([1e100, -1e100, 5e99], [1e200, 1.0, 1e-200], [1e150, 1.0, 1.0], True, 1e-5),
    ([1e-300, 0.0], [1e-250, 1e100], None, False, 1e-5),
    ([1e-300, 0.0, 0.0], [3e-308, 1e7, 0.0], None, False, 1e-5),
    ([1e-126, -3e-126, 0.0], [11.2, 2.1e-144, 1.0], [1.9e-193, 1.3e-71, 1e-200], True, 0.0),
    ([1e-300, 0.0], [1e-100, 1e-165], [1.0, 1e-165], False, 0.0),
    ([0.0, 0.0], [1e-100, 1e-200], [1e-100, 1e-200], False, 1e-300)]


def dx_of_rows_with_bad_dy(rng, dtype, axis, device=None, host=None):
    """(dx of every backward, on the host, for rows with an infinity or NaN
    in dy among ordinary ones; which rows hold them).  axis 1 of (N, C, H,
    W): rows far apart (tiles); axis -1: contiguous rows.  device, host:
    the arrays to the device the kernels run on (cupy.asarray), and back."""
    import lnfast

    device = device or (lambda a: a)
    host = host or (lambda a: a)
    shape = (2, 7, 4, 5) if axis == 1 else (6, 7)
    x, dy, dz = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    rows = np.moveaxis(dy, axis, -1)            # a view: writes reach dy
    bad = np.zeros(rows.shape[:-1], bool)
    for k, v in zip(((0, 1, 1), (1, 2, 3), (1, 0, 2)) if axis == 1 else ((1,), (2,), (4,)),
                    (np.inf, -np.inf, np.nan)):
        rows[k][3] = v
        bad[k] = True
    w = (rng.standard_normal(7) + 2).astype(dtype)
    x, dy, dz, w = (device(a) for a in (x, dy, dz, w))
    _, mean, rstd = lnfast.layer_norm_forward(x, w, w, axis=axis)
    out = [lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis)[0],
           lnfast.layer_norm_backward(dy, x, mean, rstd, axis=axis)[0]]
    _, rs = lnfast.rms_norm_forward(x, w, axis=axis)
    out.append(lnfast.rms_norm_backward(dy, x, rs, w, axis=axis)[0])
    _, z, mean, rstd = lnfast.add_layer_norm_forward(x, x, w, w, axis=axis)
    out.append(lnfast.add_layer_norm_backward(dy, z, mean, rstd, w, dz=dz, axis=axis)[0])
    return [np.moveaxis(host(d), axis, -1).astype(np.float64) for d in out], bad


# float64 rows (x, eps, weight) whose deviations, scaled up by a power of two
# sc, meet an eps whose eps sc^2 overflows, with large weights.
TINY_SPREAD_ROWS = [
    ([1e-200, -1e-200, 5e-201], 1e300, 1e300),
    ([1e-310, -2e-310, 3e-310], 1e40, 1e300),
    ([1e-310, -2e-310, 3e-310], 1e10, 1.0),
    ([1e-200, -1e-200, 5e-201, 0.0], 1e-5, 1e300)]


def assert_tiny_spread_row_exact(x, eps, w, device=None, host=None):
    """layer_norm and rms_norm of a TINY_SPREAD_ROWS row within 1e-14 of
    mpmath's (device, host: as dx_of_rows_with_bad_dy's)."""
    import lnfast

    device = device or (lambda a: a)
    host = host or (lambda a: a)
    x = np.array([x])
    wv, bv = np.full(x.shape[1], w), np.zeros(x.shape[1])
    for centered in (True, False):
        args = [device(a) for a in (x, wv, bv)]
        got = host(lnfast.layer_norm(*args, eps=eps) if centered else
                   lnfast.rms_norm(*args[:2], eps=eps))[0]
        want = exact_forward_row(x[0], wv, bv, eps, centered)
        assert np.allclose(got, want, rtol=1e-14, atol=0), (centered, got, want)


# Rows (x, dy, weight value, eps, dtype) whose every dy * weight underflows
# (float64), or is flushed on a GPU (float32, 1e-40), while rstd makes the
# true dx a normal number.
UNDERFLOWED_PRODUCT_ROWS = [
    ([1e-150, -1e-150, 5e-151], [1e-200, 2e-200, -1e-200], 1e-150, 0.0, np.float64),
    ([1e-150, -1e-150, 5e-151, 2e-151, -3e-151], [1e-200, 2e-200, -1e-200, 0.0, 3e-200],
     1e-150, 0.0, np.float64),
    ([1e-20, -1e-20, 5e-21], [1e-25, 2e-25, -1e-25], 1e-25, 0.0, np.float32),
    ([1e-3, -1e-3, 5e-4], [1e-20, 2e-20, -1e-20], 1e-20, 1e-5, np.float32)]


def assert_underflowed_products_redone(x, dy, wv, eps, dtype, device=None, host=None):
    """dx of an UNDERFLOWED_PRODUCT_ROWS row, among padding rows (dy zero)
    of the same x, within 1e-6 (float32) or 1e-14 of mpmath's, by rows,
    tiles (Fortran order) and strided rows; the padding rows' dx zero
    (device, host: as dx_of_rows_with_bad_dy's)."""
    import lnfast

    device = device or (lambda a: a)
    host = host or (lambda a: a)
    x = np.tile(np.array(x), (40, 1)).astype(dtype)
    dy = np.tile(np.array(dy), (40, 1)).astype(dtype)
    dy[::2] = 0
    w = np.full(x.shape[1], wv, dtype)
    tol = 1e-6 if dtype == np.float32 else 1e-14
    for centered in (True, False):
        fwd, bwd = ((lnfast.layer_norm_forward, lnfast.layer_norm_backward) if centered else
                    (lnfast.rms_norm_forward, lnfast.rms_norm_backward))
        rs, xh, g, mg, mgx = exact_backward_row(x[1], dy[1], w, eps, centered)
        want = np.array([float(rs * (gi - mg - h * mgx)) for gi, h in zip(g, xh)])
        for way, order in (("rows", lambda a: a), ("tiles", np.asfortranarray),
                           ("strided", lambda a: a[..., ::-1])):
            gx, gdy, gw = (device(order(a)) for a in (x, dy, w))
            got = host(bwd(gdy, gx, *fwd(gx, gw, eps=eps)[1:], gw)[0])
            got = got[:, ::-1] if way == "strided" else got
            assert np.abs(got[1] - want).max() <= tol * np.abs(want).max(), (way, centered)
            assert (got[::2] == 0).all(), (way, centered)
