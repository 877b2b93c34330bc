"""SPEC "Bad input": each bad argument raises TypeError or ValueError naming
the argument, and a failed call leaves every argument unchanged."""
import ml_dtypes
import numpy as np
import pytest

import lnfast

D = 8


@pytest.fixture
def args(rng):
    x = rng.standard_normal((4, D))
    _, mean, rstd = lnfast.layer_norm_forward(x)
    return dict(x=x, w=rng.standard_normal(D), b=rng.standard_normal(D),
                dy=rng.standard_normal((4, D)), mean=mean, rstd=rstd)


def raises(exc, name, fn, *a, **kw):
    """Call fn, expect `exc` whose message names `name`; inputs must not change."""
    arrays = [v for v in list(a) + list(kw.values()) if isinstance(v, np.ndarray)]
    before = [v.copy() for v in arrays]
    with pytest.raises(exc, match=rf"\b{name}\b"):
        fn(*a, **kw)
    for v, old in zip(arrays, before):
        assert v.tobytes() == old.tobytes() if v.dtype != object else (v == old).all()


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.complex64, object, np.bool_])
def test_x_of_non_float_dtype(dtype):
    x = np.ones((2, D), dtype=dtype)
    raises(TypeError, "x", lnfast.layer_norm, x)
    raises(TypeError, "x", lnfast.layer_norm_forward, x)


def test_byte_swapped_arrays(args):
    # Not a float dtype the kernels read; the message shows the byte order.
    for fn in (lnfast.layer_norm, lnfast.rms_norm_forward):
        raises(TypeError, "x", fn, args["x"].astype(">f8"))
    raises(TypeError, "weight", lnfast.layer_norm, args["x"], args["w"].astype(">f8"))
    raises(TypeError, "residual", lnfast.add_layer_norm_forward, args["x"], args["x"].astype(">f8"))
    with pytest.raises(TypeError, match="byte order") as info:
        lnfast.layer_norm(args["x"].astype(">f4"))
    assert "newbyteorder" in str(info.value)      # how to convert an input
    out = np.zeros(args["x"].shape, ">f4")
    with pytest.raises(TypeError, match="^out .*byte order") as info:
        lnfast.layer_norm(args["x"], out=out)
    assert "astype" not in str(info.value)        # a converted copy is not written back
    assert not out.any()


@pytest.mark.parametrize("fn", [lnfast.layer_norm, lnfast.layer_norm_forward])
@pytest.mark.parametrize("x", [[[1.0, 2.0]], 3.0, None, "abc"])
def test_x_not_an_array(fn, x):
    raises(TypeError, "x", fn, x)


def test_weight_or_bias_not_an_array(args):
    raises(TypeError, "weight", lnfast.layer_norm, args["x"], [1.0] * D)
    raises(TypeError, "bias", lnfast.layer_norm, args["x"], None, list(range(D)))


@pytest.mark.parametrize("name", ["weight", "bias"])
@pytest.mark.parametrize("n", [D - 1, D + 1])
def test_weight_or_bias_of_wrong_length(args, name, n):
    kw = {name: np.ones(n)}
    raises(ValueError, name, lnfast.layer_norm, args["x"], **kw)
    raises(ValueError, name, lnfast.layer_norm_forward, args["x"], **kw)


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_weight_or_bias_of_wrong_dtype(args, name):
    kw = {name: np.ones(D, np.int64)}
    raises(TypeError, name, lnfast.layer_norm, args["x"], **kw)
    kw = {name: np.ones(D, np.float64)}                 # float64 for float32 x
    raises(TypeError, name, lnfast.layer_norm, args["x"].astype(np.float32), **kw)


def test_two_dimensional_weight(args):
    raises(ValueError, "weight", lnfast.layer_norm, args["x"], np.ones((1, D)))


def test_zero_features():
    x = np.ones((3, 0))
    raises(ValueError, "x", lnfast.layer_norm, x)
    raises(ValueError, "x", lnfast.layer_norm_forward, x)
    raises(ValueError, "x", lnfast.layer_norm_backward, x, x, np.ones(3), np.ones(3))


def test_zero_dimensional_x():
    raises(ValueError, "x", lnfast.layer_norm, np.array(1.0))


@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf"), -0.5])
def test_eps_negative_or_not_finite(args, eps):
    raises(ValueError, "eps", lnfast.layer_norm, args["x"], eps=eps)
    raises(ValueError, "eps", lnfast.layer_norm_forward, args["x"], eps=eps)


def test_eps_integer_past_float64_says_so_briefly(args):
    for big in (10 ** 400, 10 ** 5000):     # (past str()'s 4300 digits too)
        with pytest.raises(ValueError, match="eps .* integer of [0-9]+ bits") as info:
            lnfast.layer_norm(args["x"], eps=big)
        assert len(str(info.value)) < 100


@pytest.mark.parametrize("eps", ["1e-5", None, True, 1j, np.array(True), np.array(1j),
                                 np.array([1e-5]), np.array(["1e-5"]),
                                 np.ma.masked_array(1.0, mask=True), np.ma.masked_array(1.0)])
def test_eps_not_a_number(args, eps):
    raises(TypeError, "eps", lnfast.layer_norm, args["x"], eps=eps)


def test_eps_the_masked_constant(args):
    with pytest.raises(TypeError, match="eps"):     # (raises() cannot copy it to compare)
        lnfast.layer_norm(args["x"], eps=np.ma.masked)


def test_eps_an_array_of_more_than_one_value_says_so(args):
    with pytest.raises(TypeError, match=r"eps must be a real number, got ndarray of dtype "
                                        r"float64 and shape \(1,\)"):
        lnfast.layer_norm(args["x"], eps=np.array([1e-5]))


@pytest.mark.parametrize("eps", [np.array(1e-3), np.array(1e-3, np.float32), np.array(2),
                                 np.float16(1e-3), np.int8(2), ml_dtypes.bfloat16(1e-3),
                                 np.array(1e-3, ml_dtypes.bfloat16)])
def test_eps_a_numpy_scalar_or_zero_dimensional_array(args, eps):
    """As NumPy's own functions take one for a number: its value."""
    x = args["x"]
    want = lnfast.layer_norm(x, eps=float(eps))
    assert np.array_equal(lnfast.layer_norm(x, eps=eps), want)
    assert np.array_equal(lnfast.layer_norm_forward(x, eps=eps)[0], want)
    raises(ValueError, "eps", lnfast.layer_norm, x, eps=-eps)


@pytest.mark.parametrize("eps", [np.longdouble("1e4000"), ml_dtypes.bfloat16("nan")])
def test_eps_past_float64_or_nan_of_another_type_shows_the_value_given(args, eps):
    with pytest.raises(ValueError, match=r"eps must be finite and >= 0, got .*(e\+4000|nan)"):
        lnfast.layer_norm(args["x"], eps=eps)


@pytest.mark.parametrize("eps", [np.zeros((), "V8"), np.zeros((), [("a", "f8")]),
                                 np.timedelta64(1, "ns"), np.timedelta64("NaT"),
                                 np.datetime64(1, "s"), np.bool_(False)])
def test_eps_of_a_dtype_not_of_numbers(args, eps):
    raises(TypeError, "eps", lnfast.layer_norm, args["x"], eps=eps)


def test_add_layer_norm_backward_names_z_in_its_messages(args):
    z, dy = args["x"], args["dy"]
    _, _, mean, rstd = lnfast.add_layer_norm_forward(z, np.zeros_like(z))
    for kw, exc, what in [(dict(weight=np.ones(D, np.float16)), TypeError, "that of z"),
                          (dict(mean=mean[:2]), ValueError, "z's without the normalized"),
                          (dict(rstd=rstd[:2]), ValueError, "z's without the normalized"),
                          (dict(axis=2), ValueError, "out of range for z of 2")]:
        call = dict(dy=dy, z=z, mean=mean, rstd=rstd)
        call.update(kw)
        with pytest.raises(exc, match=what):
            lnfast.add_layer_norm_backward(**call)


def test_out_of_wrong_shape(args):
    raises(ValueError, "out", lnfast.layer_norm, args["x"], out=np.empty((4, D + 1)))
    raises(ValueError, "out", lnfast.layer_norm, args["x"], out=np.empty((D, 4)))


def test_out_of_wrong_dtype(args):
    raises(TypeError, "out", lnfast.layer_norm, args["x"], out=np.empty((4, D), np.float32))


def test_out_read_only(args):
    out = np.zeros((4, D))
    out.flags.writeable = False
    raises(ValueError, "out", lnfast.layer_norm, args["x"], out=out)
    assert not out.any()


def test_out_not_an_array(args):
    raises(TypeError, "out", lnfast.layer_norm, args["x"], out=[0.0] * D)


@pytest.mark.parametrize("name", ["mean", "rstd"])
def test_stats_of_wrong_shape(args, name):
    a = dict(args)
    a[name] = np.ones(5)
    raises(ValueError, name, lnfast.layer_norm_backward,
           a["dy"], a["x"], a["mean"], a["rstd"], a["w"])
    a[name] = np.ones((4, 1))
    raises(ValueError, name, lnfast.layer_norm_backward,
           a["dy"], a["x"], a["mean"], a["rstd"], a["w"])


@pytest.mark.parametrize("name", ["mean", "rstd"])
def test_stats_of_wrong_dtype_or_type(args, name):
    a = dict(args)
    a[name] = np.ones(4, np.int32)
    raises(TypeError, name, lnfast.layer_norm_backward,
           a["dy"], a["x"], a["mean"], a["rstd"])
    a[name] = [1.0] * 4
    raises(TypeError, name, lnfast.layer_norm_backward,
           a["dy"], a["x"], a["mean"], a["rstd"])


def test_dy_of_wrong_shape(args):
    raises(ValueError, "dy", lnfast.layer_norm_backward,
           args["dy"][:, :-1], args["x"], args["mean"], args["rstd"])
    raises(ValueError, "dy", lnfast.layer_norm_backward,
           args["dy"][:3], args["x"], args["mean"], args["rstd"])


def test_dy_of_wrong_dtype_or_type(args):
    raises(TypeError, "dy", lnfast.layer_norm_backward,
           args["dy"].astype(np.float32), args["x"], args["mean"], args["rstd"])
    raises(TypeError, "dy", lnfast.layer_norm_backward,
           args["dy"].tolist(), args["x"], args["mean"], args["rstd"])


def test_backward_x_bad(args):
    raises(TypeError, "x", lnfast.layer_norm_backward,
           args["dy"], args["x"].astype(np.int64), args["mean"], args["rstd"])
    raises(TypeError, "x", lnfast.layer_norm_backward,
           args["dy"], None, args["mean"], args["rstd"])


def test_backward_weight_bad(args):
    raises(ValueError, "weight", lnfast.layer_norm_backward,
           args["dy"], args["x"], args["mean"], args["rstd"], np.ones(D + 1))
    raises(TypeError, "weight", lnfast.layer_norm_backward,
           args["dy"], args["x"], args["mean"], args["rstd"], np.ones(D, np.int8))


def test_keyword_only_eps_and_out(args):
    with pytest.raises(TypeError):
        lnfast.layer_norm(args["x"], None, None, 1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stats_of_a_1d_x_as_np_mean_returns_them(dtype):
    """SPEC "Axes": mean and rstd are what np.mean(x, axis=axis) returns,
    for a 1-D x a NumPy scalar; the backward passes take it as the 0-d
    array the forward returns.  A Python float stays a TypeError."""
    x = np.array([1.0, 2.0, 4.0, -3.0, 0.5], dtype)
    dy = np.array([0.5, -1.0, 2.0, 1.0, 0.25], dtype)
    y, mean, rstd = lnfast.layer_norm_forward(x)
    m, r = mean[()], rstd[()]
    assert isinstance(m, np.generic) and isinstance(r, np.generic)
    for got, want in zip(lnfast.layer_norm_backward(dy, x, m, r),
                         lnfast.layer_norm_backward(dy, x, mean, rstd)):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    _, z, zmean, zrstd = lnfast.add_layer_norm_forward(x, dy)
    for got, want in zip(lnfast.add_layer_norm_backward(dy, z, zmean[()], zrstd[()], dz=x),
                         lnfast.add_layer_norm_backward(dy, z, zmean, zrstd, dz=x)):
        assert np.array_equal(got, want)
    _, rms = lnfast.rms_norm_forward(x)
    for got, want in zip(lnfast.rms_norm_backward(dy, x, rms[()]),
                         lnfast.rms_norm_backward(dy, x, rms)):
        assert np.array_equal(got, want)
    # np.mean's own scalar works too
    ref = x.astype(np.float64)
    dx = lnfast.layer_norm_backward(dy, x, np.mean(x), dtype(1 / np.sqrt(ref.var() + 1e-5)))[0]
    assert np.all(np.isfinite(dx))
    raises(TypeError, "mean", lnfast.layer_norm_backward, dy, x, float(m), rstd)
    raises(TypeError, "rstd", lnfast.rms_norm_backward, dy, x, float(r))


def test_numpy_matrix_is_refused():
    # a matrix stays 2-D when reshaped: refused by name, as masked arrays are
    a = np.arange(6.0).reshape(2, 3)
    with pytest.raises(TypeError, match="x must not be a numpy.matrix"):
        lnfast.layer_norm(np.asmatrix(a), axis=(0, 1))
    out = np.asmatrix(np.zeros((2, 3)))
    with pytest.raises(TypeError, match="out must not be a numpy.matrix"):
        lnfast.rms_norm(a, axis=(0, 1), out=out)
    assert not out.any()


def test_strides_past_a_pointers_reach(args):
    # (as_strided makes them; the kernels would address past the address space)
    # (not through raises(): such an array cannot be copied to compare)
    x = args["x"]
    far = np.lib.stride_tricks.as_strided(x, (3, D), (2 ** 62, x.itemsize))
    with pytest.raises(ValueError, match=r"^x has .* strides that reach past"):
        lnfast.layer_norm(far)
    out = np.zeros_like(x[:3])
    with pytest.raises(ValueError, match=r"^out has .* strides that reach past"):
        lnfast.layer_norm(x[:3], out=np.lib.stride_tricks.as_strided(out, (3, D),
                                                                     (2 ** 62, out.itemsize)))
    assert not out.any()
    # a single row's stride addresses nothing, however large
    one = np.lib.stride_tricks.as_strided(x, (1, D), (-2 ** 63, x.itemsize))
    assert np.array_equal(lnfast.layer_norm(one), lnfast.layer_norm(x[:1]))
