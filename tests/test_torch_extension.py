"""lnfast.torch's C++ kernels (torch_ext/lnfast_torch.cc): built on first
import, serving CPU tensors with the same bits as the Python kernels, and
a clear fallback where they cannot be built."""
import concurrent.futures
import os
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
lt = pytest.importorskip("lnfast.torch")
import lnfast  # noqa: E402
from lnfast import _torch_eager  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HAVE_COMPILER = bool(os.environ.get("CXX") or any(shutil.which(c) for c in ("c++", "g++",
                                                                              "clang++")))
SWITCHED_OFF = os.environ.get("LNFAST_TORCH_EXTENSION", "").strip() == "0"

# Every case: (name, a function of a torch.Generator returning the outputs
# and the gradients of a forward and backward through lnfast.torch).
CASES = """
import torch
import lnfast.torch as lt

def run(fn, inputs, gen):
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    douts = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
    need = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [o.detach() for o in outs] + list(torch.autograd.grad(outs, need, douts))

def t(gen, *shape, dtype, grad=True, shift=0.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 2 + shift).to(dtype) \\
        .requires_grad_(grad)

def cases():
    out = {}
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        g = torch.Generator().manual_seed(1)
        name = str(dt).split(".")[1]
        x, w, b = t(g, 6, 7, 33, dtype=dt, shift=3.0), t(g, 33, dtype=dt), t(g, 33, dtype=dt)
        out["layer_norm " + name] = run(lambda x, w, b: lt.layer_norm(x, 33, w, b), (x, w, b), g)
        out["layer_norm no affine " + name] = run(lambda x: lt.layer_norm(x, 33), (x,), g)
        out["rms_norm " + name] = run(lambda x, w: lt.rms_norm(x, 33, w), (x, w), g)
        r = t(g, 6, 7, 33, dtype=dt)
        out["add_layer_norm " + name] = run(lambda x, r, w, b: lt.add_layer_norm(x, r, 33, w, b),
                                            (x, r, w, b), g)
        x2, w2 = t(g, 4, 5, 8, dtype=dt), t(g, 5, 8, dtype=dt)
        out["two axes " + name] = run(lambda x, w: lt.layer_norm(x, (5, 8), w), (x2, w2), g)
        xs = t(g, 12, 40, dtype=dt, grad=False)[:, ::2].requires_grad_()
        out["strided " + name] = run(lambda x: lt.rms_norm(x, 20), (xs,), g)
        # rows far apart (a strided layout NumPy's call would take by tiles)
        xt = t(g, 70, 33, dtype=dt, grad=False).t().requires_grad_()
        out["transposed " + name] = run(lambda x: lt.layer_norm(x, 70), (xt,), g)
        out["transposed rms_norm " + name] = run(lambda x: lt.rms_norm(x, 70), (xt,), g)
        xp = t(g, 2, 64, 7, 7, dtype=dt, grad=False).permute(0, 2, 3, 1).requires_grad_()
        rp = t(g, 2, 64, 7, 7, dtype=dt, grad=False).permute(0, 2, 3, 1).requires_grad_()
        w64, b64 = t(g, 64, dtype=dt), t(g, 64, dtype=dt)
        out["permuted " + name] = run(lambda x, w, b: lt.layer_norm(x, 64, w, b),
                                      (xp, w64, b64), g)
        out["permuted add_layer_norm " + name] = run(
            lambda x, r, w, b: lt.add_layer_norm(x, r, 64, w, b), (xp, rp, w64, b64), g)
        # strided rows of adjacent elements (taken where they lie)
        xq = t(g, 6, 7, 99, dtype=dt, grad=False)[..., 33:66].requires_grad_()
        rq = t(g, 7, 6, 33, dtype=dt, grad=False).transpose(0, 1).requires_grad_()
        out["row slices " + name] = run(lambda x, w, b: lt.layer_norm(x, 33, w, b), (xq, w, b), g)
        out["row slices add_layer_norm " + name] = run(
            lambda x, r, w, b: lt.add_layer_norm(x, r, 33, w, b), (xq, rq, w, b), g)
        xb = t(g, 3, 4, 5, 8, dtype=dt, grad=False).transpose(0, 1).requires_grad_()
        out["transposed batch " + name] = run(lambda x, w: lt.rms_norm(x, (5, 8), w), (xb, w2), g)
    g = torch.Generator().manual_seed(2)
    x, w, b = (t(g, 9, 64, dtype=torch.bfloat16), t(g, 64, dtype=torch.float32),
               t(g, 64, dtype=torch.float32))
    out["bfloat16, float32 weight"] = run(lambda x, w, b: lt.layer_norm(x, 64, w, b), (x, w, b), g)
    x, w = t(g, 9, 64, dtype=torch.float64), t(g, 64, dtype=torch.float32)
    out["float64, float32 weight"] = run(lambda x, w: lt.layer_norm(x, 64, w), (x, w), g)
    x, w, b = t(g, 96, 1024, dtype=torch.float32), t(g, 1024, dtype=torch.float32), \\
        t(g, 1024, dtype=torch.float32)
    out["threaded"] = run(lambda x, w, b: lt.layer_norm(x, 1024, w, b), (x, w, b), g)
    x, w = t(g, 0, 16, dtype=torch.float32), t(g, 16, dtype=torch.float32)
    out["no rows"] = run(lambda x, w: lt.layer_norm(x, 16, w), (x, w), g)
    # tensors over a byte buffer, one byte in: not aligned to their elements
    data = t(g, 5 * 16 + 16, dtype=torch.float32, grad=False)
    buf = bytearray(1) + bytearray(data.numpy().tobytes())
    x = torch.frombuffer(buf, dtype=torch.float32, offset=1, count=80).view(5, 16)
    w = torch.frombuffer(buf, dtype=torch.float32, offset=1 + 80 * 4, count=16)
    out["misaligned"] = run(lambda x, w: lt.layer_norm(x, 16, w),
                            (x.requires_grad_(), w.requires_grad_()), g)
    return out
"""


def _python(code, **env):
    env = dict(os.environ, **env)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=900, env=env)
    assert p.returncode == 0, p.stderr
    return p


@pytest.mark.skipif(not HAVE_COMPILER or SWITCHED_OFF, reason="needs a C++ compiler")
def test_the_cpp_kernels_serve_cpu_tensors():
    # (where a compiler is found, a build that fails is a failure here)
    assert _torch_eager._EXT is not None
    for key in ("CPU", "AutogradCPU"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key("lnfast::norm", key)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("lnfast::norm_backward", "CPU")
    x = torch.randn(3, 8, requires_grad=True)
    assert type(lt.layer_norm(x, 8).grad_fn).__name__ == "CppFunction"


@pytest.mark.skipif(_torch_eager._EXT is None, reason="the C++ kernels are not built here")
def test_the_same_bits_as_the_python_kernels(tmp_path):
    code = CASES + f"\ntorch.save(cases(), {str(tmp_path / 'python.pt')!r})\n"
    _python(code, LNFAST_TORCH_EXTENSION="0")
    want = torch.load(tmp_path / "python.pt")
    namespace = {}
    exec(CASES, namespace)
    got = namespace["cases"]()
    assert got.keys() == want.keys()
    for name in want:
        assert len(got[name]) == len(want[name]), name
        for g, w in zip(got[name], want[name]):
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g, w), name


def test_switched_off(tmp_path):
    code = ("import warnings; warnings.simplefilter('error'); import torch, lnfast.torch as lt; "
            "import lnfast._torch_eager as e; assert e._EXT is None; "
            "x = torch.randn(4, 8, requires_grad=True); "
            "lt.layer_norm(x, 8).sum().backward(); print(type(x.grad).__name__)")
    p = _python(code, LNFAST_TORCH_EXTENSION="0", LNFAST_CACHE_DIR=str(tmp_path / "c"))
    assert p.stdout.strip() == "Tensor"
    assert not (tmp_path / "c").exists()


def test_without_a_compiler_a_warning_and_the_python_kernels(tmp_path):
    code = ("import warnings, torch\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import lnfast.torch as lt\n"
            "import lnfast._torch_eager as e\n"
            "assert e._EXT is None\n"
            "assert any(issubclass(m.category, RuntimeWarning) for m in w), w\n"
            "print(*(str(m.message) for m in w))\n"
            "x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)\n"
            "assert torch.autograd.gradcheck(lambda x: lt.layer_norm(x, 8), (x,))\n")
    p = _python(code, LNFAST_TORCH_EXTENSION="", CXX=str(tmp_path / "no-such-c++"),
                LNFAST_CACHE_DIR=str(tmp_path / "empty"))
    assert "C++ compiler" in p.stdout and "LNFAST_TORCH_EXTENSION=0" in p.stdout, p.stdout


def test_any_thread_count_gives_the_same_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 2048, generator=g, requires_grad=True)
    r = torch.randn(64, 2048, generator=g, requires_grad=True)
    w, b = torch.randn(2048, generator=g, requires_grad=True), torch.randn(2048, generator=g)
    runs = []
    for n in (1, 2, 3):
        lnfast.set_num_threads(n)
        try:
            y, z = lt.add_layer_norm(x, r, 2048, w, b)
            runs.append([y, z, *torch.autograd.grad((y, z), (x, r, w), (torch.ones_like(y), z))])
        finally:
            lnfast.set_num_threads(None)
    for other in runs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(runs[0], other))


def test_a_bad_thread_count_in_the_environment_is_a_value_error(monkeypatch):
    x = torch.randn(4, 8, requires_grad=True)
    monkeypatch.setenv("LNFAST_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="LNFAST_NUM_THREADS"):
        lt.layer_norm(x, 8)
    with pytest.raises(ValueError, match="LNFAST_NUM_THREADS"):
        lt.rms_norm(x.detach(), 8)


def test_calls_from_several_threads_at_once():
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(256, 512, generator=g, requires_grad=True) for _ in range(8)]
    w = torch.randn(512, generator=g, requires_grad=True)

    def step(x):
        y = lt.layer_norm(x, 512, w)
        return [y.detach(), *torch.autograd.grad(y.square().sum(), (x, w))]

    alone = [step(x) for x in xs]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(step, xs * 3))
    for k, got in enumerate(together):
        assert all(torch.equal(a, b) for a, b in zip(got, alone[k % len(xs)]))


def test_expanded_and_missing_gradients():
    # the gradient of a sum arrives expanded (every stride 0); a z unused
    # gets none
    x = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    r = torch.randn(5, 16, dtype=torch.float64, requires_grad=True)
    y, _ = lt.add_layer_norm(x, r, 16)
    y.sum().backward()
    want_x = x.detach().clone().requires_grad_()
    F.layer_norm(want_x + r.detach(), (16,)).sum().backward()
    torch.testing.assert_close(x.grad, want_x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(r.grad, want_x.grad, rtol=1e-12, atol=1e-12)


def test_forward_mode_ad_is_an_error_not_a_dropped_tangent():
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():
        x = fwad.make_dual(torch.randn(3, 8), torch.ones(3, 8))
        w = fwad.make_dual(torch.randn(8), torch.ones(8))
        with pytest.raises(NotImplementedError, match="forward-mode"):
            lt.layer_norm(x, 8)
        with pytest.raises(NotImplementedError, match="forward-mode"):
            lt.rms_norm(torch.randn(3, 8), 8, w)
        # tensors that are not dual still work inside the level
        y = lt.layer_norm(torch.randn(3, 8), 8)
        assert fwad.unpack_dual(y).tangent is None


needs_eager = pytest.mark.skipif(_torch_eager._EAGER is None,
                                 reason="lnfast.torch's C++ kernels are not built here")


def _general(monkeypatch):
    """Calls without the C++ eager entry (lnfast/torch.py's own checks and
    the operator through torch.ops): its results are the reference."""
    monkeypatch.setattr(_torch_eager, "_EAGER", None)


@needs_eager
def test_the_eager_entry_takes_the_common_calls(monkeypatch):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 24, generator=g, requires_grad=True)
    r = torch.randn(4, 6, 24, generator=g, requires_grad=True)
    w = torch.randn(24, generator=g, requires_grad=True)
    w2 = torch.randn(6, 24, generator=g, requires_grad=True)
    xb = x.detach().to(torch.bfloat16).requires_grad_()
    xh, xd = (x.detach().to(t).requires_grad_() for t in (torch.float16, torch.float64))
    ln, rms = lt.LayerNorm(24), lt.RMSNorm((6, 24))
    calls = [lambda: lt.layer_norm(x, 24, w, w), lambda: lt.layer_norm(x, (6, 24), w2),
             lambda: lt.layer_norm(x, torch.Size([24]), eps=0.0),
             lambda: lt.rms_norm(x, 24, w), lambda: lt.rms_norm(xb, 24, w, eps=1e-3),
             lambda: lt.rms_norm(xb, (6, 24)), lambda: lt.rms_norm(xh, 24),
             lambda: lt.rms_norm(xd, 24), lambda: lt.add_layer_norm(x, r, 24, w, w),
             lambda: ln(x), lambda: rms(xb)]

    def run(call):
        out = call()
        out = out if isinstance(out, tuple) else (out,)
        need = [x, r, w, w2, xb, xh, xd, *ln.parameters(), *rms.parameters()]
        grads = torch.autograd.grad(sum(o.float().square().sum() for o in out), need,
                                    allow_unused=True)
        return [o.detach() for o in out] + [t for t in grads if t is not None]

    general = monkeypatch.context()
    with general as m:
        _general(m)
        want = [run(call) for call in calls]

    def refused(*args, **kwargs):
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(lt, "_normalized", refused)
    for call, expected in zip(calls, want):
        got = run(call)
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


class _Tensor(torch.Tensor):
    pass


class _Shape(tuple):
    """A tuple whose iteration says otherwise: the entry must not read it."""

    def __iter__(self):
        return iter((3, 8))

    def __len__(self):
        return 2


@needs_eager
@pytest.mark.parametrize("change", [
    "shape as a list", "shape of numpy ints", "shape of bools", "a tuple subclass",
    "a huge int in the shape", "empty shape", "wrong shape",
    "too many axes", "zero-sized axis", "eps an int", "eps a numpy float", "eps negative",
    "eps nan", "eps inf", "eps None for LayerNorm", "weight of another shape", "weight float64",
    "weight on the meta device", "residual of another shape", "a huge mode number",
    "weight a list", "bias for RMSNorm", "no residual for the fused step",
    "residual for LayerNorm", "residual of another dtype", "a Tensor subclass",
    "the meta device", "an int64 input", "a sparse input", "a mode number", "six arguments"])
def test_the_eager_entry_declines_what_it_does_not_take(change):
    x, w, r = torch.randn(3, 8), torch.randn(8), torch.randn(3, 8)
    args = {"x": x, "shape": (8,), "residual": None, "weight": w, "bias": None, "eps": 1e-5,
            "mode": 0}
    edits = {
        "shape as a list": {"shape": [8]}, "shape of numpy ints": {"shape": (np.int64(8),)},
        "shape of bools": {"shape": (True,), "x": torch.randn(3, 1), "weight": None},
        "a tuple subclass": {"shape": _Shape((8,))}, "a huge int in the shape": {
            "shape": (2**70,)},
        "empty shape": {"shape": ()}, "wrong shape": {"shape": (7,)},
        "too many axes": {"shape": (1, 3, 8)}, "zero-sized axis": {
            "x": torch.randn(3, 0), "shape": (0,), "weight": None},
        "eps an int": {"eps": 0}, "eps a numpy float": {"eps": np.float64(1e-5)},
        "eps negative": {"eps": -1.0}, "eps nan": {"eps": float("nan")},
        "eps inf": {"eps": float("inf")}, "weight on the meta device": {"weight": w.to("meta")},
        "residual of another shape": {"mode": 2, "residual": r[:2]},
        "a huge mode number": {"mode": 2**70},
        "eps None for LayerNorm": {"eps": None}, "weight of another shape": {
            "weight": torch.randn(4)}, "weight float64": {"weight": w.double()},
        "weight a list": {"weight": [1.0] * 8}, "bias for RMSNorm": {"mode": 1, "bias": w},
        "no residual for the fused step": {"mode": 2},
        "residual for LayerNorm": {"residual": r},
        "residual of another dtype": {"mode": 2, "residual": r.double()},
        "a Tensor subclass": {"x": x.as_subclass(_Tensor)},
        "the meta device": {"x": x.to("meta"), "weight": None},
        "an int64 input": {"x": x.long(), "weight": None},
        "a sparse input": {"x": x.to_sparse(), "weight": None}, "a mode number": {"mode": 1.0},
    }
    args.update(edits.get(change, {}))
    call = list(args.values())
    if change == "six arguments":
        call = call[:6]
    assert _torch_eager._EAGER(*call) is None


@needs_eager
def test_the_eager_entry_goes_through_the_dispatcher(monkeypatch):
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen:
        def __init__(self):
            super().__init__()
            self.seen = []

        def record(self, func, args, kwargs):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    class Functions(Seen, TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return self.record(func, args, kwargs)

    class Dispatched(Seen, TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return self.record(func, args, kwargs)

    x = torch.randn(3, 8, requires_grad=True)
    with Functions() as f:              # (a torch function mode: the general way)
        lt.rms_norm(x, 8)
    assert "lnfast.norm.default" in f.seen

    def refused(*args, **kwargs):
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(lt, "_normalized", refused)
    with Dispatched() as d:
        lt.layer_norm(x, 8).sum().backward()
    assert "lnfast.norm.default" in d.seen and "lnfast.norm_backward.default" in d.seen
    with torch.autograd.profiler.profile() as p:
        lt.layer_norm(x, 8)
    assert any(e.name == "lnfast::norm" for e in p.function_events)
    t = torch.randn(3, 8)            # (a lazily negated view: resolved by the dispatcher)
    assert torch.equal(lt.layer_norm(torch._neg_view(t), 8), lt.layer_norm(-t, 8))


def test_no_node_where_no_gradient_can_be_asked_for():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 16, generator=g, requires_grad=True)
    w = torch.randn(16, generator=g, requires_grad=True)
    y = lt.layer_norm(x, 16, w)
    with torch.no_grad():
        y0 = lt.layer_norm(x, 16, w)
    assert y0.grad_fn is None and not y0.requires_grad and torch.equal(y0, y.detach())
    # one tracked input is enough for a node: the weight alone
    yw = lt.layer_norm(x.detach(), 16, w)
    assert yw.grad_fn is not None
    (dw,) = torch.autograd.grad(yw.sum(), w)
    torch.testing.assert_close(dw, torch.autograd.grad(y.sum(), w, retain_graph=True)[0],
                               rtol=0, atol=0)
    # the backward operator with gradients off, as a compiled graph calls it
    _, _, mean, rstd = torch.ops.lnfast.norm(x.detach(), None, w.detach(), None, 1, 1e-5, True)
    dy = torch.randn(4, 16, generator=g)
    with torch.no_grad():
        dx, dw2, _ = torch.ops.lnfast.norm_backward(dy, x, mean, rstd, w, None, 1, True)
    assert dx.grad_fn is None
    torch.testing.assert_close(dx, torch.autograd.grad(y, x, dy)[0], rtol=0, atol=0)


@needs_eager
def test_functorch_grad_and_vmap():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 8, generator=g, dtype=torch.float64)
    w = torch.randn(8, generator=g, dtype=torch.float64)
    got_x, got_w = torch.func.grad(lambda x, w: lt.layer_norm(x, 8, w).square().sum(),
                                   argnums=(0, 1))(x, w)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    want_x, want_w = torch.autograd.grad(F.layer_norm(xr, (8,), wr).square().sum(), (xr, wr))
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)
    with warnings.catch_warnings():     # (no PyTorch note that it loops over the batch)
        warnings.simplefilter("error")
        v = torch.func.vmap(lambda x: lt.rms_norm(x, 8, w))(x.view(3, 1, 8))
    assert torch.equal(v.view(3, 8), lt.rms_norm(x, 8, w))
