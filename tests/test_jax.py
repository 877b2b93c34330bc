"""lnfast.jax: the XLA FFI custom calls under jit, grad and vmap, against
jax.numpy, the float64 reference and lnfast's NumPy functions (the same
kernels: the same bits)."""
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import lnfast
from lnfast import reference
from tests.helpers import data, same

jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

lj = pytest.importorskip("lnfast.jax")

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


def jnp_layer_norm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = jnp.square(x - mu).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


# --- the same bits as lnfast's NumPy functions -----------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 7, 333, 1024])
def test_layer_norm_is_the_numpy_call(rng, dtype, D):
    x, dy = data(rng, (13, D), dtype, 2.0, 3.0), data(rng, (13, D), dtype)
    w, b = data(rng, D, dtype), data(rng, D, dtype)
    f = jax.jit(lambda x, w, b: lj.layer_norm(x, w, b, eps=1e-4))
    same(f(x, w, b), lnfast.layer_norm(x, w, b, eps=1e-4))
    grads = jax.jit(lambda x, w, b, dy: jax.vjp(
        lambda *a: lj.layer_norm(*a, eps=1e-4), x, w, b)[1](dy))(x, w, b, dy)
    _, mean, rstd = lnfast.layer_norm_forward(x, w, b, eps=1e-4)
    for g, want in zip(grads, lnfast.layer_norm_backward(dy, x, mean, rstd, w)):
        same(g, want)


@pytest.mark.parametrize("eps", [0.0, 1.0])
def test_subnormal_values_keep_the_numpy_calls_bits(eps):
    # XLA runs custom calls with flush-to-zero on; the kernels do not flush.
    x = np.array([[1e-40, -1e-40, 2e-40, 0.0], [1e-38, -1e-38, 2e-38, 3e-39]], np.float32)
    dy = x[::-1].copy()
    w, b = np.full(4, 1e-3, np.float32), np.zeros(4, np.float32)
    f = jax.jit(lambda x, w, b: lj.layer_norm(x, w, b, eps=eps))
    same(f(x, w, b), lnfast.layer_norm(x, w, b, eps=eps))
    _, mean, rstd = lnfast.layer_norm_forward(x, w, b, eps=eps)
    grads = jax.jit(lambda *a: jax.vjp(f, *a)[1](dy))(x, w, b)
    want = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    assert np.any(want[2] != 0) and np.any(np.abs(want[2]) < np.finfo(np.float32).tiny)
    for g, e in zip(grads, want):       # (dweight, dbias: rounded outside XLA's mode too)
        same(g, e)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_numpy_call(rng, dtype):
    x, dy = data(rng, (4, 5, 96), dtype), data(rng, (4, 5, 96), dtype)
    w = data(rng, 96, np.float32)
    same(jax.jit(lj.rms_norm)(x, w), lnfast.rms_norm(x, w))
    dx, dw = jax.vjp(lj.rms_norm, x, w)[1](dy)
    DX, DW = lnfast.rms_norm_backward(dy, x, lnfast.rms_norm_forward(x, w)[1], w)
    same(dx, DX)
    same(dw, DW)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_is_the_numpy_call(rng, dtype):
    x, r, dy, dz = (data(rng, (9, 40), dtype) for _ in range(4))
    w, b = data(rng, 40, dtype), data(rng, 40, dtype)
    (y, z), vjp = jax.vjp(lambda x, r, w, b: lj.add_layer_norm(x, r, w, b), x, r, w, b)
    Y, Z, MEAN, RSTD = lnfast.add_layer_norm_forward(x, r, w, b)
    same(y, Y)
    same(z, Z)
    dx, dr, dw, db = vjp((dy, dz))
    DS, DW, DB = lnfast.add_layer_norm_backward(dy, Z, MEAN, RSTD, w, dz=dz)
    for g, want in ((dx, DS), (dr, DS), (dw, DW), (db, DB)):
        same(g, want)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_weight_and_bias_of_different_dtypes(rng, dtype):
    # a 16-bit weight with a float32 bias: each keeps its dtype, and its
    # gradient is its float64 sums rounded once (as the NumPy call rounds)
    x, dy = data(rng, (33, 24), dtype, 2.0, 1.0), data(rng, (33, 24), dtype)
    w, b = data(rng, 24, dtype), data(rng, 24, np.float32)
    y, vjp = jax.vjp(lj.layer_norm, x, w, b)
    same(y, lnfast.layer_norm(x, w, b))
    dx, dw, db = vjp(dy)
    _, mean, rstd = lnfast.layer_norm_forward(x, w, b)
    DX, DW, _ = lnfast.layer_norm_backward(dy, x, mean, rstd, w)
    _, _, DB = lnfast.layer_norm_backward(dy, x, mean, rstd, w.astype(np.float32))
    same(dx, DX)
    same(dw, DW)
    same(db, DB)


def test_no_weight_no_bias(rng):
    x = data(rng, (6, 24), np.float16)
    same(lj.layer_norm(x), lnfast.layer_norm(x))
    dx = jax.grad(lambda x: jnp.sum(lj.layer_norm(x).astype(jnp.float32) ** 3))(x)
    assert dx.dtype == jnp.float16 and dx.shape == x.shape
    same(lj.rms_norm(x, eps=1e-3), lnfast.rms_norm(x, eps=1e-3))


@pytest.mark.parametrize("axis", [0, 1, (1, 2), (0, 2), -1])
def test_any_axis(rng, axis):
    x = data(rng, (6, 5, 7), np.float64)
    ax = lnfast._checks.axes(axis, 3)
    shape = tuple(x.shape[k] for k in ax)
    w, b = data(rng, shape, np.float64), data(rng, shape, np.float64)
    y = jax.jit(lambda x, w, b: lj.layer_norm(x, w, b, axis=axis))(x, w, b)
    np.testing.assert_allclose(y, lnfast.layer_norm(x, w, b, axis=axis), rtol=1e-13, atol=1e-13)
    dy = data(rng, x.shape, np.float64)
    got = jax.vjp(lambda *a: lj.layer_norm(*a, axis=axis), x, w, b)[1](dy)
    _, mean, rstd = lnfast.layer_norm_forward(x, w, b, axis=axis)
    for g, want in zip(got, lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=axis)):
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)


def test_zero_rows(rng):
    x = np.zeros((0, 8), np.float32)
    assert lj.layer_norm(x).shape == (0, 8)
    dx, dw, db = jax.vjp(lj.layer_norm, x, np.ones(8, np.float32), np.zeros(8, np.float32))[1](x)
    assert dx.shape == (0, 8)
    same(dw, np.zeros(8, np.float32))
    same(db, np.zeros(8, np.float32))


# --- against jax.numpy and float64 -----------------------------------------------------

def test_against_jax_numpy_and_float64(rng):
    x, dy = data(rng, (64, 200), np.float32, 3.0, 1e3), data(rng, (64, 200), np.float32)
    w, b = data(rng, 200, np.float32), data(rng, 200, np.float32)
    y = lj.layer_norm(x, w, b)
    ref_y = reference.layer_norm_forward(x, w, b)[0]
    assert reference.rel_error(np.asarray(y), ref_y) <= 2e-6
    assert reference.rel_error(np.asarray(jnp_layer_norm(x, w, b)), ref_y) <= 1e-4
    got = jax.vjp(lj.layer_norm, x, w, b)[1](dy)
    _, mean, rstd = reference.layer_norm_forward(x, w, b)
    for g, want in zip(got, reference.layer_norm_backward(dy, x, mean, rstd, w)):
        assert reference.rel_error(np.asarray(g), want) <= 2e-5
    # RMSNorm against jax.numpy's, outputs and gradients
    def jnp_rms_norm(x, w, eps=1e-5):
        return x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps) * w

    x64, w64, dy64 = x.astype(np.float64) - 1e3, w.astype(np.float64), dy.astype(np.float64)
    for got, want in zip(jax.vjp(lj.rms_norm, x64, w64)[1](dy64),
                         jax.vjp(jnp_rms_norm, x64, w64)[1](dy64)):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lj.rms_norm(x64, w64), jnp_rms_norm(x64, w64), rtol=1e-12,
                               atol=1e-12)


def test_check_grads_float64(rng):
    x, r = data(rng, (3, 4, 6), np.float64), data(rng, (3, 4, 6), np.float64)
    w, b = data(rng, 6, np.float64), data(rng, 6, np.float64)
    check_grads(lambda x, w, b: lj.layer_norm(x, w, b), (x, w, b), order=1, modes=["rev"])
    check_grads(lambda x, w: lj.rms_norm(x, w), (x, w), order=1, modes=["rev"])
    check_grads(lambda x, r, w, b: lj.add_layer_norm(x, r, w, b), (x, r, w, b), order=1,
                modes=["rev"])
    w2, w0 = data(rng, (4, 6), np.float64), data(rng, 3, np.float64)
    check_grads(lambda x, w: lj.layer_norm(x, w, axis=(1, 2)), (x, w2), order=1, modes=["rev"])
    check_grads(lambda x, w: lj.layer_norm(x, w, axis=0), (x, w0), order=1, modes=["rev"])


def test_forward_mode_and_second_derivatives_are_errors(rng):
    x = data(rng, (3, 8), np.float64)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lj.layer_norm, (x,), (x,))
    with pytest.raises(TypeError, match="first derivatives only"):
        jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(lj.layer_norm(x) ** 3))(x)))(x)
    with pytest.raises(TypeError, match="first derivatives only"):
        jax.hessian(lambda x: jnp.sum(lj.add_layer_norm(x, x)[0] ** 3))(x)


# --- vmap -----------------------------------------------------------------------

def test_vmap_adds_rows(rng):
    x, dy = data(rng, (5, 3, 16), np.float32), data(rng, (5, 3, 16), np.float32)
    w, b = data(rng, 16, np.float32), data(rng, 16, np.float32)
    same(jax.vmap(lambda x: lj.layer_norm(x, w, b))(x), lnfast.layer_norm(x, w, b))
    # per-example gradients of a shared weight: each batch its own sums
    per = jax.vmap(lambda x, dy: jax.vjp(lambda w: lj.layer_norm(x, w, b), w)[1](dy)[0])(x, dy)
    for k in range(5):
        _, mean, rstd = lnfast.layer_norm_forward(x[k], w, b)
        same(per[k], lnfast.layer_norm_backward(dy[k], x[k], mean, rstd, w)[1])
    # the gradient of a vmapped function with a shared weight sums them
    gw = jax.grad(lambda w: jnp.sum(jax.vmap(lambda x: lj.layer_norm(x, w, b))(x) * dy))(w)
    np.testing.assert_allclose(gw, np.asarray(per).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_vmap_of_the_fused_step(rng, dtype):
    x, r, dy, dz = (data(rng, (3, 5, 16), dtype) for _ in range(4))
    w, b = data(rng, 16, dtype), data(rng, 16, dtype)
    (y, z), vjp = jax.vjp(jax.vmap(lambda x, r: lj.add_layer_norm(x, r, w, b)), x, r)
    dx, dr = vjp((dy, dz))
    for k in range(3):
        Y, Z, MEAN, RSTD = lnfast.add_layer_norm_forward(x[k], r[k], w, b)
        same(y[k], Y)
        same(z[k], Z)
        DS = lnfast.add_layer_norm_backward(dy[k], Z, MEAN, RSTD, w, dz=dz[k])[0]
        same(dx[k], DS)
        same(dr[k], DS)


def test_vmap_over_weights(rng):
    x = data(rng, (4, 3, 8), np.float64)
    w, b = data(rng, (4, 8), np.float64), data(rng, (4, 8), np.float64)
    y = jax.vmap(lambda x, w, b: lj.layer_norm(x, w, b))(x, w, b)
    for k in range(4):
        same(y[k], lnfast.layer_norm(x[k], w[k], b[k]))
    y2 = jax.vmap(lj.add_layer_norm, in_axes=(0, 0, 0, None))(x, x, w, b[0])
    for k in range(4):
        same(y2[0][k], lnfast.add_layer_norm_forward(x[k], x[k], w[k], b[0])[0])


def test_vmap_over_numpy_arrays_inside_a_traced_program(rng):
    # NumPy arrays closed over, mapped by vmap inside jit, eval_shape or
    # checkpoint, and NumPy cotangents: JAX's staging of the custom rules
    # once refused such tracers with an AssertionError
    x, r, dy = (data(rng, (3, 4, 8), np.float32) for _ in range(3))
    w, b = data(rng, 8, np.float32), data(rng, 8, np.float32)
    want = lnfast.layer_norm(x, w, b)
    same(jax.jit(lambda: jax.vmap(lambda x: lj.layer_norm(x, w, b))(x))(), want)
    same(jax.jit(lambda w: jax.vmap(lambda x: lj.layer_norm(x, w, b))(x))(w), want)
    same(jax.jit(lambda: jax.vmap(lj.rms_norm)(x))(), lnfast.rms_norm(x))
    same(jax.jit(lambda: jax.vmap(lj.add_layer_norm)(x, r))()[0],
         lnfast.add_layer_norm_forward(x, r)[0])
    assert jax.eval_shape(lambda: jax.vmap(lj.layer_norm)(x)).shape == x.shape
    same(jax.checkpoint(lambda w: jax.vmap(lambda x: lj.layer_norm(x, w, b))(x))(w), want)
    # NumPy cotangents, mapped, to each example's vjp inside jit
    dx = jax.jit(lambda: jax.vmap(
        lambda x, dy: jax.vjp(lambda x: lj.layer_norm(x, w, b), x)[1](dy)[0])(x, dy))()
    same(dx, lnfast.layer_norm_backward(dy, x, *lnfast.layer_norm_forward(x, w, b)[1:], w)[0])


# --- bad input --------------------------------------------------------------------

@pytest.mark.parametrize("call, error, match", [
    (lambda x: lj.layer_norm(x.astype(np.int32)), TypeError, "x must have dtype"),
    (lambda x: lj.layer_norm(x, np.ones(5, np.float32)), ValueError, "weight must have shape"),
    (lambda x: lj.layer_norm(x, np.ones(8, np.float64)), TypeError, "weight must have dtype"),
    (lambda x: lj.layer_norm(x, eps=-1.0), ValueError, "eps"),
    (lambda x: lj.layer_norm(x, axis=(0, 0)), ValueError, "axis"),
    (lambda x: lj.layer_norm(x, axis=2), ValueError, "axis"),
    (lambda x: lj.layer_norm(x[:, :0]), ValueError, "D >= 1"),
    (lambda x: lj.add_layer_norm(x, x[:1]), ValueError, "residual must have x's shape"),
    (lambda x: lj.add_layer_norm(x, x.astype(np.float16)), TypeError, "residual must have x's dtype"),
    (lambda x: jax.jit(lambda x, e: lj.layer_norm(x, eps=e))(x, 1e-3), TypeError, "eps .*traced"),
    (lambda x: lj.rms_norm([[1.0]]), TypeError, "x must be a JAX or NumPy array"),
    (lambda x: lj.layer_norm(jax.ShapeDtypeStruct(x.shape, x.dtype)), TypeError,
     "x must be a JAX or NumPy array"),
    (lambda x: lj.layer_norm(x, jax.ShapeDtypeStruct((8,), x.dtype)), TypeError,
     "weight must be a JAX or NumPy array"),
    (lambda x: lj.layer_norm(jax.random.split(jax.random.key(0), 32).reshape(4, 8)), TypeError,
     "x must have dtype .* got key"),
    (lambda x: lj.layer_norm(x, jax.random.split(jax.random.key(0), 8)), TypeError,
     "weight must have dtype .* got key"),
    (lambda x: lj.layer_norm(np.ma.array(x.astype(np.float64))), TypeError,
     "x must not be a masked array"),
    (lambda x: lj.add_layer_norm(x, np.ma.array(x)), TypeError,
     "residual must not be a masked array"),
    (lambda x: lj.layer_norm(x[:, :1], np.float32(2)), TypeError,
     "weight must be a JAX or NumPy array"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(np.ones((4, 8), np.float32))


def test_eps_may_be_a_concrete_jax_scalar():
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    want = lj.layer_norm(x, eps=1e-3)
    np.testing.assert_array_equal(lj.layer_norm(x, eps=jnp.float32(1e-3)),
                                  lj.layer_norm(x, eps=float(np.float32(1e-3))))
    assert not np.array_equal(want, lj.layer_norm(x))
    # an integer one too, as a 0-d NumPy integer array is taken
    np.testing.assert_array_equal(lj.rms_norm(x, eps=jnp.int32(2)), lj.rms_norm(x, eps=2.0))


def test_handlers_refuse_buffers_that_do_not_fit():
    # the targets are global: a call made by hand with a short rstd or y
    # is an error, not a write past the buffer's end
    x = jnp.ones((4, 8), jnp.float32)
    w = jnp.ones(8, jnp.float32)
    sds = jax.ShapeDtypeStruct
    for rstd_rows, y_rows in ((2, 4), (4, 3)):
        call = jax.ffi.ffi_call("lnfast_norm_forward", (
            sds((y_rows, 8), jnp.float32), sds((0,), jnp.float32), sds((4,), jnp.float32),
            sds((rstd_rows,), jnp.float32)))
        with pytest.raises(Exception, match="has the wrong size or type for x"):
            jax.block_until_ready(call(x, jnp.zeros(0, jnp.float32), w, w, eps=np.float64(1e-5),
                                       centered=np.int64(1), has_residual=np.int64(0),
                                       nthreads=np.int64(1)))


def test_import_lnfast_does_not_import_jax():
    p = subprocess.run([sys.executable, "-c", "import sys, lnfast; print('jax' in sys.modules)"],
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "False", p.stderr


def test_handlers_are_built_once_and_a_missing_compiler_is_a_clear_import_error(tmp_path):
    env = dict(__import__("os").environ, LNFAST_CACHE_DIR=str(tmp_path / "cache"))
    code = "import lnfast.jax"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    (built,) = (tmp_path / "cache").glob("lnfast_ffi-*.so")
    mtime = built.stat().st_mtime_ns
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0 and built.stat().st_mtime_ns == mtime     # (not built again)
    built.write_bytes(b"not a library")        # a damaged file is compiled again
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    assert built.stat().st_size > 1000
    env.update(LNFAST_CACHE_DIR="/proc/no-such-folder")     # (not writable: a temporary one)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    env.update(LNFAST_CACHE_DIR=str(tmp_path / "empty"), CXX=str(tmp_path / "no-such-c++"))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=600, env=env)
    assert p.returncode != 0
    assert "ImportError: lnfast.jax could not run the C++ compiler" in p.stderr, p.stderr


def test_float64_numpy_arguments_are_float32_without_x64(rng):
    """With jax_enable_x64 off, JAX takes float64 NumPy arrays as float32
    (jnp.asarray): so does lnfast.jax, for every argument, not only x."""
    x = rng.standard_normal((6, 16)).astype(np.float32)
    w, b, r = rng.standard_normal(16), rng.standard_normal(16), rng.standard_normal((6, 16))
    with jax.enable_x64(False):
        xj = jnp.asarray(x)
        want = lj.layer_norm(xj, jnp.asarray(w), jnp.asarray(b))
        for got in (lj.layer_norm(xj, w, b), jax.jit(lambda a: lj.layer_norm(a, w, b))(xj),
                    lj.layer_norm(x.astype(np.float64), w, b)):
            assert got.dtype == np.float32 and np.array_equal(got, want)
        assert np.array_equal(lj.rms_norm(xj, w), lj.rms_norm(xj, jnp.asarray(w)))
        y, z = lj.add_layer_norm(xj, r, w, b)
        assert z.dtype == np.float32
        assert np.array_equal(z, lj.add_layer_norm(xj, jnp.asarray(r), w, b)[1])
        dw = jax.grad(lambda w: jnp.sum(lj.layer_norm(xj, w) ** 2))(w)
        assert dw.dtype == np.float32
    # with x64 on, a float64 weight beside float32 x stays a clear TypeError
    with pytest.raises(TypeError, match="weight"):
        lj.layer_norm(x, w)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_weakly_typed_arguments_take_xs_dtype(rng, dtype):
    """A weakly typed array (of a Python scalar's type: float64 with x64 on)
    is taken in x's dtype, as jax.numpy's arithmetic takes it; its gradient
    comes back in its own dtype, as through jnp's conversion.  A strongly
    typed float64 one stays a TypeError."""
    x = jnp.asarray(rng.standard_normal((6, 16)), dtype)
    w, b = jnp.broadcast_to(1.5, (16,)), jnp.full(16, 0.25)
    r = jnp.full((6, 16), 0.5)
    assert w.weak_type and w.dtype == np.float64 and r.weak_type
    ws, bs, rs = (jnp.asarray(a, dtype) for a in (w, b, r))
    for got, want in ((lj.layer_norm(x, w, b), lj.layer_norm(x, ws, bs)),
                      (jax.jit(lambda w: lj.rms_norm(x, w))(w), lj.rms_norm(x, ws)),
                      (lj.add_layer_norm(x, r, w, b)[0], lj.add_layer_norm(x, rs, ws, bs)[0]),
                      (lj.layer_norm(x, jnp.broadcast_to(2, (16,))),
                       lj.layer_norm(x, jnp.full(16, 2, dtype)))):
        assert got.dtype == dtype and np.array_equal(got, want)

    def loss(w, b):
        return jnp.sum(lj.layer_norm(x, w, b).astype(np.float32) ** 2)

    dw, db = jax.grad(loss, (0, 1))(w, b)
    want = jax.grad(loss, (0, 1))(ws, bs)
    assert dw.dtype == np.float64 and np.array_equal(dw, want[0].astype(np.float64))
    assert np.array_equal(db, want[1].astype(np.float64))
    with pytest.raises(TypeError, match="weight"):
        lj.layer_norm(x, jnp.ones(16, np.float64))
    with pytest.raises(TypeError, match="residual"):
        lj.add_layer_norm(x, jnp.ones((6, 16), np.float64))


SHARD_MAP = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, jax, jax.numpy as jnp
import lnfast.jax as lj
from jax.sharding import Mesh, PartitionSpec as P
if not hasattr(jax, "shard_map"):
    print("no jax.shard_map"); raise SystemExit(0)
mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
rng = np.random.default_rng(0)
x, r, dy = (rng.standard_normal((8, 32)).astype(np.float32) for _ in range(3))
w, b = rng.standard_normal(32).astype(np.float32), rng.standard_normal(32).astype(np.float32)
def loss(norm):
    return lambda x, w, b: jnp.sum(norm(x, w, b) * dy)
layer_norm = lambda x, w, b: lj.layer_norm(x, w, b)
add = lambda x, w, b: lj.add_layer_norm(x, r, w, b)[0] + lj.add_layer_norm(x, r, w, b)[1]
for norm, rspec in ((layer_norm, None), (add, P("d"))):
    sharded = jax.shard_map(norm if rspec is None else
                            (lambda x, r_, w, b: lj.add_layer_norm(x, r_, w, b)[0]
                             + lj.add_layer_norm(x, r_, w, b)[1]),
                            mesh=mesh, out_specs=P("d"),
                            in_specs=(P("d"), P(), P()) if rspec is None
                            else (P("d"), P("d"), P(), P()))
    f = sharded if rspec is None else (lambda x, w, b: sharded(x, r, w, b))
    want = jax.grad(loss(norm), argnums=(0, 1, 2))(x, w, b)
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(x, w, b)
    assert np.asarray(got[0]).tobytes() == np.asarray(want[0]).tobytes()   # rows: the same bits
    for g, e in zip(got[1:], want[1:]):         # the shards' sums, added across the mesh
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
try:
    jax.shard_map(lambda x: lj.layer_norm(x), mesh=mesh, in_specs=P("d"), out_specs=P())(x)
except ValueError as e:
    assert "replicat" in str(e), e
else:
    raise AssertionError("a varying result taken as replicated")
print("ok")
"""


def test_shard_map_results_vary_as_x_and_replicated_weights_get_summed_gradients():
    # Under jax.shard_map the custom calls' results vary over x's mesh axes
    # (else JAX took them as replicated: gradients failed, out_specs=P()
    # returned one shard); a replicated weight's gradient is the sum over
    # the shards.
    p = subprocess.run([sys.executable, "-c", SHARD_MAP], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and p.stdout.strip() in ("ok", "no jax.shard_map"), p.stderr[-3000:]


def test_export_with_a_symbolic_batch():
    export = pytest.importorskip("jax.export")
    if not hasattr(export, "symbolic_shape"):
        pytest.skip("jax.export has no symbolic shapes")
    checks = [export.DisabledSafetyCheck.custom_call(name)
              for name in ("lnfast_norm_forward", "lnfast_norm_backward")]
    f = jax.jit(jax.value_and_grad(lambda x: jnp.sum(lj.layer_norm(x) ** 3)))
    exported = export.export(f, disabled_checks=checks)(
        jax.ShapeDtypeStruct(export.symbolic_shape("n, 12"), jnp.float32))
    rng = np.random.default_rng(0)
    for rows in (3, 5000):      # (a small and a large call, on the threads of a large one)
        x = rng.standard_normal((rows, 12)).astype(np.float32)
        for g, e in zip(exported.call(x), f(x)):
            same(g, e)
    with pytest.raises(ValueError, match="x's normalized axes must have known lengths"):
        export.export(jax.jit(lj.rms_norm), disabled_checks=checks)(
            jax.ShapeDtypeStruct(export.symbolic_shape("4, n"), jnp.float32))
