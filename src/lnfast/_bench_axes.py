"""`python -m lnfast bench --axes`: LayerNorm over axes other than the last,
lnfast against PyTorch's two ways and the machine's copy bandwidth.

PyTorch has no kernel for a channels-first (N, C, H, W) array normalized
over C; its users write it with mean/var ops (as ConvNeXt's
LayerNorm(data_format="channels_first") does) or permute the channels last,
copy, run F.layer_norm and permute back into a C-ordered result.  Trailing
axes, such as (-2, -1), take F.layer_norm's normalized_shape.  Forward moves
x in and y out (2 x.nbytes); backward reads x and dy and writes dx (3).
Each shape is timed in rounds (`--rounds`, default 3), every round timing
the copy and each case in turn, as the other groups do; a case's time, and
the copy's, is the median of its rounds'.
"""
import sys

import numpy as np

import lnfast
from lnfast._bench import DTYPES, EPS, _copy, _gbs, _in_rounds, _rounds, _to_torch

CASES = [((32, 96, 56, 56), (1,)), ((32, 768, 7, 7), (1,)), ((8, 16, 64, 1024), (2, 3))]


def _torch_ways(torch, x, w, b, ax):
    """{way: (forward callable, backward callable)} for torch tensors."""
    F = torch.nn.functional
    shape = [1] * x.dim()
    for a in ax:
        shape[a] = x.shape[a]
    wv, bv = w.reshape(shape), b.reshape(shape)

    def ops():              # ConvNeXt's channels-first LayerNorm
        u = x.mean(ax, keepdim=True)
        s = (x - u).pow(2).mean(ax, keepdim=True)
        return wv * ((x - u) / torch.sqrt(s + EPS)) + bv

    def permuted():
        if ax == tuple(range(x.dim() - len(ax), x.dim())):
            return F.layer_norm(x, x.shape[-len(ax):], w, b, EPS)
        others = [k for k in range(x.dim()) if k not in ax]
        perm = others + list(ax)
        back = [perm.index(k) for k in range(x.dim())]
        y = F.layer_norm(x.permute(perm).contiguous(), [x.shape[a] for a in ax], w, b, EPS)
        return y.permute(back).contiguous()

    ways = {"torch permute": permuted}
    if ax != tuple(range(x.dim() - len(ax), x.dim())):
        ways["torch mean/var"] = ops
    out = {}
    for name, fn in ways.items():
        def backward(fn=fn):
            x.requires_grad_(True)
            y = fn()
            dy = torch.ones_like(y)
            return lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)
        out[name] = (fn, backward)
    return out


def run(args, torch, threads):
    repeat = args.repeat or (5 if args.quick else 15)
    budget = 0.5 if args.quick else 1.5
    rounds, per_round = _rounds(args, repeat)
    dtypes = args.dtypes
    rng = np.random.default_rng(0)
    rows = []
    for shape, ax in CASES:
        for dname in dtypes:
            print(f"\r{shape} axis={ax} {dname} ...", end="", file=sys.stderr, flush=True)
            dt = DTYPES[dname]
            x = rng.standard_normal(shape).astype(dt)
            norm = tuple(shape[a] for a in ax)
            w = (1 + 0.1 * rng.standard_normal(norm)).astype(dt)
            b = (0.1 * rng.standard_normal(norm)).astype(dt)
            dy = rng.standard_normal(shape).astype(dt)
            _, mean, rstd = lnfast.layer_norm_forward(x, w, b, eps=EPS, axis=ax)
            copy_fn, copy_bytes = _copy(x, 2, threads)
            cases = {("forward", "lnfast"): lambda: lnfast.layer_norm(x, w, b, eps=EPS, axis=ax),
                     ("backward", "lnfast"):
                         lambda: lnfast.layer_norm_backward(dy, x, mean, rstd, w, axis=ax)}
            if torch is not None:
                tx, tw, tb = (_to_torch(torch, a).clone() for a in (x, w, b))
                tw.requires_grad_(True)
                tb.requires_grad_(True)
                for way, (fwd, bwd) in _torch_ways(torch, tx, tw, tb, ax).items():
                    cases[("forward", way)] = lambda fwd=fwd: torch.no_grad()(fwd)()
                    cases[("backward", way)] = bwd()
            secs = _in_rounds({"copy": copy_fn, **cases}, rounds, per_round, budget)
            copy = _gbs(copy_bytes, secs["copy"])
            for direction, impl in cases:
                sec = secs[(direction, impl)]
                traffic = (2 if direction == "forward" else 3) * x.nbytes
                rows.append({"shape": "x".join(map(str, shape)), "axis": ax, "dtype": dname,
                             "direction": direction, "impl": impl, "ms": sec * 1e3,
                             "gbs": traffic / sec / 1e9, "copy_gbs": copy})
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    _print(rows)
    return rows


def _print(rows):
    print("| shape | axis | dtype | pass | impl | ms | GB/s | % copy | lnfast speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    ref = {(r["shape"], r["dtype"], r["direction"]): r["ms"] for r in rows if r["impl"] == "lnfast"}
    for r in rows:
        up = ref[(r["shape"], r["dtype"], r["direction"])]
        print(f"| {r['shape']} | {r['axis']} | {r['dtype']} | {r['direction']} | {r['impl']} "
              f"| {r['ms']:.3f} | {r['gbs']:.1f} | {100 * r['gbs'] / r['copy_gbs']:.0f} "
              f"| {r['ms'] / up:.2f}x |")

