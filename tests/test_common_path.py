"""Every NumPy call takes one path, lnfast._kernels.forward and backward
(docs/api.md, "Call overhead"): an ordinary call (plain arrays, a float
eps, no out=) is recognised without the Python checks; any other is checked
by lnfast._checks and made ordinary.  Both must give the same arrays, bit
for bit, and every call that is not ordinary must meet the checks, so that
a bad one is worded as the SPEC says."""
import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import _checks, _kernels

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16]


def compute(dtype):
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def forward(x, residual, weight, bias, eps, centered, stats):
    return _kernels.forward(x, residual, weight, bias, eps, None, centered, stats)


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes()


@pytest.fixture
def checks_seen(monkeypatch):
    """The calls that met the Python checks, by name."""
    seen = []
    for name in ("forward_args", "backward_args"):
        check = getattr(_checks, name)

        def spy(*args, _check=check, _name=name):
            seen.append(_name)
            return _check(*args)

        monkeypatch.setattr(_checks, name, spy)
    return seen


def checked(a):
    """`a` as a view of a subclass: the same data, no longer ordinary."""
    return None if a is None else a.view(Sub)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 4097), (64, 768), (300, 256), (5,)])
@pytest.mark.parametrize("kind", ["layer_norm", "add_layer_norm", "rms_norm"])
@pytest.mark.parametrize("given", ["no weight", "weight", "weight and bias",
                                   "weight and bias of x's dtype"])
def test_checked_calls_give_the_ordinary_result(rng, checks_seen, dtype, shape, kind, given):
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    residual = rng.standard_normal(shape).astype(dtype) if kind == "add_layer_norm" else None
    D, centered = shape[-1], kind != "rms_norm"
    pdtype = dtype if given.endswith("x's dtype") else compute(dtype)
    w = rng.standard_normal(D).astype(pdtype) if given != "no weight" else None
    b = rng.standard_normal(D).astype(pdtype) if given.startswith("weight and bias") else None
    for stats in (False, True):
        got = forward(x, residual, w, b, 1e-5, centered, stats)
        assert checks_seen == []
        want = forward(checked(x), checked(residual), checked(w), checked(b), 1e-5, centered,
                       stats)
        assert checks_seen == ["forward_args"]
        checks_seen.clear()
        assert_same(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 3, 4097), (64, 768), (300, 256), (5,)])
@pytest.mark.parametrize("kind", ["layer_norm", "add_layer_norm", "rms_norm"])
@pytest.mark.parametrize("weight", ["none", "compute dtype", "x's dtype"])
def test_checked_backward_calls_give_the_ordinary_result(rng, checks_seen, dtype, shape, kind,
                                                         weight):
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    dz = rng.standard_normal(shape).astype(dtype) if kind == "add_layer_norm" else None
    D, centered = shape[-1], kind != "rms_norm"
    pdtype = dtype if weight == "x's dtype" else compute(dtype)
    w = rng.standard_normal(D).astype(pdtype) if weight != "none" else None
    _, _, mean, rstd = forward(x, None, w, None, 1e-5, centered, True)
    got = _kernels.backward(dy, x, mean, rstd, w, dz, centered)
    assert checks_seen == []
    want = _kernels.backward(checked(dy), checked(x), checked(mean), checked(rstd), checked(w),
                             checked(dz), centered)
    assert checks_seen == ["backward_args"]
    assert_same(got, want)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_same_bits_for_any_thread_count(rng, threads):
    x = rng.standard_normal((300, 256)).astype(np.float32)
    want = forward(x, None, None, None, 1e-5, True, True)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    want_grads = _kernels.backward(dy, x, want[2], want[3], None, None, True)
    lnfast.set_num_threads(threads)
    assert_same(forward(x, None, None, None, 1e-5, True, True), want)
    assert_same(_kernels.backward(dy, x, want[2], want[3], None, None, True), want_grads)


def test_ordinary_calls_skip_the_python_checks(rng, checks_seen):
    x, w = rng.standard_normal((4, 8)), rng.standard_normal(8)
    y, mean, rstd = lnfast.layer_norm_forward(x, w)
    lnfast.layer_norm(x, w, w)
    lnfast.layer_norm_backward(y, x, mean, rstd, w)
    lnfast.add_layer_norm_forward(x, x, bias=w)
    lnfast.add_layer_norm_backward(y, x, mean, rstd, dz=y)
    lnfast.rms_norm(x)
    _, rstd = lnfast.rms_norm_forward(x, w)
    lnfast.rms_norm_backward(y, x, rstd)
    assert checks_seen == []
    lnfast.layer_norm(x, w, w, out=np.empty_like(x))       # out= is not ordinary
    assert checks_seen == ["forward_args"]
    lnfast.layer_norm_backward(y, x, mean.astype(np.float32), rstd, w)
    assert checks_seen == ["forward_args", "backward_args"]


class Sub(np.ndarray):
    pass


def uncommon_calls():
    """(what is uncommon, x, residual, weight, bias, eps): valid calls and
    bad ones alike, each to be declined."""
    x = np.ones((4, 8), np.float32)
    w = np.ones(8, np.float32)
    misaligned = np.frombuffer(bytearray(4 * 33), np.float32, count=32, offset=1).reshape(4, 8)
    fortran = np.asfortranarray(x)
    return [
        ("x a list", x.tolist(), None, w, w, 1e-5),
        ("x a subclass", x.view(Sub), None, w, w, 1e-5),
        ("x of integers", np.ones((4, 8), np.int32), None, None, None, 1e-5),
        ("x byte-swapped", x.astype(">f4"), None, w, w, 1e-5),
        ("x strided", np.ones((4, 16), np.float32)[:, ::2], None, w, w, 1e-5),
        ("x Fortran-ordered", fortran, None, None, None, 1e-5),
        ("x misaligned", misaligned, None, w, w, 1e-5),
        ("x 0-d", np.ones((), np.float32), None, None, None, 1e-5),
        ("x without rows", np.ones((0, 8), np.float32), None, w, w, 1e-5),
        ("x without columns", np.ones((4, 0), np.float32), None, None, None, 1e-5),
        ("eps an int", x, None, w, w, 0),
        ("eps a bool", x, None, w, w, True),
        ("eps a NumPy float", x, None, w, w, np.float64(1e-5)),
        ("eps NaN", x, None, w, w, float("nan")),
        ("eps infinite", x, None, w, w, float("inf")),
        ("eps negative", x, None, w, w, -1e-5),
        ("residual of another dtype", x, x.astype(np.float64), w, w, 1e-5),
        ("residual of another shape", x, np.ones((2, 8), np.float32), w, w, 1e-5),
        ("residual of another rank", x, np.ones((1, 4, 8), np.float32), w, w, 1e-5),
        ("residual strided", x, np.ones((4, 16), np.float32)[:, ::2], w, w, 1e-5),
        ("residual a list", x, x.tolist(), w, w, 1e-5),
        ("weight float64 for float32 x", x, None, w.astype(np.float64), None, 1e-5),
        ("weight float32 for float64 x", x.astype(np.float64), None, w, None, 1e-5),
        ("weight bfloat16 for float16 x", x.astype(np.float16), None, w.astype(BF16), None,
         1e-5),
        ("bias float16 for bfloat16 x", x.astype(BF16), None, None, w.astype(np.float16), 1e-5),
        ("weight 2-D", x, None, w.reshape(1, 8), None, 1e-5),
        ("weight too short", x, None, w[:7], None, 1e-5),
        ("weight strided", x, None, np.ones(16, np.float32)[::2], None, 1e-5),
        ("weight a list", x, None, w.tolist(), None, 1e-5),
        ("weight byte-swapped", x, None, w.astype(">f4"), None, 1e-5),
        ("bias float64 for float32 x", x, None, w, w.astype(np.float64), 1e-5),
        ("bias too long", x, None, w, np.ones(9, np.float32), 1e-5),
        ("bias a subclass", x, None, w, w.view(Sub), 1e-5),
    ]


@pytest.mark.parametrize("what, x, residual, weight, bias, eps", uncommon_calls(),
                         ids=[c[0] for c in uncommon_calls()])
def test_every_other_call_meets_the_checks(checks_seen, what, x, residual, weight, bias, eps):
    for centered in (True, False):
        if not centered and what.startswith("bias"):
            continue        # (RMSNorm reads no bias)
        for stats in (False, True):
            checks_seen.clear()
            try:
                forward(x, residual, weight, bias, eps, centered, stats)
            except (TypeError, ValueError):
                pass
            assert checks_seen == ["forward_args"]


VALID_UNCOMMON = ("x a subclass", "x strided", "x Fortran-ordered", "x misaligned",
                  "eps an int", "eps a NumPy float", "residual strided",
                  "weight float32 for float64 x", "weight strided")


def made_common(a, dtype):
    """An aligned C-ordered ndarray copy of `a` (or None)."""
    return None if a is None else np.array(a, dtype, order="C")


@pytest.mark.parametrize("what, x, residual, weight, bias, eps",
                         [c for c in uncommon_calls() if c[0] in VALID_UNCOMMON],
                         ids=VALID_UNCOMMON)
def test_valid_uncommon_calls_give_the_common_result(checks_seen, what, x, residual, weight,
                                                     bias, eps):
    cx, cr = made_common(x, x.dtype), made_common(residual, x.dtype)
    cw, cb = made_common(weight, compute(x.dtype)), made_common(bias, compute(x.dtype))
    forward(cx, cr, cw, cb, float(eps), True, True)
    assert checks_seen == []
    if residual is None:
        got = lnfast.layer_norm_forward(x, weight, bias, eps=eps)
        want = lnfast.layer_norm_forward(cx, cw, cb, eps=float(eps))
    else:
        got = lnfast.add_layer_norm_forward(x, residual, weight, bias, eps=eps)
        want = lnfast.add_layer_norm_forward(cx, cr, cw, cb, eps=float(eps))
    assert_same(got, want)


def uncommon_backward_calls():
    """(what is uncommon, dy, x, mean, rstd, weight, dz), each to be declined."""
    x = np.ones((4, 8), np.float32)
    s = np.ones(4, np.float32)
    w = np.ones(8, np.float32)
    return [
        ("x a list", x, x.tolist(), s, s, w, None),
        ("x a subclass", x, x.view(Sub), s, s, w, None),
        ("x of integers", x, x.astype(np.int32), s, s, w, None),
        ("x strided", x, np.ones((4, 16), np.float32)[:, ::2], s, s, w, None),
        ("x without rows", x[:0], x[:0], s[:0], s[:0], w, None),
        ("dy of another dtype", x.astype(np.float64), x, s, s, w, None),
        ("dy of another shape", x[:2], x, s, s, w, None),
        ("dy a list", x.tolist(), x, s, s, w, None),
        ("dy byte-swapped", x.astype(">f4"), x, s, s, w, None),
        ("dz of another dtype", x, x, s, s, w, x.astype(np.float64)),
        ("dz strided", x, x, s, s, w, np.ones((4, 16), np.float32)[:, ::2]),
        ("mean float64 for float32 x", x, x, s.astype(np.float64), s, w, None),
        ("mean of another shape", x, x, s[:3], s, w, None),
        ("mean None", x, x, None, s, w, None),
        ("rstd float16 for float16 x", x.astype(np.float16), x.astype(np.float16), s,
         s.astype(np.float16), w, None),
        ("rstd 2-D", x, x, s, s.reshape(4, 1), w, None),
        ("rstd strided", x, x, s, np.ones(8, np.float32)[::2], w, None),
        ("rstd a list", x, x, s, s.tolist(), w, None),
        ("weight float64 for float32 x", x, x, s, s, w.astype(np.float64), None),
        ("weight float16 for bfloat16 x", x.astype(BF16), x.astype(BF16), s, s,
         w.astype(np.float16), None),
        ("weight too long", x, x, s, s, np.ones(9, np.float32), None),
    ]


@pytest.mark.parametrize("what, dy, x, mean, rstd, weight, dz", uncommon_backward_calls(),
                         ids=[c[0] for c in uncommon_backward_calls()])
def test_every_other_backward_call_meets_the_checks(checks_seen, what, dy, x, mean, rstd,
                                                    weight, dz):
    centered = (True,) if what.startswith("mean") else (True, False)
    for c in centered:
        checks_seen.clear()
        try:
            _kernels.backward(dy, x, mean, rstd, weight, dz, c)
        except (TypeError, ValueError):
            pass
        assert checks_seen == ["backward_args"]
