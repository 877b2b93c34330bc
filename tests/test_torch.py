"""lnfast.torch (SPEC "Frameworks and engines", PyTorch): torch.nn.functional's
and torch.nn's behaviour, autograd, the custom operators and torch.compile."""
import io
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
lt = pytest.importorskip("lnfast.torch")
from lnfast import _torch_eager, _torch_ops  # noqa: E402
# (torch.nn.MultiheadAttention meets a deprecated torch.jit helper)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
# (rtol, atol) against torch.nn.functional in float64 arithmetic
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12),
       torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3e-2)}


@pytest.fixture
def gen(request):
    import zlib

    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(gen, *shape, dtype=torch.float64, grad=False, scale=1.0, shift=0.0):
    t = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift).to(dtype)
    return t.requires_grad_(grad)


def grads(out, inputs, dout):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], dout,
                               allow_unused=True)


def test_import_lnfast_does_not_import_torch():
    code = "import sys, lnfast; assert 'torch' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True).stdout.strip() == "ok"


# --- against torch.nn.functional -------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,norm", [((6, 7, 33), (33,)), ((4, 5, 8), (5, 8)),
                                        ((3, 1), (1,)), ((0, 16), (16,)), ((16,), (16,))])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_functional(gen, dtype, shape, norm, affine):
    x = randn(gen, *shape, dtype=dtype, grad=True, scale=2, shift=3)
    w = randn(gen, *norm, dtype=dtype, grad=True) if affine else None
    b = randn(gen, *norm, dtype=dtype, grad=True) if affine else None
    y = lt.layer_norm(x, norm, w, b)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    x64, w64, b64 = (None if t is None else t.detach().double().requires_grad_()
                     for t in (x, w, b))
    want = F.layer_norm(x64, norm, w64, b64)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)
    dy = randn(gen, *shape, dtype=dtype)
    for got, ref in zip(grads(y, (x, w, b), dy), grads(want, (x64, w64, b64), dy.double())):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol * 10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rms_norm_matches_functional(gen, dtype, eps):
    x = randn(gen, 5, 6, 40, dtype=dtype, grad=True)
    w = randn(gen, 6, 40, dtype=dtype, grad=True)
    y = lt.rms_norm(x, (6, 40), w, eps)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    # eps=None is PyTorch's default: float64's epsilon for float64, else float32's
    e = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    want = F.rms_norm(x64, (6, 40), w64, e if eps is None else eps)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)
    dy = randn(gen, 5, 6, 40, dtype=dtype)
    for got, ref in zip(grads(y, (x, w), dy), grads(want, (x64, w64), dy.double())):
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol * 10)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("wdtype", DTYPES, ids=str)
def test_rms_norm_takes_a_weight_of_any_float_dtype(gen, dtype, wdtype):
    # as torch.nn.functional.rms_norm does: the result in input's dtype
    x = randn(gen, 3, 16, dtype=dtype, grad=True)
    w = (1 + randn(gen, 16, dtype=torch.float32)).to(wdtype).requires_grad_()
    y = lt.rms_norm(x, 16, w)
    want = F.rms_norm(x.detach().double(), (16,), w.detach().double())
    rtol, atol = TOL[dtype]
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), want, rtol=rtol, atol=atol)
    gx, gw = torch.autograd.grad(y.sum(), (x, w))
    assert gx.dtype == dtype and gw.dtype == wdtype


def test_rms_norm_refuses_a_weight_not_of_a_float_dtype(gen):
    # the message names what rms_norm takes (any of the four), not only
    # input's dtype
    x = randn(gen, 3, 4, dtype=torch.float32)
    with pytest.raises(TypeError, match="weight must be float32, float64, float16 or bfloat16, "
                                        "got torch.int32"):
        lt.rms_norm(x, 4, torch.ones(4, dtype=torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_default_eps_is_torchs(dtype):
    # (a small mean square, where eps shows: torch takes float32's epsilon for
    # float16 and bfloat16 input, not the dtype's own)
    x = torch.full((3, 4), 0.01, dtype=dtype)
    for ours, theirs in ((lt.rms_norm(x, 4), F.rms_norm(x, (4,))),
                         (lt.RMSNorm(4, dtype=dtype)(x), torch.nn.RMSNorm(4, dtype=dtype)(x))):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_add_layer_norm_matches_functional(gen, dtype):
    x, r = (randn(gen, 7, 3, 24, dtype=dtype, grad=True) for _ in range(2))
    w, b = (randn(gen, 24, dtype=dtype, grad=True) for _ in range(2))
    y, z = lt.add_layer_norm(x, r, 24, w, b)
    z_ref = x + r
    y_ref = F.layer_norm(z_ref, (24,), w, b)
    torch.testing.assert_close(z, z_ref, rtol=0, atol=0)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    dy, dz = randn(gen, 7, 3, 24, dtype=dtype), randn(gen, 7, 3, 24, dtype=dtype)
    got = torch.autograd.grad((y, z), (x, r, w, b), (dy, dz))
    ref = torch.autograd.grad((y_ref, z_ref), (x, r, w, b), (dy, dz))
    for g, e in zip(got, ref):
        torch.testing.assert_close(g, e, rtol=rtol * 10, atol=atol * 10)


def test_large_offset_more_accurate_than_torch(gen):
    # float32 rows at an offset of 1e5: lnfast's statistics are float64
    x = randn(gen, 64, 512, dtype=torch.float32, shift=1e5)
    want = F.layer_norm(x.double(), (512,))
    err = (lt.layer_norm(x, 512).double() - want).abs().max().item()
    assert err < 1e-5, err


def test_flush_denormal_changes_no_bit():
    # torch.set_flush_denormal(True) sets flush-to-zero on this thread; the
    # kernels compute without it, as they do for NumPy.
    import numpy as np

    import lnfast

    x = np.array([[1e-40, -1e-40, 2e-40, 0.0], [1e-38, -1e-38, 2e-38, 3e-39]], np.float32)
    dy = x[::-1].copy()
    want = []
    for e in (0.0, 1.0):
        y, mean, rstd = lnfast.layer_norm_forward(x, eps=e)
        want += [y, *lnfast.layer_norm_backward(dy, x, mean, rstd, np.ones(4, np.float32))]
    assert np.any(want[-1] != 0) and np.any(np.abs(want[-1]) < np.finfo(np.float32).tiny)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode PyTorch can set")
    try:
        got = []
        for e in (0.0, 1.0):
            t = torch.from_numpy(x).requires_grad_()
            w, b = torch.ones(4, requires_grad=True), torch.zeros(4, requires_grad=True)
            y = lt.layer_norm(t, (4,), w, b, eps=e)
            got += [y, *torch.autograd.grad(y, (t, w, b), torch.from_numpy(dy))]
    finally:
        torch.set_flush_denormal(False)
    for g, w in zip(got, want):
        assert g.detach().numpy().tobytes() == w.tobytes()


def test_float32_weight_with_16_bit_input(gen):
    x = randn(gen, 8, 64, dtype=torch.bfloat16, grad=True)
    w = randn(gen, 64, dtype=torch.float32, grad=True)
    y = lt.layer_norm(x, 64, w, None)
    assert y.dtype == torch.bfloat16
    dx, dw = torch.autograd.grad(y.float().sum(), (x, w))
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    want = F.layer_norm(x.double(), (64,), w.double())
    torch.testing.assert_close(y.double(), want, rtol=1.6e-2, atol=3e-2)


def test_non_contiguous_and_read_only_inputs(gen):
    base = randn(gen, 24, 10, dtype=torch.float32)
    x = base.t()                # (10, 24) transposed view
    w = randn(gen, 24, dtype=torch.float32)
    torch.testing.assert_close(lt.layer_norm(x, 24, w), F.layer_norm(x, (24,), w))
    xs = base[::2, ::3]         # strided both ways
    torch.testing.assert_close(lt.rms_norm(xs, xs.shape[-1:]), F.rms_norm(xs, xs.shape[-1:]))


def _row_views(gen, dtype):
    """(name, tensor, normalized_shape): layouts whose rows are runs of
    adjacent elements, the rows themselves strided, which the kernels take
    where they lie."""
    qkv = randn(gen, 3, 5, 96, dtype=dtype)
    return [("a slice of each row (a split qkv)", qkv[..., 32:64], (32,)),
            ("transposed leading axes", randn(gen, 5, 3, 32, dtype=dtype).transpose(0, 1),
             (32,)),
            ("every other row", randn(gen, 12, 32, dtype=dtype)[::2], (32,)),
            ("two axes, leading transposed",
             randn(gen, 3, 4, 5, 8, dtype=dtype).transpose(0, 1), (5, 8)),
            ("expanded rows", randn(gen, 1, 32, dtype=dtype).expand(6, 32), (32,))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("view", range(5))
def test_strided_rows_of_adjacent_elements_give_a_contiguous_copys_bits(gen, dtype, view):
    # (docs/torch.md: no copy of such rows, on the C++ and the Python paths)
    name, x, norm = _row_views(gen, dtype)[view]
    assert not x.is_contiguous(), name
    w, b = randn(gen, *norm, dtype=dtype), randn(gen, *norm, dtype=dtype)
    residual = randn(gen, *x.shape, dtype=dtype)
    calls = [lambda x, r: lt.layer_norm(x, norm, w, b), lambda x, r: lt.rms_norm(x, norm, w),
             lambda x, r: lt.add_layer_norm(x, r, norm, w, b),
             lambda x, r: lt.add_layer_norm(r, x, norm, w, b)]
    for fn in calls:
        results = []
        for xi in (x, x.contiguous()):
            xi, ri = xi.detach().requires_grad_(), residual.clone().requires_grad_()
            out = fn(xi, ri)
            out = out if isinstance(out, tuple) else (out,)
            douts = [torch.ones_like(o) + o.detach() for o in out]
            results.append([o.detach() for o in out]
                           + list(torch.autograd.grad(out, (xi, ri), douts, allow_unused=True)))
        for got, want in zip(*results):
            assert (got is None) == (want is None), name
            assert got is None or torch.equal(got, want), name
        with torch.no_grad():
            out = fn(x, residual)
            for got, want in zip(out if isinstance(out, tuple) else (out,), results[0]):
                assert torch.equal(got, want), name


def test_strided_rows_of_adjacent_elements_are_not_copied(gen):
    qkv = randn(gen, 64, 3 * 256, dtype=torch.float32)
    x = qkv[:, 256:512].requires_grad_()
    assert _torch_ops._rows(x, 1).ctypes.data == x.data_ptr()
    assert _torch_ops._rows(x.t(), 1).ctypes.data != x.data_ptr()      # elements far apart: copied
    if _torch_eager._EXT is None:
        return
    with torch.profiler.profile() as prof:
        lt.layer_norm(x, 256).backward(torch.ones(64, 256))
    copies = [e.name for e in prof.events() if e.name in ("aten::clone", "aten::contiguous",
                                                           "aten::copy_")]
    assert not copies, copies


@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "add_layer_norm"])
def test_saved_tensor_hooks_see_all_the_backward_keeps(gen, fn):
    # (so that activation checkpointing and offloading can free it: under
    # hooks that keep copies, nothing holds the norm's input but what holds
    # it under torch.nn's; the gradients are those without hooks)
    x = randn(gen, 64, 32, dtype=torch.float32, grad=True)
    w, b = randn(gen, 32, dtype=torch.float32, grad=True), randn(gen, 32, dtype=torch.float32)
    calls = {"layer_norm": (lambda t: lt.layer_norm(t, 32, w, b),
                            lambda t: F.layer_norm(t, (32,), w, b)),
             "rms_norm": (lambda t: lt.rms_norm(t, 32, w), lambda t: F.rms_norm(t, (32,), w)),
             "add_layer_norm": (lambda t: lt.add_layer_norm(t, t.flip(0), 32, w, b)[0],
                                lambda t: F.layer_norm(t + t.flip(0), (32,), w, b))}[fn]
    kept = []

    def pack(t):
        kept.append(t.detach().clone())
        return len(kept) - 1

    holders = []
    for call in calls:
        with torch.autograd.graph.saved_tensors_hooks(pack, kept.__getitem__):
            t = x * 2
            y = call(t)
        holders.append(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
        got = torch.autograd.grad(y.square().sum(), (x, w))
        want = torch.autograd.grad(call(x * 2).square().sum(), (x, w))
        for g, e in zip(got, want):
            assert torch.equal(g, e)
    assert holders[0] == holders[1], holders


def test_inputs_unchanged(gen):
    x = randn(gen, 9, 16, dtype=torch.float32, grad=True)
    w, b = randn(gen, 16, dtype=torch.float32, grad=True), randn(gen, 16, dtype=torch.float32)
    before = [t.detach().clone() for t in (x, w, b)]
    lt.layer_norm(x, 16, w, b).sum().backward()
    for t, c in zip((x, w, b), before):
        assert torch.equal(t.detach(), c)


# --- autograd ---------------------------------------------------------------------

@pytest.mark.parametrize("norm,affine", [((8,), True), ((8,), False), ((3, 8), True)])
def test_gradcheck_layer_norm(gen, norm, affine):
    x = randn(gen, 2, 3, 8, grad=True)
    params = [randn(gen, *norm, grad=True) for _ in range(2)] if affine else [None, None]
    assert torch.autograd.gradcheck(lambda x, *p: lt.layer_norm(x, norm, *p),
                                    (x, *params))


@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_rms_norm(gen, affine):
    x = randn(gen, 4, 2, 6, grad=True)
    w = randn(gen, 2, 6, grad=True) if affine else None
    assert torch.autograd.gradcheck(lambda x, w: lt.rms_norm(x, (2, 6), w), (x, w))


@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_add_layer_norm_both_outputs(gen, affine):
    x, r = randn(gen, 3, 5, 7, grad=True), randn(gen, 3, 5, 7, grad=True)
    params = [randn(gen, 5, 7, grad=True) for _ in range(2)] if affine else [None, None]
    assert torch.autograd.gradcheck(lambda x, r, *p: lt.add_layer_norm(x, r, (5, 7), *p),
                                    (x, r, *params))
    # the gradient of z alone, and of y alone
    assert torch.autograd.gradcheck(lambda x, r: lt.add_layer_norm(x, r, (5, 7))[1], (x, r))
    assert torch.autograd.gradcheck(lambda x, r: lt.add_layer_norm(x, r, (5, 7))[0], (x, r))


def test_double_backward_is_an_error(gen):
    x = randn(gen, 4, 8, grad=True)
    (g,) = torch.autograd.grad(lt.layer_norm(x, 8).pow(2).sum(), x, create_graph=True)
    # PyTorch's own error for an operator without a derivative, naming it
    # (the Python kernels: the same words, not PyTorch's advice to register one)
    with pytest.raises(RuntimeError, match=r"derivative for lnfast::norm_backward is not impl"):
        g.sum().backward()


def test_only_requested_gradients(gen):
    x = randn(gen, 4, 8, grad=False)
    w = randn(gen, 8, grad=True)
    dy = randn(gen, 4, 8)
    (dw,) = torch.autograd.grad(lt.layer_norm(x, 8, w), w, dy)
    (want,) = torch.autograd.grad(F.layer_norm(x, (8,), w), w, dy)
    torch.testing.assert_close(dw, want, rtol=1e-12, atol=1e-12)


def test_lazily_negated_input(gen):
    x = randn(gen, 4, 8)
    neg = torch._neg_view(x)
    assert neg.is_neg()
    torch.testing.assert_close(lt.layer_norm(neg, 8), F.layer_norm(-x, (8,)))


# --- custom operators and torch.compile ----------------------------------------------

def test_opcheck(gen):
    x, r, dy = (randn(gen, 3, 4, 8, dtype=torch.float32, grad=True) for _ in range(3))
    w, b = (randn(gen, 4, 8, dtype=torch.float32, grad=True) for _ in range(2))
    norm = torch.ops.lnfast.norm.default
    for args in [(x, None, w, b, 2, 1e-5, True), (x, r, w, b, 2, 1e-5, True),
                 (x, None, w, None, 2, 1e-6, False), (x, None, None, None, 1, 1e-5, True)]:
        torch.library.opcheck(norm, args)
    y, _, mean, rstd = norm(x, None, w, b, 2, 1e-5, True)
    back = torch.ops.lnfast.norm_backward.default
    for dz, centered in [(None, True), (dy.detach(), True), (None, False)]:
        torch.library.opcheck(back, (dy.detach(), x.detach(), mean.detach(), rstd.detach(),
                                     w.detach(), dz, 2, centered))


def test_opcheck_bfloat16_strided_float32_weight(gen):
    # a transposed bfloat16 input with float32 parameters (mixed precision)
    x = randn(gen, 8, 5, dtype=torch.bfloat16).t().requires_grad_()
    r = randn(gen, 5, 8, dtype=torch.bfloat16, grad=True)
    w, b = (randn(gen, 8, dtype=torch.float32, grad=True) for _ in range(2))
    assert not x.is_contiguous()
    norm = torch.ops.lnfast.norm.default
    for args in [(x, None, w, b, 1, 1e-5, True), (x, r, w, b, 1, 1e-5, True),
                 (x, None, w, None, 1, 1e-6, False)]:
        torch.library.opcheck(norm, args)
    y, _, mean, rstd = norm(x, None, w, b, 1, 1e-5, True)
    dy = randn(gen, 8, 5, dtype=torch.bfloat16).t()
    torch.library.opcheck(torch.ops.lnfast.norm_backward.default,
                          (dy, x.detach(), mean.detach(), rstd.detach(), w.detach(), None, 1,
                           True))


@pytest.mark.parametrize("dtype,wdtype,bdtype", [
    (torch.float64, torch.float32, torch.float64), (torch.float64, torch.float64, torch.float32),
    (torch.bfloat16, torch.float32, torch.bfloat16), (torch.float16, torch.float16, torch.float32),
    (torch.bfloat16, None, torch.bfloat16)])
def test_weight_and_bias_of_different_dtypes(gen, dtype, wdtype, bdtype):
    # each gradient is the float64 sum rounded once to its own parameter's
    # dtype (without a weight, dweight's would be the compute dtype)
    x = randn(gen, 40, 24, dtype=dtype, grad=True)
    w = None if wdtype is None else randn(gen, 24, dtype=wdtype, grad=True)
    b = randn(gen, 24, dtype=bdtype, grad=True)
    dy = randn(gen, 40, 24, dtype=dtype)
    for fused in (False, True):
        if fused:
            r = randn(gen, 40, 24, dtype=dtype, grad=True)
            y = lt.add_layer_norm(x, r, 24, w, b)[0]
        else:
            y = lt.layer_norm(x, 24, w, b)
        *dw, db = torch.autograd.grad(y, [t for t in (w, b) if t is not None], dy)
        assert db.dtype == bdtype and all(d.dtype == wdtype for d in dw)
        want_db = dy.double().sum(0)
        torch.testing.assert_close(db.double(), want_db, rtol=TOL[bdtype][0],
                                   atol=TOL[bdtype][1])
        if bdtype == torch.float64:         # (not rounded through the weight's float32)
            torch.testing.assert_close(db, want_db, rtol=1e-13, atol=1e-13)
        if w is not None and not fused:
            x64 = x.detach().double()
            xhat = (x64 - x64.mean(-1, keepdim=True)) / torch.sqrt(
                x64.var(-1, unbiased=False, keepdim=True) + 1e-5)
            torch.testing.assert_close(dw[0].double(), (dy.double() * xhat).sum(0),
                                       rtol=TOL[wdtype][0], atol=TOL[wdtype][1] * 10)


def test_inplace_change_after_forward_is_an_error(gen):
    # autograd's own check that a tensor saved for the backward was not
    # changed in place meanwhile (the eager path keeps arrays over the
    # saved tensors' memory: a change must not pass as a wrong gradient)
    def saved(fn):
        x = randn(gen, 4, 8, grad=True).clone()
        y, src = fn(x)
        with torch.no_grad():
            src.mul_(2)
        return y

    for fn in (lambda x: (lt.layer_norm(x, 8), x), lambda x: (lt.rms_norm(x, 8), x),
               lambda x: lt.add_layer_norm(x, x.detach(), 8)):     # the fused step saves z
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved(fn).sum().backward()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(gen, backend, dynamic):
    torch._dynamo.reset()
    x, r = randn(gen, 6, 32, dtype=torch.float32, grad=True), randn(gen, 6, 32, dtype=torch.float32)
    w, b = (randn(gen, 32, dtype=torch.float32, grad=True) for _ in range(2))

    def step(x, r, w, b):
        y, z = lt.add_layer_norm(x, r, 32, w, b)
        return (lt.layer_norm(y.tanh(), 32, w, b) + lt.rms_norm(z, 32, w)).square().sum()

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=dynamic)
    for rows in (6, 9):         # a second shape: recompiled, or traced dynamically
        xs = randn(gen, rows, 32, dtype=torch.float32, grad=True)
        rs = randn(gen, rows, 32, dtype=torch.float32)
        got = compiled(xs, rs, w, b)
        want = step(xs, rs, w, b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        for g, e in zip(torch.autograd.grad(got, (xs, w, b)), torch.autograd.grad(want, (xs, w, b))):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_compile_dynamic_normalized_size_without_a_weight(gen):
    # bfloat16 input, a bfloat16 bias and no weight: dbias takes the second
    # backward pass with ones of the normalized size, which stays symbolic
    torch._dynamo.reset()
    f = torch.compile(lambda x, b: lt.layer_norm(x, x.shape[-1], None, b).float().square().sum(),
                      backend="aot_eager", fullgraph=True)
    for d in (8, 12):
        x = randn(gen, 4, d, dtype=torch.bfloat16, grad=True)
        b = randn(gen, d, dtype=torch.bfloat16, grad=True)
        torch._dynamo.mark_dynamic(x, 1)
        torch._dynamo.mark_dynamic(b, 0)
        got = torch.autograd.grad(f(x, b), (x, b))
        want = torch.autograd.grad(lt.layer_norm(x, d, None, b).float().square().sum(), (x, b))
        assert all(torch.equal(g, e) for g, e in zip(got, want))


def test_compile_dynamic_normalized_shape_taken_from_the_input(gen):
    # normalized_shape as x.shape[-1:] or [x.shape[-1]] stays symbolic, as
    # torch.nn.functional's does: one graph for every row length
    from torch._dynamo.testing import CompileCounter

    for fn in (lambda x: lt.layer_norm(x, x.shape[-1:]),
               lambda x: lt.rms_norm(x, [x.shape[-1]]),
               lambda x: lt.add_layer_norm(x, x, x.shape[-1:])[1]):
        torch._dynamo.reset()
        counter = CompileCounter()
        f = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
        for d in (5, 6, 7):
            x = randn(gen, 3, d, dtype=torch.float32)
            torch.testing.assert_close(f(x), fn(x), rtol=0, atol=0)
        assert counter.frame_count == 1


@pytest.mark.parametrize("needs", ["x", "residual", "weight", "bias"])
def test_z_needs_a_gradient_only_where_x_or_residual_does(gen, needs):
    # z = x + residual, as torch's sum: not differentiable in weight or bias
    args = {name: randn(gen, *shape, dtype=torch.float32, grad=name == needs)
            for name, shape in (("x", (3, 8)), ("residual", (3, 8)), ("weight", (8,)),
                                ("bias", (8,)))}
    y, z = lt.add_layer_norm(args["x"], args["residual"], 8, args["weight"], args["bias"])
    assert y.requires_grad
    assert z.requires_grad == (needs in ("x", "residual"))
    (got,) = torch.autograd.grad((y * y).sum(), args[needs])
    p = {k: v.detach().requires_grad_(k == needs) for k, v in args.items()}
    want = F.layer_norm(p["x"] + p["residual"], (8,), p["weight"], p["bias"])
    torch.testing.assert_close(got, torch.autograd.grad((want * want).sum(), p[needs])[0])


@pytest.mark.parametrize("centered", [True, False])
def test_every_path_gives_the_same_bits(gen, centered):
    # the operator, the autograd.Function (grad), and the call without grad
    x = randn(gen, 10, 48, dtype=torch.float32)
    w, b = (randn(gen, 48, dtype=torch.float32) for _ in range(2))
    b = b if centered else None
    fn = (lambda x: lt.layer_norm(x, 48, w, b)) if centered else (lambda x: lt.rms_norm(x, 48, w))
    y_op = torch.ops.lnfast.norm(x, None, w, b, 1, 1e-5 if centered else torch.finfo().eps,
                                 centered)[0]
    assert torch.equal(fn(x), y_op)
    assert torch.equal(fn(x.clone().requires_grad_()), y_op)
    with torch.no_grad():
        assert torch.equal(fn(x.clone().requires_grad_()), y_op)
    r = randn(gen, 10, 48, dtype=torch.float32)
    y, z = lt.add_layer_norm(x, r, 48, w, b)
    y2, z2 = lt.add_layer_norm(x.clone().requires_grad_(), r, 48, w, b)
    assert torch.equal(y, y2) and torch.equal(z, z2) and torch.equal(z, x + r)


# --- modules ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"bias": False}])
def test_layer_norm_module_state_dict_round_trips(gen, kwargs):
    ours, theirs = lt.LayerNorm((3, 8), **kwargs), torch.nn.LayerNorm((3, 8), **kwargs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(randn(gen, *p.shape, dtype=p.dtype))
    ours.load_state_dict(theirs.state_dict())
    back = torch.nn.LayerNorm((3, 8), **kwargs)
    back.load_state_dict(ours.state_dict())
    x = randn(gen, 5, 3, 8, dtype=torch.float32)
    torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(back(x), theirs(x))


def test_rms_norm_module(gen):
    ours, theirs = lt.RMSNorm(16, eps=None), torch.nn.RMSNorm(16, eps=None)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    with torch.no_grad():
        theirs.weight.copy_(randn(gen, 16, dtype=torch.float32))
    ours.load_state_dict(theirs.state_dict())
    x = randn(gen, 4, 16, dtype=torch.float32)
    torch.testing.assert_close(ours(x), theirs(x))
    m = lt.RMSNorm(16, dtype=torch.float64)
    assert m.weight.dtype == torch.float64 and isinstance(m, torch.nn.RMSNorm)


class Block(torch.nn.Module):
    """A small pre-norm transformer block."""

    def __init__(self, width=64, heads=4):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))
        self.out = torch.nn.RMSNorm(width)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return self.out(x + self.mlp(self.ln2(x)))


def test_replace_norms_on_a_transformer_block(gen):
    torch.manual_seed(0)
    model = Block()
    x = randn(gen, 2, 10, 64, dtype=torch.float32)
    loss = model(x).square().mean()
    want = torch.autograd.grad(loss, list(model.parameters()))
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert lt.replace_norms(model) is model
    assert type(model.ln1) is lt.LayerNorm and type(model.out) is lt.RMSNorm
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    loss2 = model(x).square().mean()
    torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(loss2, list(model.parameters()))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
    # the optimizer built before the swap still holds the modules' parameters
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert {id(model.ln1.weight), id(model.ln2.bias), id(model.out.weight)} <= held
    model(x).square().mean().backward()
    assert model.ln2.weight.grad is not None and model.ln2.weight.grad.abs().sum() > 0


def test_modules_script_with_torch_jit(gen):
    # (a scripted model keeps working after replace_norms; saved and loaded
    # back it needs lnfast.torch imported, as any custom operator does)
    for m in (lt.LayerNorm((3, 8)), lt.LayerNorm(8, bias=False),
              lt.LayerNorm(8, elementwise_affine=False), lt.RMSNorm(8), lt.RMSNorm(8, eps=1e-3)):
        x = randn(gen, 4, 3, 8, dtype=torch.float32, grad=True)
        scripted = torch.jit.script(m)
        params = (x, *m.parameters())
        want, got = m(x), scripted(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for a, b in zip(torch.autograd.grad(got.sum(), params),
                        torch.autograd.grad(want.sum(), params)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        buf = io.BytesIO()
        torch.jit.save(scripted, buf)
        buf.seek(0)
        torch.testing.assert_close(torch.jit.load(buf)(x), want, rtol=0, atol=0)
        with pytest.raises(torch.jit.Error, match="ValueError: normalized_shape"):
            scripted(randn(gen, 4, 9, dtype=torch.float32))


def test_scripted_rms_norm_takes_a_weight_of_any_dtype(gen):
    # (as rms_norm does: one of another dtype than input's and float32 is
    # taken in input's dtype, float32 for 16-bit input)
    for wdt in DTYPES:
        m = lt.RMSNorm(8).to(wdt)
        with torch.no_grad():
            m.weight.copy_(randn(gen, 8))
        scripted = torch.jit.script(m)
        for xdt in DTYPES:
            x = randn(gen, 4, 8, dtype=xdt, grad=True)
            want, got = m(x), scripted(x)
            assert got.dtype == want.dtype == xdt and torch.equal(got, want), (wdt, xdt)
            for a, b in zip(torch.autograd.grad(got.sum(), (x, m.weight)),
                            torch.autograd.grad(want.sum(), (x, m.weight))):
                assert a.dtype == b.dtype and torch.equal(a, b), (wdt, xdt)


def test_parameters_on_another_device_are_refused_when_scripted_and_by_the_operators():
    # (a module whose parameters were left on meta, fed a CPU input: an
    # error naming the argument, as in eager mode, never empty results)
    x = torch.randn(2, 8)
    for m in (lt.LayerNorm(8, device="meta"), lt.RMSNorm(8, device="meta")):
        with pytest.raises(ValueError, match="weight must be on input's device"):
            m(x)
        with pytest.raises(RuntimeError, match="weight must be on x.s device"):
            torch.jit.script(m)(x)
    meta = {"device": "meta"}
    with pytest.raises(ValueError, match="weight must be on x's device"):
        torch.ops.lnfast.norm(x, None, torch.ones(8, **meta), None, 1, 1e-5, True)
    with pytest.raises(ValueError, match="residual must be on x's device"):
        torch.ops.lnfast.norm(x, torch.ones(2, 8, **meta), None, None, 1, 1e-5, True)
    with pytest.raises(ValueError, match="mean must be on x's device"):
        torch.ops.lnfast.norm_backward(x, x, torch.zeros(2, **meta), torch.ones(2), None, None,
                                       1, True)
    with pytest.raises(ValueError, match="dy must be on x's device"):
        torch.ops.lnfast.norm_backward(x.to("meta"), x, torch.zeros(2), torch.ones(2), None,
                                       None, 1, True)


def test_meta_tensors_give_meta_results_of_the_right_shape():
    x = torch.randn(4, 3, 8, device="meta", requires_grad=True)
    for m in (lt.LayerNorm((3, 8), device="meta"), lt.RMSNorm(8, device="meta")):
        y = m(x)
        assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype
        grads = torch.autograd.grad(y.sum(), (x, m.weight))
        assert [g.shape for g in grads] == [x.shape, m.weight.shape]
    y, z = lt.add_layer_norm(x.detach(), x.detach(), 8)
    assert y.device.type == z.device.type == "meta" and z.shape == x.shape


def test_fake_tensors_and_torch_jit_trace(gen):
    # (fake tensors, as torch.export and deferred initialisation use, and
    # traced modules: through the operator, with the C++ or Python kernels)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.randn(4, 3, 8, requires_grad=True)
        w = torch.randn(8, requires_grad=True)
        y = lt.layer_norm(x, 8, w)
        assert y.shape == x.shape and y.dtype == x.dtype
        grads = torch.autograd.grad(y.sum(), (x, w))
        assert [g.shape for g in grads] == [x.shape, w.shape]
        y, z = lt.add_layer_norm(x, x, (3, 8))
        assert z.shape == x.shape and lt.rms_norm(x, (8,), w).shape == x.shape
    x = randn(gen, 4, 3, 8, dtype=torch.float32)
    for m in (lt.LayerNorm(8), lt.RMSNorm((3, 8)), lambda x: lt.add_layer_norm(x, x, 8)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", torch.jit.TracerWarning)
            traced = torch.jit.trace(m, (x,), check_trace=True)
        torch.testing.assert_close(traced(2 * x), m(2 * x), rtol=0, atol=0)


def test_torch_func_transforms(gen):
    # vmap: a mapped input is more rows, one call (the same bits as the call
    # on the stacked input), a mapped weight a call per entry; vmap(grad)
    # gives per-example gradients, jacrev and is_grads_batched map the
    # backward; no PyTorch warning that it loops over the batch
    x = randn(gen, 5, 3, 8)
    w, b = randn(gen, 8), randn(gen, 8)
    r, W = randn(gen, 5, 3, 8), randn(gen, 5, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = torch.func.vmap(lambda x: lt.layer_norm(x, 8, w, b), in_dims=1)(x)
        assert torch.equal(v, lt.layer_norm(x.movedim(1, 0), 8, w, b))
        v = torch.func.vmap(lambda x, w: lt.rms_norm(x, (3, 8), w))(x, W.view(5, 1, 8).expand(5, 3, 8))
        for i in range(5):
            assert torch.equal(v[i], lt.rms_norm(x[i], (3, 8), W[i].expand(3, 8)))
        y, z = torch.func.vmap(lambda r: lt.add_layer_norm(x[0], r, 8, w, b))(r)
        want = lt.add_layer_norm(x[0].expand(5, 3, 8), r, 8, w, b)
        assert torch.equal(y, want[0]) and torch.equal(z, want[1])

        def loss(w, b, x):
            return lt.layer_norm(x, 8, w, b).square().sum()

        def torch_loss(w, b, x):
            return F.layer_norm(x, (8,), w, b).square().sum()

        per = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0))
        want = torch.func.vmap(torch.func.grad(torch_loss, argnums=(0, 1)),
                               in_dims=(None, None, 0))(w, b, x)
        got = per(w, b, x)
        for g, e in zip(got, want):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
        for i in range(5):
            assert torch.equal(got[0][i], torch.func.grad(loss)(w, b, x[i]))
        ga = torch.func.vmap(torch.func.grad(
            lambda x, r: sum(t.square().sum() for t in lt.add_layer_norm(x, r, 8, w)),
            argnums=(0, 1)))(x, r)
        gt = torch.func.vmap(torch.func.grad(
            lambda x, r: F.layer_norm(x + r, (8,), w).square().sum() + (x + r).square().sum(),
            argnums=(0, 1)))(x, r)
        for g, e in zip(ga, gt):
            torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
        jac = torch.func.jacrev(lambda x: lt.rms_norm(x, 8, w))(x[0, 0])
        torch.testing.assert_close(jac, torch.func.jacrev(lambda x: F.rms_norm(x, (8,), w))(
            x[0, 0]), rtol=1e-12, atol=1e-12)
        xr = x.clone().requires_grad_()
        y = lt.layer_norm(xr, 8, w, b)
        dys = randn(gen, 4, *y.shape)
        batched, = torch.autograd.grad(y, xr, dys, is_grads_batched=True, retain_graph=True)
        for i in range(4):
            assert torch.equal(batched[i], torch.autograd.grad(y, xr, dys[i], retain_graph=True)[0])
        # batched gradients of z alone (dy then none), and vmap over autograd.grad
        rr = r.clone().requires_grad_()
        y, z = lt.add_layer_norm(xr, rr, 8, w)
        got = torch.autograd.grad(z, (xr, rr), dys, is_grads_batched=True, retain_graph=True)
        assert torch.equal(got[0], dys) and torch.equal(got[1], dys)
        wr = w.clone().requires_grad_()
        y = lt.layer_norm(xr, 8, wr)
        got = torch.func.vmap(lambda v: torch.autograd.grad(y, (xr, wr), v, retain_graph=True))(dys)
        for i in range(4):
            for g, e in zip(got, torch.autograd.grad(y, (xr, wr), dys[i], retain_graph=True)):
                assert torch.equal(g[i], e)
    # a gradient of a gradient stays an error
    with pytest.raises(RuntimeError, match="derivative for lnfast::norm_backward is not impl"):
        torch.func.grad(lambda x: torch.func.grad(loss, argnums=2)(w, b, x).sum())(x)


def test_torch_func_transforms_over_an_empty_batch(gen):
    # (torch.nn.functional's shapes: a mapped weight and the backward map
    # each entry, of which there are none)
    w, b = randn(gen, 6), randn(gen, 6)
    x, W, r = (torch.zeros(*shape, dtype=torch.float64) for shape in ((0, 3, 6), (0, 6),
                                                                      (0, 3, 6)))
    vmap, grad = torch.func.vmap, torch.func.grad
    cases = [(lambda x, w: lt.layer_norm(x, (6,), w), lambda x, w: F.layer_norm(x, (6,), w)),
             (lambda x, w: lt.rms_norm(x, (6,), w), lambda x, w: F.rms_norm(x, (6,), w))]
    for ours, theirs in cases:
        assert vmap(ours)(x, W).shape == vmap(theirs)(x, W).shape == (0, 3, 6)
        got = vmap(grad(lambda x, w: ours(x, w).square().sum(), argnums=(0, 1)))(x, W)
        want = vmap(grad(lambda x, w: theirs(x, w).square().sum(), argnums=(0, 1)))(x, W)
        assert [g.shape for g in got] == [e.shape for e in want] == [(0, 3, 6), (0, 6)]
        jac = torch.func.jacrev(lambda x: ours(x, w))(W)
        assert jac.shape == torch.func.jacrev(lambda x: theirs(x, w))(W).shape == (0, 6, 0, 6)
    y, z = vmap(lambda x, r, w: lt.add_layer_norm(x, r, 6, w, b))(x, r, W)
    assert y.shape == z.shape == (0, 3, 6)
    got = vmap(grad(lambda x, r: lt.add_layer_norm(x, r, 6, w, b)[0].square().sum(),
                    argnums=(0, 1)))(x, r)
    assert [g.shape for g in got] == [(0, 3, 6), (0, 3, 6)]


def test_torch_func_with_tensor_subclasses_and_meta_tensors(gen):
    class Sub(torch.Tensor):
        pass

    x, w = randn(gen, 3, 8).as_subclass(Sub), randn(gen, 8)
    got = torch.func.grad(lambda x: lt.layer_norm(x, 8, w).square().sum())(x)
    want = torch.func.grad(lambda x: F.layer_norm(x, (8,), w).square().sum())(
        x.as_subclass(torch.Tensor))
    torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=1e-12, atol=1e-12)
    meta = torch.randn(3, 8, device="meta")
    assert torch.func.grad(lambda x: lt.rms_norm(x, 8).sum())(meta).shape == meta.shape


def test_compiled_autograd_with_a_compiled_forward(gen):
    torch._dynamo.reset()
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), lt.LayerNorm(8)).double()
    x = randn(gen, 4, 8)
    m(x).square().sum().backward()
    want = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    with torch._dynamo.config.patch(compiled_autograd=True):
        torch.compile(m, backend="aot_eager", fullgraph=True)(x).square().sum().backward()
    for p, e in zip(m.parameters(), want):
        torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()


def test_replace_norms_keeps_the_modules_themselves():
    ln = torch.nn.LayerNorm(8)
    calls = []
    ln.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    ln.note = "kept"
    shared = torch.nn.Sequential(ln, torch.nn.Linear(8, 8), ln, torch.nn.RMSNorm(8))
    x = torch.randn(3, 8)
    want = shared(x)
    assert lt.replace_norms(shared) is shared
    assert shared[0] is ln and shared[2] is ln and type(ln) is lt.LayerNorm
    assert type(shared[3]) is lt.RMSNorm and ln.note == "kept"
    calls.clear()
    torch.testing.assert_close(shared(x), want)
    assert calls == [torch.Size([3, 8])] * 2       # (the hook, twice: one module, used twice)
    # a weight recomputed by a hook (torch.nn.utils.weight_norm) is read as torch's is
    wn = torch.nn.utils.weight_norm(torch.nn.LayerNorm(8), dim=None)
    want = wn(x)
    torch.testing.assert_close(lt.replace_norms(wn)(x), want)
    # subclasses stay as they are
    class Mine(torch.nn.LayerNorm):
        pass
    assert type(lt.replace_norms(Mine(8))) is Mine


def test_replace_norms_keeps_dtype_device_and_mode():
    m = torch.nn.Sequential(torch.nn.LayerNorm(8, dtype=torch.float64, bias=False),
                            torch.nn.RMSNorm(8)).eval()
    lt.replace_norms(m)
    assert m[0].weight.dtype == torch.float64 and m[0].bias is None
    assert not m[0].training and not m[1].training
    top = lt.replace_norms(torch.nn.LayerNorm(4))
    assert type(top) is lt.LayerNorm


# --- bad input --------------------------------------------------------------------------

@pytest.mark.parametrize("call,exc,match", [
    (lambda x, w: lt.layer_norm(x, 7, w), ValueError, "normalized_shape"),
    (lambda x, w: lt.layer_norm(x, (4, 9), None), ValueError, "normalized_shape"),
    (lambda x, w: lt.layer_norm(x, 8, w.double()), TypeError, "weight"),
    (lambda x, w: lt.layer_norm(x, 8, w[:4]), ValueError, "weight"),
    (lambda x, w: lt.layer_norm(x, 8, None, w.numpy()), TypeError, "bias"),
    (lambda x, w: lt.layer_norm(x, 8, w.to("meta")), ValueError, "weight"),
    (lambda x, w: lt.rms_norm(x, 8, w.to("meta")), ValueError, "weight"),
    (lambda x, w: lt.layer_norm(x.numpy(), 8), TypeError, "input"),
    (lambda x, w: lt.layer_norm(x.int(), 8), TypeError, "input"),
    (lambda x, w: lt.layer_norm(x, 8, eps=-1.0), ValueError, "eps"),
    (lambda x, w: lt.layer_norm(x, 8, eps=float("inf")), ValueError, "eps"),
    (lambda x, w: lt.rms_norm(x, 8, eps="1e-5"), TypeError, "eps"),
    (lambda x, w: lt.rms_norm(x, "8"), TypeError, "normalized_shape"),
    (lambda x, w: lt.add_layer_norm(x, x[:2], 8), ValueError, "residual"),
    (lambda x, w: lt.add_layer_norm(x, x.double(), 8), TypeError, "residual"),
    (lambda x, w: lt.layer_norm(x, [8.7]), TypeError, "normalized_shape"),
    (lambda x, w: lt.layer_norm(x, (8.0,)), TypeError, "normalized_shape"),
    (lambda x, w: lt.layer_norm(x, (True,)), TypeError, "normalized_shape"),
    (lambda x, w: lt.layer_norm(x, torch.tensor([8])), TypeError, "normalized_shape"),
    (lambda x, w: lt.layer_norm(x.to_sparse(), 8), TypeError, "input"),
    (lambda x, w: lt.layer_norm(x.to_sparse_csr(), 8), TypeError, "input"),
    (lambda x, w: lt.layer_norm(torch.nested.nested_tensor([x, x]), 8), TypeError, "input"),
    (lambda x, w: lt.rms_norm(x, 8, w.to_sparse()), TypeError, "weight"),
    (lambda x, w: lt.add_layer_norm(x, x.to_sparse(), 8), TypeError, "residual"),
    (lambda x, w: lt.add_layer_norm(x.int(), x.int(), 8), TypeError, "^x must be float32"),
    (lambda x, w: lt.add_layer_norm(x, x, 3), ValueError, "last axes of x, got x of shape"),
    (lambda x, w: lt.layer_norm(x, ()), ValueError, "normalized_shape must name at least one"),
    (lambda x, w: lt.layer_norm(x, 8, eps=True), TypeError, "eps"),
    (lambda x, w: lt.replace_norms(None), TypeError, "module must be a torch.nn.Module"),
    (lambda x, w: lt.replace_norms([torch.nn.LayerNorm(8)]), TypeError, "module"),
])
def test_bad_input(gen, call, exc, match):
    x = randn(gen, 4, 8, dtype=torch.float32)
    w = randn(gen, 8, dtype=torch.float32)
    before = (x.clone(), w.clone())
    with pytest.raises(exc, match=match) as info:
        call(x, w)
    assert isinstance(info.value, RuntimeError)      # as torch.nn.functional raises
    assert torch.equal(x, before[0]) and torch.equal(w, before[1])


def test_eps_may_be_a_0_d_tensor(gen):
    # as torch.nn.functional takes it
    x = randn(gen, 4, 8, dtype=torch.float32)
    for f in (lt.layer_norm, lt.rms_norm):
        want = f(x, 8, eps=float(torch.tensor(1e-3)))
        assert torch.equal(f(x, 8, eps=torch.tensor(1e-3)), want)
        compiled = torch.compile(lambda x: f(x, 8, eps=torch.tensor(1e-3)), backend="aot_eager",
                                 fullgraph=True)
        assert torch.equal(compiled(x), want)


def test_fx_symbolic_trace(gen):
    # An FX Proxy takes the call, as for torch.nn.functional's functions: the
    # graph records lnfast's function and gives its results.
    x, r = randn(gen, 4, 8, dtype=torch.float32), randn(gen, 4, 8, dtype=torch.float32)
    m = lt.replace_norms(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8),
                                             torch.nn.RMSNorm(8)))
    gm = torch.fx.symbolic_trace(m)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [lt.layer_norm, lt.rms_norm]
    assert torch.equal(gm(x), m(x))
    gm = torch.fx.symbolic_trace(lambda x, r: lt.add_layer_norm(x, r, 8))
    for g, e in zip(gm(x, r), lt.add_layer_norm(x, r, 8)):
        assert torch.equal(g, e)


def test_onnx_export_after_replace_norms(gen):
    # torch.onnx.export traces torch.nn.functional's LayerNorm in lnfast's
    # place (lnfast's operators have no ONNX form): the same model as before.
    import numpy as np

    reference = pytest.importorskip("onnx.reference")
    x, r = randn(gen, 3, 8, dtype=torch.float32), randn(gen, 3, 8, dtype=torch.float32)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear, self.norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

        def forward(self, x, r):
            y, z = lt.add_layer_norm(self.linear(x), r, 8)
            return self.norm(y) + z

    block = lt.replace_norms(Block())
    with torch.no_grad():
        block.norm.weight.uniform_()
        want = block(x, r)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(block, (x, r), buf, opset_version=17, dynamo=False,
                          input_names=["x", "r"])
    assert b"lnfast" not in buf.getvalue()
    (got,) = reference.ReferenceEvaluator(buf.getvalue()).run(None, {"x": x.numpy(),
                                                                      "r": r.numpy()})
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    assert "lnfast" in str(torch.jit.trace(block, (x, r)).graph)     # (tracing alone: lnfast)


# --- CUDA tensors (through DLPack to lnfast's CuPy kernels) ---------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for torch")
def test_cuda_tensors_match_the_cpu(gen):
    pytest.importorskip("cupy")
    x = randn(gen, 64, 3, 96, dtype=torch.float32)
    w, b = randn(gen, 3, 96, dtype=torch.float32), randn(gen, 3, 96, dtype=torch.float32)
    dy = randn(gen, 64, 3, 96, dtype=torch.float32)
    outs = []
    for device in ("cpu", "cuda"):
        xs, ws, bs = (t.to(device).requires_grad_() for t in (x, w, b))
        y = lt.layer_norm(xs, (3, 96), ws, bs)
        assert y.device.type == device
        outs.append([y, *torch.autograd.grad(y, (xs, ws, bs), dy.to(device))])
    for c, g in zip(*outs):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-5, atol=1e-5)


def test_eps_bool_is_refused_when_compiled_too(gen):
    # eager refuses a bool eps; tracing must not take True as 1.0
    x = randn(gen, 3, 4, dtype=torch.float32)
    for f in (lt.layer_norm, lt.rms_norm):
        with pytest.raises(TypeError, match="eps must be a real number, got bool"):
            f(x, 4, eps=True)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: f(x, 4, eps=True), backend="aot_eager",
                                 fullgraph=True)
        with pytest.raises(Exception, match="eps must be a real number, got bool"):
            compiled(x)
