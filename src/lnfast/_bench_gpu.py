"""`python -m lnfast bench --gpu`: the CUDA kernels against PyTorch's and a
device-to-device copy, timed with CUDA events.

Each case is warmed up, then timed in samples of back-to-back calls between
two events (so the host's launch overhead hides behind the device's work, as
in a real training step); the median sample is reported, per call.  Inputs
rotate through enough copies to exceed the L2 cache twice over, so no call
finds its inputs cached by the previous one.
"""
import sys

import numpy as np

import lnfast
from lnfast._bench import DTYPES, EPS, _shape

GPU_SHAPES = ["32768x4096", "8192x16384"]
GPU_QUICK_SHAPES = ["4096x4096"]


def _cupy_or_exit():
    try:
        import cupy as cp
    except ImportError:
        raise SystemExit("bench --gpu needs CuPy (pip install 'lnfast[gpu]') and a CUDA device")
    if not cp.is_available():
        raise SystemExit("bench --gpu: CuPy finds no CUDA device")
    return cp


def _torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _median_ms(cp, fn, copies, repeat):
    """Median milliseconds per call of fn(k), k rotating over the copies."""
    batch = max(copies, 4)
    for k in range(batch):
        fn(k % copies)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeat):
        start.record()
        for k in range(batch):
            fn(k % copies)
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / batch)
    return float(np.median(times))


def run(args):
    cp = _cupy_or_exit()
    torch = _torch_cuda()
    shapes = [_shape(s) for s in (args.shapes or (GPU_QUICK_SHAPES if args.quick else GPU_SHAPES))]
    dtypes = args.dtypes
    repeat = args.repeat or (10 if args.quick else 50)
    dev = cp.cuda.Device()
    l2 = dev.attributes["L2CacheSize"]
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"lnfast {lnfast.__version__} | CuPy {cp.__version__} | "
          f"{'torch ' + torch.__version__ if torch else 'torch with CUDA not available'} | {name}")
    rows = []
    for (M, D) in shapes:
        for dtype in dtypes:
            print(f"\r{M}x{D} {dtype} ...", end="", file=sys.stderr, flush=True)
            dt = DTYPES[dtype]
            nbytes = M * D * dt.itemsize
            copies = int(max(2, -(-2 * l2 // nbytes)))
            rng = cp.random.default_rng(0)
            xs = [rng.standard_normal((M, D), dtype=cp.float32).astype(dt) for _ in range(copies)]
            dys = [rng.standard_normal((M, D), dtype=cp.float32).astype(dt) for _ in range(copies)]
            w = (rng.standard_normal(D, dtype=cp.float32) + 1).astype(dt)
            b = rng.standard_normal(D, dtype=cp.float32).astype(dt)
            stats = [lnfast.layer_norm_forward(x, w, b, eps=EPS)[1:] for x in xs]
            dst = cp.empty_like(xs[0])

            def copy(k):
                dst[...] = xs[k]

            times = {
                "copy": _median_ms(cp, copy, copies, repeat),
                ("forward", "lnfast"): _median_ms(
                    cp, lambda k: lnfast.layer_norm_forward(xs[k], w, b, eps=EPS), copies, repeat),
                ("backward", "lnfast"): _median_ms(
                    cp, lambda k: lnfast.layer_norm_backward(dys[k], xs[k], *stats[k], w),
                    copies, repeat),
            }
            if torch is not None:
                tx = [torch.from_dlpack(x) for x in xs]
                tdy = [torch.from_dlpack(g) for g in dys]
                tw, tb = torch.from_dlpack(w), torch.from_dlpack(b)
                aten = torch.ops.aten
                tstats = [aten.native_layer_norm(t, [D], tw, tb, EPS)[1:] for t in tx]
                times[("forward", "torch")] = _median_ms(
                    cp, lambda k: torch.nn.functional.layer_norm(tx[k], [D], tw, tb, EPS),
                    copies, repeat)
                times[("backward", "torch")] = _median_ms(
                    cp, lambda k: aten.native_layer_norm_backward(
                        tdy[k], tx[k], [D], *tstats[k], tw, tb, [True, True, True]),
                    copies, repeat)
            copy_gbs = 2 * nbytes / times["copy"] / 1e6
            for func, traffic in (("forward", 2), ("backward", 3)):
                row = {"function": f"layer_norm {func}", "dtype": dtype, "M": M, "D": D,
                       "copy_gbs": copy_gbs, "ms": times[(func, "lnfast")]}
                row["gbs"] = traffic * nbytes / row["ms"] / 1e6
                if (func, "torch") in times:
                    row["torch_ms"] = times[(func, "torch")]
                rows.append(row)
            del xs, dys, stats, dst
            cp.get_default_memory_pool().free_all_blocks()
    print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
    print(f"\n{'function':<20} {'dtype':<9} {'shape':>11} {'copy GB/s':>9} | {'lnfast ms':>9} "
          f"{'GB/s':>7} {'%copy':>5} | {'torch ms':>9} {'x':>6}")
    for r in rows:
        t = r.get("torch_ms")
        print(f"{r['function']:<20} {r['dtype']:<9} {'%dx%d' % (r['M'], r['D']):>11} "
              f"{r['copy_gbs']:9.0f} | {r['ms']:9.4f} {r['gbs']:7.0f} "
              f"{100 * r['gbs'] / r['copy_gbs']:5.0f} | "
              + (f"{t:9.4f} {t / r['ms']:5.2f}x" if t else f"{'-':>9} {'-':>6}"))
    print("\nx = torch time / lnfast time; GB/s counts x and y (forward), x, dy and dx (backward)")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"device": name, "results": rows}, f, indent=1)
        print(f"wrote {args.json}")
    return 0
