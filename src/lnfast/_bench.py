"""`python -m lnfast bench`: lnfast against NumPy, PyTorch CPU where it is
installed, and the machine's own copy bandwidth, measured side by side.

Effective bandwidth counts the bytes a perfect kernel must move: forward reads
x and writes y; backward reads x and dy and writes dx.  Copy bandwidth is a
parallel memcpy of x on the same threads, read plus write ("% copy"); a
second copy moves as many bytes as the kernel must ("% same"), so that both
touch the same amount of memory: a kernel touching three or four arrays may
spill from a cache that holds a copy of x.

Each shape is timed in rounds (`--rounds`): every round times each case,
and the copies, in turn, and a case's time is the median of its rounds'
medians, so that a noisy spell of a shared machine falls on every case
alike rather than on the few timed during it.
"""
import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
import tracemalloc

import numpy as np

import lnfast
from lnfast import _cpu
from lnfast._checks import HALF_DTYPES, compute_dtype
from lnfast._threads import _MAX_THREADS, get_num_threads

DTYPES = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
          "float16": HALF_DTYPES[0], "bfloat16": HALF_DTYPES[1]}

DEFAULT_SHAPES = ["8192x1024", "65536x768", "4096x4096", "1024x65536",
                  "1x768", "32x768", "256x1024"]
QUICK_SHAPES = ["4096x1024", "256x1024", "1x768"]
EPS = 1e-5
PAUSE = 0.2     # seconds before a case when other runtimes' thread pools are about


def add_arguments(p):
    p.add_argument("--quick", action="store_true", help="small shapes, few repeats (under a minute)")
    p.add_argument("--shapes", nargs="+", metavar="MxD", type=_shape_text, help=f"default: {' '.join(DEFAULT_SHAPES)}")
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                   help="default: all four; --axes, --torch and --jax: float32 and bfloat16 "
                        "(the only ones they time); --gpu: float32; --dask: float32 only")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="lnfast and torch threads")
    p.add_argument("--repeat", type=_positive, default=None, help="timed calls per case")
    p.add_argument("--rounds", type=_positive, default=None,
                   help="CPU, --axes, --torch and --jax groups: rounds per shape, each timing every "
                        "case (and the copy) in turn; a case's time is the median of its "
                        "rounds' (default 3, --quick 1)")
    p.add_argument("--functions", nargs="+", choices=["layer_norm", "add_layer_norm", "rms_norm"],
                   help="default: all")
    p.add_argument("--no-numpy", action="store_true", help="skip the (slow) NumPy baseline")
    p.add_argument("--peers", action="store_true",
                   help="also onnxruntime's and XLA's (jax.jit) LayerNorm and RMSNorm, where "
                        "installed, each case after a pause for the thread pools to settle")
    p.add_argument("--json", metavar="PATH", type=_new_file, help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", type=_png_file,
                   help="write a PNG plot to PATH, a name ending in .png (needs matplotlib)")
    p.add_argument("--isa", choices=["best", "avx512", "avx2", "portable"], default="best",
                   help="run lnfast's row sweeps built for a lesser instruction set than the "
                        "CPU's best (what CPUs without it get); default: best")
    p.add_argument("--axes", action="store_true",
                   help="LayerNorm over other axes (channels-first (N, C, H, W) over C, and "
                        "two trailing axes) against PyTorch's ways, instead")
    p.add_argument("--torch", action="store_true",
                   help="lnfast.torch's modules against torch.nn's (eager forward + backward, "
                        "default shapes 8192x1024 256x1024 32x768 1x768) and a transformer "
                        "block's training step, instead")
    p.add_argument("--dask", action="store_true",
                   help="LayerNorm on Dask arrays against the whole NumPy array, instead")
    p.add_argument("--dask-gib", type=float, default=0, metavar="GIB",
                   help="with --dask: also an out-of-core run over GIB GiB generated lazily")
    p.add_argument("--dask-cluster", type=_positive, default=0, metavar="N",
                   help="with --dask-gib: the out-of-core run again on a LocalCluster of N "
                        "worker processes")
    p.add_argument("--jax", action="store_true",
                   help="lnfast.jax against LayerNorm in jax.numpy, both jitted, instead")
    p.add_argument("--gpu", action="store_true",
                   help="time the CUDA kernels on CuPy arrays instead (needs a GPU)")


GROUPS = ("axes", "torch", "dask", "jax", "gpu")
PLOT_NEEDS = "--plot needs matplotlib: pip install 'lnfast[bench]'"
# The dtypes each group times (the first list) and times by default (the second).
GROUP_DTYPES = {None: (list(DTYPES), list(DTYPES)), "gpu": (list(DTYPES), ["float32"]),
                "axes": (["float32", "bfloat16"],) * 2, "torch": (["float32", "bfloat16"],) * 2,
                "jax": (["float32", "bfloat16"],) * 2, "dask": (["float32"],) * 2}
# Options only the default group reads, and those some groups do not read.
DEFAULT_GROUP_ONLY = ("plot", "peers", "functions", "no_numpy")
NOT_READ_BY = {"rounds": ("dask", "gpu"), "isa": ("gpu",), "threads": ("gpu",)}


def check_arguments(parser, args):
    """Refuse (parser.error: exit status 2) options that the chosen group
    would ignore, before a run of many minutes rather than silently."""
    groups = [g for g in GROUPS if getattr(args, g)]
    if len(groups) > 1:
        parser.error("choose one of " + ", ".join(f"--{g}" for g in groups))
    group = groups[0] if groups else None
    if args.shapes and group in ("axes", "dask"):
        parser.error(f"--shapes does not apply to --{group}, which times shapes of its own")
    for option in DEFAULT_GROUP_ONLY:
        if getattr(args, option) not in (None, False) and group is not None:
            option = option.replace("_", "-")
            parser.error(f"--{option} belongs to the default group, not to --{group}")
    for option, groups in NOT_READ_BY.items():
        if getattr(args, option) not in (None, "best") and group in groups:
            parser.error(f"--{option} does not apply to --{group}")
    timed, default = GROUP_DTYPES[group]
    others = [d for d in args.dtypes or () if d not in timed]
    if others:
        parser.error(f"--dtypes: --{group} times {' and '.join(timed)} only, not "
                     f"{', '.join(others)}")
    args.dtypes = args.dtypes or default
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(PLOT_NEEDS)
    if not math.isfinite(args.dask_gib) or args.dask_gib < 0:
        parser.error(f"--dask-gib: expected a size in GiB >= 0, got {args.dask_gib!r}")
    if args.dask_gib and group != "dask":
        parser.error("--dask-gib needs --dask")
    if args.dask_cluster and not args.dask_gib:
        parser.error("--dask-cluster needs --dask-gib")


def _positive(text):
    """An argparse type: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _thread_count(text):
    n = _positive(text)
    if n > _MAX_THREADS:
        raise argparse.ArgumentTypeError(f"at most {_MAX_THREADS} threads, got {n}")
    return n


def _new_file(text):
    """An argparse type: a file path whose folder exists (checked before a
    run of many minutes, not after)."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no folder {folder!r} to write {text!r} in")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    existed = os.path.exists(text)
    try:                # (a folder may exist and still refuse the file)
        with open(text, "ab"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror}") from None
    if not existed:
        os.remove(text)
    return text


def _png_file(text):
    """An argparse type: a new file's path (_new_file) ending in .png, the
    format the plot is written in."""
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is a PNG file: expected a name ending in "
                                         f".png, got {text!r}")
    return _new_file(text)


def _shape(text):
    """An MxD shape's (M, D)."""
    try:
        m, d = (int(v) for v in text.lower().split("x"))
    except ValueError:
        m = d = 0
    if m < 1 or d < 1:
        raise argparse.ArgumentTypeError(f"expected MxD of positive integers such as "
                                         f"8192x1024, got {text!r}")
    if m * d > sys.maxsize // 8:        # (no array of them, of any dtype, can exist)
        raise argparse.ArgumentTypeError(f"{text!r} has more elements than a process can "
                                         f"address")
    return m, d


def _shape_text(text):
    """An argparse type: an MxD shape, checked (_shape) and kept as text for
    every group to read."""
    _shape(text)
    return text.lower()


def _median_seconds(fn, repeat, budget):
    """Median seconds per call.  Small calls are timed in batches so that one
    sample lasts at least 0.2 ms, well above the timer's resolution."""
    warm_until = time.perf_counter() + min(0.2, budget / 10)
    calls = 0
    while calls < 2 or time.perf_counter() < warm_until:   # page faults, thread team
        t0 = time.perf_counter()
        fn()
        one = time.perf_counter() - t0
        calls += 1
    batch = max(1, int(2e-4 / max(one, 1e-9)))
    times = []
    start = time.perf_counter()
    while len(times) < repeat and (len(times) < 3 or time.perf_counter() - start < budget):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - t0) / batch)
    return float(np.median(times))


def _copy(x, traffic, threads):
    """(a parallel copy moving `traffic` times x.nbytes, read plus write;
    the bytes it moves)."""
    src = x if traffic == 2 else np.ones(traffic * x.nbytes // 2, np.uint8)
    dst = np.empty_like(src)
    return (lambda: _cpu.parallel_copy(src, dst, threads)), 2 * src.nbytes


def _rounds(args, repeat):
    """(rounds per shape, timed calls per case in each round): --rounds,
    default 3 (--quick 1), sharing `repeat` calls."""
    rounds = args.rounds or (1 if args.quick else 3)
    return rounds, max(3, -(-repeat // rounds))


def _in_rounds(fns, rounds, per_round, budget, pause=()):
    """Median seconds per call of each of fns (a dict), timed by turns in
    `rounds` rounds of `budget / rounds` each, the median of its rounds': a
    noisy spell of a shared machine touches every case.  Keys in `pause`
    wait PAUSE first (no runtime's pool still spinning from the case
    before)."""
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            if key in pause:
                time.sleep(PAUSE)
            times[key].append(_median_seconds(fn, per_round, budget / rounds))
    return {key: float(np.median(t)) for key, t in times.items()}


def _copy_gbs(x, traffic, threads, repeat, budget):
    """GB/s of a parallel copy moving `traffic` times x.nbytes."""
    fn, nbytes = _copy(x, traffic, threads)
    return _gbs(nbytes, _median_seconds(fn, repeat, budget))


def _gbs(nbytes, seconds):
    return nbytes / seconds / 1e9


def _peak_bytes(fn):
    """Peak bytes NumPy allocated during one call (tracemalloc sees NumPy)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --- the implementations -----------------------------------------------------
# Bytes a perfect kernel moves, in units of one M x D array: forward reads x
# and writes y (2); backward reads x, dy and writes dx (3); the fused add-norm
# forward reads x, residual and writes y, z (4); its backward reads dy, z, dz
# and writes dsum (4).
TRAFFIC = {"layer_norm forward": 2, "layer_norm backward": 3,
           "add_layer_norm forward": 4, "add_layer_norm backward": 4,
           "rms_norm forward": 2, "rms_norm backward": 3}


# NumPy as its users write it: in the data's dtype, or in float32 for the
# 16-bit types (NumPy has no bfloat16 arithmetic of its own), cast back.
# xp: the array module; `bench --peers` has XLA compile the same code over
# jax.numpy.

def _wide(*arrays):
    return [a.astype(compute_dtype(a.dtype), copy=False) for a in arrays]


def _numpy_forward(x, w, b, xp=np):
    xw, w, b = _wide(x, w, b)
    mean = xw.mean(axis=-1, keepdims=True)
    xc = xw - mean
    var = (xc * xc).mean(axis=-1, keepdims=True)
    return (xc / xp.sqrt(var + EPS) * w + b).astype(x.dtype, copy=False)


def _numpy_backward(dy, x, mean, rstd, w, xp=np):
    dyw, xw, w = _wide(dy, x, w)
    xhat = (xw - mean[:, None]) * rstd[:, None]
    g = dyw * w
    dx = rstd[:, None] * (g - g.mean(-1, keepdims=True)
                          - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx.astype(x.dtype, copy=False), (dyw * xhat).sum(0), dyw.sum(0)


def _numpy_rms_forward(x, w, xp=np):
    xw, w = _wide(x, w)
    return (xw / xp.sqrt((xw * xw).mean(axis=-1, keepdims=True) + EPS) * w).astype(
        x.dtype, copy=False)


def _numpy_rms_backward(dy, x, rstd, w, xp=np):
    dyw, xw, w = _wide(dy, x, w)
    xhat = xw * rstd[:, None]
    g = dyw * w
    dx = rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdims=True))
    return dx.astype(x.dtype, copy=False), (dyw * xhat).sum(0)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _to_torch(torch, a):
    if a.dtype == HALF_DTYPES[1]:      # torch cannot read ml_dtypes' bfloat16
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _statistics(x, r, w, b):
    """What the backward cases take from lnfast's forward: LayerNorm's mean
    and rstd, the fused step's z and its mean and rstd, RMSNorm's rstd."""
    _, mean, rstd = lnfast.layer_norm_forward(x, w, b, eps=EPS)
    _, z, zmean, zrstd = lnfast.add_layer_norm_forward(x, r, w, b, eps=EPS)
    _, rms_rstd = lnfast.rms_norm_forward(x, w, eps=EPS)
    return {"mean": mean, "rstd": rstd, "z": z, "zmean": zmean, "zrstd": zrstd,
            "rms_rstd": rms_rstd}


def _cases(torch, x, r, w, b, dy, stats, with_numpy):
    """{(function, implementation): zero-argument callable}; stats: _statistics'."""
    D = x.shape[-1]
    mean, rstd, z, zmean, zrstd, rms_rstd = (stats[k] for k in (
        "mean", "rstd", "z", "zmean", "zrstd", "rms_rstd"))
    dz = r
    cases = {
        ("layer_norm forward", "lnfast"): lambda: lnfast.layer_norm_forward(x, w, b, eps=EPS),
        ("layer_norm backward", "lnfast"): lambda: lnfast.layer_norm_backward(
            dy, x, mean, rstd, w),
        ("add_layer_norm forward", "lnfast"): lambda: lnfast.add_layer_norm_forward(
            x, r, w, b, eps=EPS),
        ("add_layer_norm forward", "add+lnfast"): lambda: lnfast.layer_norm_forward(
            np.add(x, r), w, b, eps=EPS),
        ("add_layer_norm backward", "lnfast"): lambda: lnfast.add_layer_norm_backward(
            dy, z, zmean, zrstd, w, dz=dz),
        ("add_layer_norm backward", "lnfast+add"): lambda: np.add(
            lnfast.layer_norm_backward(dy, z, zmean, zrstd, w)[0], dz),
        ("rms_norm forward", "lnfast"): lambda: lnfast.rms_norm_forward(x, w, eps=EPS),
        ("rms_norm backward", "lnfast"): lambda: lnfast.rms_norm_backward(dy, x, rms_rstd, w),
    }
    if with_numpy:
        cases[("layer_norm forward", "numpy")] = lambda: _numpy_forward(x, w, b)
        cases[("layer_norm backward", "numpy")] = lambda: _numpy_backward(dy, x, mean, rstd, w)
        cases[("rms_norm forward", "numpy")] = lambda: _numpy_rms_forward(x, w)
        cases[("rms_norm backward", "numpy")] = lambda: _numpy_rms_backward(dy, x, rms_rstd, w)
    if torch is not None:
        tx, tr, tw, tb, tdy, tz = (_to_torch(torch, a) for a in (x, r, w, b, dy, z))
        aten = torch.ops.aten
        _, tmean, trstd = aten.native_layer_norm(tx, [D], tw, tb, EPS)
        mask = [True, True, True]
        cases[("layer_norm forward", "torch")] = lambda: aten.native_layer_norm(
            tx, [D], tw, tb, EPS)
        cases[("layer_norm backward", "torch")] = lambda: aten.native_layer_norm_backward(
            tdy, tx, [D], tmean, trstd, tw, tb, mask)
        cases[("add_layer_norm forward", "torch")] = lambda: aten.native_layer_norm(
            tx + tr, [D], tw, tb, EPS)
        cases[("add_layer_norm backward", "torch")] = lambda: aten.native_layer_norm_backward(
            tdy, tz, [D], tmean, trstd, tw, tb, mask)[0] + tr
        cases[("rms_norm forward", "torch")] = lambda: torch.nn.functional.rms_norm(
            tx, [D], tw, EPS)
    return cases


def run(args):
    if args.gpu:
        from lnfast import _bench_gpu

        return _bench_gpu.run(args)
    shapes = [_shape(s) for s in (args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES))]
    repeat = args.repeat or (5 if args.quick else 21)
    budget = 0.5 if args.quick else 1.5
    rounds, per_round = _rounds(args, repeat)
    if args.threads is not None:
        lnfast.set_num_threads(args.threads)
    threads = get_num_threads()
    sweeps = _cpu.simd_path(args.isa)
    torch = _torch()
    if torch is not None:
        torch.set_num_threads(threads)
    if args.torch:
        from lnfast import _bench_torch

        results = _bench_torch.run(args, torch, threads)
        _cpu.simd_path("best")
        _write_json(args.json, threads, torch, sweeps, results)
        return 0
    if args.jax:
        from lnfast import _bench_jax

        _write_json(args.json, threads, torch, sweeps, _bench_jax.run(args, threads))
        return 0
    if args.dask:
        from lnfast import _bench_dask

        _write_json(args.json, threads, torch, sweeps, _bench_dask.run(args, threads))
        return 0
    if args.axes:
        from lnfast import _bench_axes

        results = _bench_axes.run(args, torch, threads)
        _cpu.simd_path("best")
        _write_json(args.json, threads, torch, sweeps, results)
        return 0

    rng = np.random.default_rng(0)
    results = []
    total = len(shapes) * len(args.dtypes)
    for k, ((M, D), dtype) in enumerate(((s, t) for s in shapes for t in args.dtypes), 1):
        print(f"\r[{k}/{total}] {M}x{D} {dtype} ...", end="", file=sys.stderr, flush=True)
        dt = DTYPES[dtype]
        x, dy, r = (rng.standard_normal((M, D), np.float32).astype(dt) for _ in range(3))
        w, b = (rng.standard_normal(D, np.float32).astype(dt) for _ in range(2))
        copies = {k: _copy(x, k, threads) for k in sorted(set(TRAFFIC.values()))}
        stats = _statistics(x, r, w, b)
        cases = _cases(torch, x, r, w, b, dy, stats, not args.no_numpy)
        if args.peers:
            from lnfast import _bench_peers

            cases.update(_bench_peers.cases(x, r, w, b, dy, stats, threads))
        cases = {key: fn for key, fn in cases.items()
                 if not args.functions or key[0].split()[0] in args.functions}
        secs = _in_rounds({**{t: fn for t, (fn, _) in copies.items()}, **cases}, rounds,
                          per_round, budget, set(cases) if args.peers else ())
        copy_gbs = {t: _gbs(nbytes, secs[t]) for t, (_, nbytes) in copies.items()}
        for (func, impl), fn in cases.items():
            nbytes = TRAFFIC[func] * x.nbytes
            sec = secs[(func, impl)]
            results.append({
                "function": func, "impl": impl, "dtype": dtype,
                "M": M, "D": D, "ms": sec * 1e3, "gbs": _gbs(nbytes, sec),
                "copy_gbs": copy_gbs[2], "same_copy_gbs": copy_gbs[TRAFFIC[func]],
                "peak_mib": _peak_bytes(fn) / 2**20 if impl == "lnfast" else None,
            })
    _cpu.simd_path("best")
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    impls = list(dict.fromkeys(r["impl"] for r in results))
    _print_tables(results, threads, torch, sweeps)
    _write_json(args.json, threads, torch, sweeps, results)
    if args.plot:
        _plot(results, impls, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cpu_model():
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _machine(threads, torch):
    return {
        "platform": platform.platform(), "processor": _cpu_model(),
        "cpus": os.cpu_count(),
        "threads": threads, "lnfast": lnfast.__version__, "numpy": np.__version__,
        "torch": torch.__version__ if torch else None,
        **{name: sys.modules[name].__version__ for name in ("onnxruntime", "jax", "dask")
           if name in sys.modules},
    }


def table_groups(results):
    """Per (function, dtype): the other implementations, and per shape the
    lnfast row with the other implementations' rows by name."""
    for func, dtype in dict.fromkeys((r["function"], r["dtype"]) for r in results):
        rows = [r for r in results if (r["function"], r["dtype"]) == (func, dtype)]
        others = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "lnfast"]
        shapes = []
        for shape in dict.fromkeys((r["M"], r["D"]) for r in rows):
            by = {r["impl"]: r for r in rows if (r["M"], r["D"]) == shape}
            shapes.append((shape, by["lnfast"], by))
        yield func, dtype, others, shapes


def _print_tables(results, threads, torch, sweeps):
    print(f"lnfast {lnfast.__version__} | numpy {np.__version__}"
          f"{' | torch ' + torch.__version__ if torch else ' | torch not installed'}"
          f" | {threads} threads | {platform.machine()} | {sweeps} sweeps")
    for func, dtype, others, shapes in table_groups(results):
        print(f"\n{func}, {dtype}  (median ms; GB/s = bytes a perfect kernel moves / time)")
        head = (f"{'shape':>11} {'copy GB/s':>9} | {'lnfast ms':>9} {'GB/s':>6} "
                f"{'%copy':>5} {'%same':>5} {'peak MiB':>8}")
        head += "".join(f" | {o + ' ms':>10} {'x':>6}" for o in others)
        print(head)
        print("-" * len(head))
        for shape, me, by in shapes:
            line = (f"{'%dx%d' % shape:>11} {me['copy_gbs']:9.1f} | {me['ms']:9.4f} "
                    f"{me['gbs']:6.1f} {100 * me['gbs'] / me['copy_gbs']:5.0f} "
                    f"{100 * me['gbs'] / me['same_copy_gbs']:5.0f} {me['peak_mib']:8.1f}")
            for o in others:
                if o in by:
                    line += f" | {by[o]['ms']:10.4f} {by[o]['ms'] / me['ms']:5.1f}x"
            print(line)
    print("\n%copy: of a copy of x; %same: of a copy moving the bytes the kernel moves"
          "\nx = that implementation's time / lnfast's time (above 1: lnfast is faster)")


def _write_json(path, threads, torch, sweeps, results):
    if path:
        with open(path, "w") as f:
            json.dump({"machine": {**_machine(threads, torch), "sweeps": sweeps},
                       "results": results}, f, indent=1)
        print(f"wrote {path}")


def _plot(results, impls, path):
    """GB/s against shape, one panel per function (rows) and dtype (columns),
    with the copy bandwidth as a dashed line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(PLOT_NEEDS)
    funcs = list(dict.fromkeys(r["function"] for r in results))
    dtypes = list(dict.fromkeys(r["dtype"] for r in results))
    fig, axes = plt.subplots(len(funcs), len(dtypes), squeeze=False,
                             figsize=(4 * len(dtypes), 3 * len(funcs)))
    for i, func in enumerate(funcs):
        for j, dtype in enumerate(dtypes):
            ax = axes[i][j]
            rows = [r for r in results if (r["function"], r["dtype"]) == (func, dtype)]
            labels = list(dict.fromkeys(f"{r['M']}x{r['D']}" for r in rows))
            for impl in impls:
                ys = [r["gbs"] for r in rows if r["impl"] == impl]
                if len(ys) == len(labels):
                    ax.plot(labels, ys, marker="o", label=impl)
            ax.plot(labels, [r["copy_gbs"] for r in rows if r["impl"] == "lnfast"], "k--",
                    label="copy")
            ax.set_title(f"{func}, {dtype}", fontsize=9)
            ax.set_ylabel("GB/s", fontsize=8)
            ax.tick_params(axis="x", rotation=45, labelsize=7)
            ax.tick_params(axis="y", labelsize=7)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
