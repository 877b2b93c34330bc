"""`python -m lnfast bench --jax`: lnfast.jax against LayerNorm written in
jax.numpy, both under jax.jit on the CPU, forward and forward plus
backward (`jax.vjp` of the function, every gradient), with the bytes a
perfect kernel moves (forward 2 x.nbytes, with the backward 5) over a
parallel copy of x ("% copy").  Each shape is timed in rounds
(`--rounds`, default 3), every round timing each case and the copy in
turn, each case after a pause, so that neither thread pool (XLA's,
OpenMP's) is still spinning from the one before; a case's time is the
median of its rounds'."""
import functools
import sys

import numpy as np

from lnfast._bench import _copy, _gbs, _in_rounds, _numpy_forward, _rounds, _shape

SHAPES = ["8192x1024", "256x1024", "32x768"]
QUICK = ["256x1024", "32x768"]
# The passes, and the bytes a perfect kernel moves in each, in x.nbytes.
TRAFFIC = {"forward": 2, "forward + backward": 5}


def run(args, threads):
    try:
        import jax
        import jax.numpy as jnp
        import lnfast.jax as lj
    except ImportError as e:
        print(f"bench --jax needs JAX (pip install lnfast[jax]): {e}", file=sys.stderr)
        return []

    jnp_layer_norm = functools.partial(_numpy_forward, xp=jnp)     # (the NumPy baseline's code)
    repeat = args.repeat or (5 if args.quick else 15)
    budget = 0.5 if args.quick else 1.5
    rounds, per_round = _rounds(args, repeat)
    rows = []
    rng = np.random.default_rng(0)
    for shape in args.shapes or (QUICK if args.quick else SHAPES):
        M, D = _shape(shape)
        for dname in args.dtypes:
            print(f"\r{shape} {dname} ...", end="", file=sys.stderr, flush=True)
            dt = getattr(jnp, dname)
            x, dy = (jnp.asarray(rng.standard_normal((M, D), np.float32), dt) for _ in range(2))
            w, b = (jnp.asarray(rng.standard_normal(D, np.float32)) for _ in range(2))
            cases = {}
            for name in TRAFFIC:
                for impl, fn in (("jax.numpy", jnp_layer_norm), ("lnfast", lj.layer_norm)):
                    if name == "forward":
                        f, a = jax.jit(fn), (x, w, b)
                    else:
                        f = jax.jit(lambda x, w, b, dy, fn=fn: jax.vjp(fn, x, w, b)[1](dy))
                        a = (x, w, b, dy)
                    jax.block_until_ready(f(*a))        # (compiled here)
                    cases[name, impl] = lambda f=f, a=a: jax.block_until_ready(f(*a))
            copy_fn, copy_bytes = _copy(np.asarray(x).view(np.uint8), 2, threads)
            secs = _in_rounds({"copy": copy_fn, **cases}, rounds, per_round, budget,
                              pause=set(cases))
            copy = _gbs(copy_bytes, secs["copy"])
            for name, impl in cases:
                sec = secs[name, impl]
                rows.append({"pass": name, "shape": shape, "dtype": dname, "impl": impl,
                             "ms": sec * 1e3, "gbs": TRAFFIC[name] * x.nbytes / sec / 1e9,
                             "copy_gbs": copy})
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    _print(rows, threads, jax)
    return rows


def _print(rows, threads, jax):
    print(f"JAX {jax.__version__}, jax.jit on the CPU; lnfast {threads} thread(s)")
    print("| pass | shape | dtype | jax.numpy ms | lnfast.jax ms | % copy | speed-up |")
    print("|---|---|---|---|---|---|---|")
    ref = {(r["pass"], r["shape"], r["dtype"]): r["ms"] for r in rows if r["impl"] == "jax.numpy"}
    for r in rows:
        if r["impl"] == "lnfast":
            base = ref[(r["pass"], r["shape"], r["dtype"])]
            print(f"| {r['pass']} | {r['shape']} | {r['dtype']} | {base:.3f} | {r['ms']:.3f} "
                  f"| {100 * r['gbs'] / r['copy_gbs']:.0f} | {base / r['ms']:.2f}x |")
