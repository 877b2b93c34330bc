"""docs/api.md, "`out=`" and "Axes": `out=` never changes the bits, and an
`out` that overlaps an input gives the answer of the non-overlapping call.
The kernel is chosen by the inputs' layout alone: here every layout of x
that takes a path of its own (tiles with whole and with short tiles, rows
far apart gathered one by one, contiguous rows) meets outputs of every
layout (C- and F-ordered, strided, x's own, x itself, overlapping x), on
every dtype, and the results must be the same bytes.  The kernels' C API
makes the same promise for y, z and dx of any layout (lnfast._cpu), which
the public functions reach through their temporaries."""
import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _cpu

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
# x's layouts (shape, axis), odd sizes throughout
LAYOUTS = ["channels-first", "channels-first-short", "fortran", "strided",
           "channels-last-viewed", "contiguous"]


def make_x(rng, kind, dtype):
    """(x, axis) of the given layout, with a constant row and one far from
    zero among them (rows redone apart from the others)."""
    if kind == "channels-first":            # H W = 32: runs of whole tiles
        x, axis = rng.standard_normal((2, 23, 4, 8)), 1
    elif kind == "channels-first-short":    # H W = 35: runs end in a short tile
        x, axis = rng.standard_normal((3, 19, 5, 7)), 1
    elif kind == "fortran":                 # 37 rows of 29, adjacent to each other
        x, axis = np.asfortranarray(rng.standard_normal((37, 29))), -1
    elif kind == "strided":                 # rows far apart, neighbours too
        x, axis = rng.standard_normal((7, 9, 61))[::2, 1:, ::2], -1
    elif kind == "channels-last-viewed":    # contiguous rows, viewed channels-first
        x, axis = rng.standard_normal((2, 5, 6, 21)).transpose(0, 3, 1, 2), 1
    else:
        x, axis = rng.standard_normal((13, 37)), -1
    x[...] = x * 2 + 0.5
    rows = np.moveaxis(x, axis, -1)
    rows[(0,) * (x.ndim - 1)] = 3.0
    rows[(1,) * (x.ndim - 1)] += 3000.0
    return like(x, np.empty(span(x), dtype), 0, fill=x), axis


def span(a):
    """Elements from a's first to its last (all strides positive here)."""
    return sum((n - 1) * s for n, s in zip(a.shape, a.strides)) // a.itemsize + 1


def like(a, buf, start, fill=None):
    """An array of a's shape and strides (in elements) in buf from `start`."""
    strides = tuple(s // a.itemsize * buf.itemsize for s in a.strides)
    v = np.lib.stride_tricks.as_strided(buf[start:], a.shape, strides)
    if fill is not None:
        v[...] = fill
    return v


def out_layouts(x):
    """Writeable arrays of x's shape and dtype laid out every other way."""
    shape, dt = x.shape, x.dtype
    yield "C", np.empty(shape, dt)
    yield "F", np.empty(shape, dt, order="F")
    big = np.empty(tuple(2 * n + 1 for n in shape), dt)
    yield "strided", big[tuple(slice(1, None, 2) for _ in shape)]
    yield "reversed axes", np.empty(shape[::-1], dt).transpose()
    yield "x's own", like(x, np.empty(span(x), dt), 0)


def params(rng, x, axis):
    D = x.shape[axis]
    w = (1 + 0.2 * rng.standard_normal(D)).astype(x.dtype)
    b = (0.2 * rng.standard_normal(D)).astype(x.dtype)
    return w, b


FUNCTIONS = {
    "layer_norm": lambda x, w, b, axis, out: lnfast.layer_norm(x, w, b, axis=axis, out=out),
    "layer_norm-no-weight": lambda x, w, b, axis, out: lnfast.layer_norm(x, axis=axis, out=out),
    "rms_norm": lambda x, w, b, axis, out: lnfast.rms_norm(x, w, axis=axis, out=out),
}


def check_same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), what


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("fn", list(FUNCTIONS))
def test_out_never_changes_the_bits(rng, kind, dtype, fn):
    x, axis = make_x(rng, kind, dtype)
    w, b = params(rng, x, axis)
    call = FUNCTIONS[fn]
    want = call(x, w, b, axis, None)
    for name, out in out_layouts(x):
        assert call(x, w, b, axis, out) is out
        check_same(out, want, name)
    # in place, on a copy of x's layout
    x2 = like(x, np.empty(span(x), dtype), 0, fill=x)
    assert call(x2, w, b, axis, x2) is x2
    check_same(x2, want, "in place")
    # out overlapping x in part: x's layout one element on, and C-ordered
    for name in ("x's layout", "C"):
        buf = np.zeros(span(x) + 1 + x.size, dtype)
        xv = like(x, buf, 1, fill=x)
        out = like(x, buf, 0) if name == "x's layout" else buf[:x.size].reshape(x.shape)
        assert np.shares_memory(out, xv)
        call(xv, w, b, axis, out)
        check_same(out, want, f"overlapping, {name}")
    # the forward functions without out= give the same y
    if fn == "layer_norm":
        check_same(lnfast.layer_norm_forward(x, w, b, axis=axis)[0], want, "layer_norm_forward")
    elif fn == "rms_norm":
        check_same(lnfast.rms_norm_forward(x, w, axis=axis)[0], want, "rms_norm_forward")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", ["fortran", "channels-first-short"])
def test_new_temporaries_for_any_thread_count(rng, kind, dtype):
    """Outputs not in x's layout (out=None of a Fortran-ordered x, a
    temporary for an overlapping out, the backward's C-ordered dx) on 1, 2
    and 3 threads: one set of bits, that of an out in x's layout."""
    shape = (301, 117) if kind == "fortran" else (7, 43, 9, 13)
    axis = -1 if kind == "fortran" else 1
    x = rng.standard_normal(shape).astype(dtype)
    x = np.asfortranarray(x) if kind == "fortran" else x
    np.moveaxis(x, axis, -1)[(0,) * (x.ndim - 1)] = 3.0    # (a row of the first tile redone)
    w, b = params(rng, x, axis)
    res, dy = np.empty_like(x), np.empty_like(x)    # (x's layout, as np.empty_like's here)
    res[...] = rng.standard_normal(shape)
    dy[...] = rng.standard_normal(shape)
    results = []
    for n in (1, 2, 3):
        lnfast.set_num_threads(n)
        own = np.empty_like(x)
        lnfast.layer_norm(x, w, b, axis=axis, out=own)
        buf = np.empty(x.size + 1, dtype)
        xv = like(x, buf, 1, fill=x)
        lnfast.layer_norm(xv, w, b, axis=axis, out=buf[:-1].reshape(x.shape))
        results.append((own, lnfast.layer_norm(x, w, b, axis=axis),
                        buf[:-1].reshape(x.shape).copy(),
                        *lnfast.add_layer_norm_forward(x, res, w, b, axis=axis),
                        *lnfast.rms_norm_forward(x, w, axis=axis)))
        _, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=axis)
        results[-1] += (*lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis),
                        *lnfast.rms_norm_backward(dy, x, rstd, w, axis=axis))
    for got in results:
        check_same(got[1], results[0][0], "out=None")
        check_same(got[2], results[0][0], "overlapping out")
        for a, e in zip(got, results[0]):
            check_same(a, e, "threads")


# --- The kernels' C API: y, z and dx of any layout --------------------------

def compute_type(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def kernel_forward(xr, res, y, z, w, b, centered, nthreads):
    ct = compute_type(xr.dtype)
    mean, rstd = np.empty(xr.shape[:-1], ct), np.empty(xr.shape[:-1], ct)
    _cpu.forward(xr, res, z, y, w.astype(ct), b.astype(ct), mean, rstd, 1e-5, centered,
                 nthreads)
    return mean, rstd


def kernel_backward(dy, xr, dz, mean, rstd, w, dx, centered, nthreads):
    M, D = xr.size // xr.shape[-1], xr.shape[-1]
    dwdb = np.empty((2, D), np.float64)         # (the float64 sums, unrounded)
    _cpu.backward(dy, xr, dz, mean, rstd, w.astype(compute_type(xr.dtype)), dx, dwdb,
                  _cpu.num_chunks(M, D), centered, nthreads)
    return dwdb


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
def test_kernel_outputs_of_any_layout(rng, kind, dtype, centered):
    """The forward's y and z (fused add) and the backward's dx of every
    layout, against those of x's own layout (x, residual, dy and dz all
    in x's layout), on 1, 2 and 3 threads."""
    x, axis = make_x(rng, kind, dtype)
    w, b = params(rng, x, axis)
    xr = np.moveaxis(x, axis, -1)
    own = lambda: like(xr, np.empty(span(xr), dtype), 0)    # noqa: E731
    res = own()
    res[...] = rng.standard_normal(xr.shape).astype(dtype)
    dy, dz = own(), own()
    dy[...] = rng.standard_normal(xr.shape).astype(dtype)
    dz[...] = rng.standard_normal(xr.shape).astype(dtype)
    y0, y1, z1 = own(), own(), own()
    stats = kernel_forward(xr, None, y0, None, w, b, centered, 1)
    fused = kernel_forward(xr, res if centered else None, y1, z1 if centered else None,
                           w, b, centered, 1)
    dx0, dx1 = own(), own()
    sums0 = kernel_backward(dy, xr, None, *stats, w, dx0, centered, 1)
    sums1 = kernel_backward(dy, z1 if centered else xr, dz, *fused, w, dx1, centered, 1)
    for n in (1, 2, 3):
        for name, y in list(out_layouts(xr)) + [("x itself", like(xr, np.empty(span(xr), dtype),
                                                                   0, fill=xr))]:
            xin = y if name == "x itself" else xr
            got = kernel_forward(xin, None, y, None, w, b, centered, n)
            check_same(y, y0, f"y {name}, {n} threads")
            for a, e in zip(got, stats):
                check_same(a, e, f"stats {name}, {n} threads")
        for (ny, y), (nz, z) in zip(out_layouts(xr), list(out_layouts(xr))[::-1]):
            if centered:
                kernel_forward(xr, res, y, z, w, b, centered, n)
                check_same(z, z1, f"z {nz}, {n} threads")
                check_same(y, y1, f"y {ny} (z {nz}), {n} threads")
        for name, dx in out_layouts(xr):
            sums = kernel_backward(dy, xr, None, *stats, w, dx, centered, n)
            check_same(dx, dx0, f"dx {name}, {n} threads")
            check_same(sums, sums0, f"dweight/dbias ({name} dx), {n} threads")
            sums = kernel_backward(dy, z1 if centered else xr, dz, *fused, w, dx, centered, n)
            check_same(dx, dx1, f"dx + dz {name}, {n} threads")
            check_same(sums, sums1, f"dweight/dbias (dz, {name} dx), {n} threads")


@pytest.fixture
def blocks_of_64():
    """Every backward row of contiguous x and dy summed by blocks of 64."""
    old = _cpu.blocked_settings(0, 64)
    yield
    _cpu.blocked_settings(*old)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_blocked_rows_whatever_dx_is(rng, blocks_of_64, dtype):
    """Long backward rows of contiguous x and dy are summed by column
    blocks (docs/api.md) whether or not dx is contiguous too."""
    M, D = 70, 333
    x = (rng.standard_normal((M, D)) * 2 + 0.5).astype(dtype)
    dy = rng.standard_normal((M, D)).astype(dtype)
    w = (1 + 0.2 * rng.standard_normal(D)).astype(dtype)
    for centered in (True, False):
        stats = kernel_forward(x, None, np.empty_like(x), None, w, w, centered, 1)
        want_dx = np.empty_like(x)
        want = kernel_backward(dy, x, None, *stats, w, want_dx, centered, 1)
        for n in (1, 2, 3):
            for name, dx in out_layouts(x):
                got = kernel_backward(dy, x, None, *stats, w, dx, centered, n)
                check_same(dx, want_dx, f"dx {name}, {n} threads")
                check_same(got, want, f"dweight/dbias ({name} dx), {n} threads")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["fortran", "channels-first"])
def test_rows_redone_in_float64_with_outputs_of_another_layout(dtype, kind):
    # rows whose squares would underflow are redone from a copy of the row
    # (tiles whose outputs are not in x's layout take x's rows as they lie)
    rng = np.random.default_rng(7)
    x, axis = make_x(rng, kind, dtype)
    rows = np.moveaxis(x, axis, -1)
    tiny = 1e-20 if dtype == np.float32 else 1e-160
    rows[(1,) * (x.ndim - 1)] = tiny * rng.standard_normal(rows.shape[-1])
    ref = rows.astype(np.float64)
    ref[(1,) * (x.ndim - 1)] *= 2.0 ** (70 if dtype == np.float32 else 530)  # (exactly: no subnormal squares)
    mean = ref.mean(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):     # (the constant row: NaN)
        want = (ref - mean) / np.sqrt(((ref - mean) ** 2).mean(-1, keepdims=True))
    for y in (lnfast.layer_norm(x, eps=0.0, axis=axis),
              lnfast.add_layer_norm_forward(x, np.zeros_like(x), eps=0.0, axis=axis)[0]):
        got = np.moveaxis(y, axis, -1).astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 if dtype == np.float32 else 1e-12)
