"""`python -m lnfast bench --torch`: lnfast.torch's modules against
torch.nn's, in eager mode, and a training step of a small pre-norm
transformer block with and without `replace_norms`.

Module rows time forward plus backward of `LayerNorm`/`RMSNorm` over an (M,
D) tensor, `torch.autograd.grad(module(x), (x, weight, bias), dy)` with a
random dy (no gradients accumulated into `.grad`); "GB/s" counts the bytes a
perfect pair of kernels moves (x in, y out; x and dy in, dx out: 5
x.nbytes), and "% copy" is that over a parallel copy of x timed in the same
rounds (the copy floor, as in the other groups). Each shape is timed in
rounds (`--rounds`, default 3), every round timing the copy and each module
in turn; a case's time is the median of its rounds'. The block is width 768,
sequence 256, batch 8, float32: attention, an MLP and two LayerNorms,
forward, backward and an SGD step; the block and a copy of it after
`replace_norms` are timed by turns in the same rounds.
"""
from copy import deepcopy
import sys

from lnfast._bench import _copy, _gbs, _in_rounds, _rounds, _shape

SHAPES = ["8192x1024", "256x1024", "32x768", "1x768"]
QUICK = ["256x1024", "1x768"]


def _block(torch, width=768, heads=12):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.attn = torch.nn.MultiheadAttention(width, heads, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width))

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    return Block()


def run(args, torch, threads):
    if torch is None:
        print("bench --torch needs PyTorch (pip install lnfast[torch])", file=sys.stderr)
        return []
    import lnfast.torch as lt

    repeat = args.repeat or (5 if args.quick else 15)
    budget = 0.5 if args.quick else 1.5
    rounds, per_round = _rounds(args, repeat)
    shapes = args.shapes or (QUICK if args.quick else SHAPES)
    dtypes = args.dtypes
    rows = []
    for shape in shapes:
        M, D = _shape(shape)
        for dname in dtypes:
            dt = getattr(torch, dname)
            print(f"\r{shape} {dname} ...", end="", file=sys.stderr, flush=True)
            x = torch.randn(M, D, dtype=dt, requires_grad=True)
            dy = torch.randn(M, D, dtype=dt)
            steps = {}
            for kind in ("LayerNorm", "RMSNorm"):
                ref = getattr(torch.nn, kind)(D, dtype=dt)
                for impl, m in (("torch.nn", ref), ("lnfast", getattr(lt, kind)(D, dtype=dt))):
                    def step(m=m):
                        torch.autograd.grad(m(x), (x, *m.parameters()), dy)
                    steps[kind, impl] = step
            copy_fn, copy_bytes = _copy(x.detach().view(torch.uint8).numpy(), 2, threads)
            secs = _in_rounds({"copy": copy_fn, **steps}, rounds, per_round, budget)
            copy = _gbs(copy_bytes, secs["copy"])
            for (kind, impl) in steps:
                sec = secs[kind, impl]
                rows.append({"group": "module", "module": kind, "shape": shape, "dtype": dname,
                             "impl": impl, "ms": sec * 1e3, "gbs": 5 * x.nbytes / sec / 1e9,
                             "copy_gbs": copy})
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    rows += _training_step(torch, lt, args.quick, rounds, per_round, budget)
    _print(rows, threads)
    return rows


def _training_step(torch, lt, quick, rounds, per_round, budget):
    torch.manual_seed(0)
    ref = _block(torch)
    x = torch.randn(2 if quick else 8, 64 if quick else 256, 768)
    steps = {}
    for impl in ("torch.nn", "lnfast"):
        # (two blocks of the same weights, timed by turns)
        block = ref if impl == "torch.nn" else lt.replace_norms(deepcopy(ref))
        opt = torch.optim.SGD(block.parameters(), lr=1e-3)

        def step(block=block, opt=opt):
            opt.zero_grad()
            block(x).square().mean().backward()
            opt.step()
        steps[impl] = step
    secs = _in_rounds(steps, rounds, per_round, budget)
    return [{"group": "training step", "module": "pre-norm block",
             "shape": "x".join(map(str, x.shape)), "dtype": "float32", "impl": impl,
             "ms": sec * 1e3, "gbs": None, "copy_gbs": None} for impl, sec in secs.items()]


def _print(rows, threads):
    print(f"PyTorch eager, forward + backward, {threads} thread(s)")
    print("| module | shape | dtype | impl | ms | GB/s | % copy | lnfast speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    ref = {(r["module"], r["shape"], r["dtype"]): r["ms"] for r in rows if r["impl"] == "torch.nn"}
    for r in rows:
        gbs = "" if r["gbs"] is None else f"{r['gbs']:.1f} | {100 * r['gbs'] / r['copy_gbs']:.0f}"
        up = ref[(r["module"], r["shape"], r["dtype"])] / r["ms"] if r["impl"] == "lnfast" else 1
        print(f"| {r['module']} | {r['shape']} | {r['dtype']} | {r['impl']} | {r['ms']:.3f} "
              f"| {gbs or ' | '} | {up:.2f}x |")
