"""docs/performance_summary.md and docs/performance_summary.png from the
benchmark results in benchmarks/results (one table per group, the plot of
the CPU group): `python benchmarks/summary.py` (the plot needs matplotlib).
"""
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance_summary.md"
PLOT = ROOT / "docs" / "performance_summary.png"
CPU_SHAPES = [(8192, 1024), (65536, 768), (4096, 4096), (256, 1024), (32, 768)]
FUNCTIONS = ["layer_norm forward", "layer_norm backward", "add_layer_norm forward",
             "add_layer_norm backward", "rms_norm forward", "rms_norm backward"]


def load(name):
    data = json.loads((RESULTS / f"{name}.json").read_text())
    m = data["machine"]
    machine = (f"{m['platform']}, {m['threads']} threads, NumPy {m['numpy']}"
               + (f", PyTorch {m['torch']}" if m.get("torch") else ""))
    return data["results"], machine


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def cpu_section():
    rows, machine = load("bench_2core")
    pick = {(r["function"], r["impl"], r["M"], r["D"]): r for r in rows if r["dtype"] == "float32"}
    lines = []
    for f in FUNCTIONS:
        for M, D in CPU_SHAPES:
            me = pick.get((f, "lnfast", M, D))
            if me is None:
                continue
            peer = pick.get((f, "torch", M, D))
            lines.append([f, f"{M}x{D}", f"{me['ms']:.4g}", f"{me['gbs']:.1f}",
                          f"{100 * me['gbs'] / me['same_copy_gbs']:.0f}",
                          f"{peer['ms']:.4g}" if peer else "",
                          f"{peer['ms'] / me['ms']:.1f}x" if peer else ""])
    return (f"## CPU: LayerNorm, the fused add, RMSNorm (float32)\n\n"
            f"`python -m lnfast bench --no-numpy --json benchmarks/results/bench_2core.json`"
            f" on {machine}. \"% copy\": of a parallel copy moving the same bytes, same run; "
            f"the peer is PyTorch's own kernel (`aten.native_layer_norm` and its backward, "
            f"`rms_norm`). Every dtype and shape: [bench_2core_tables.md](bench_2core_tables.md).\n\n"
            + table(["function", "shape", "lnfast ms", "GB/s", "% copy", "PyTorch ms",
                     "lnfast speed-up"], lines) + "\n\n![CPU](performance_summary.png)\n")


def axes_section():
    rows, machine = load("axes_2core")
    by = {(r["shape"], r["dtype"], r["direction"], r["impl"]): r for r in rows}
    lines = []
    for (shape, dtype, direction, impl), r in by.items():
        if impl != "lnfast":
            continue
        peers = [by.get((shape, dtype, direction, p)) for p in ("torch permute", "torch mean/var")]
        best = min((p["ms"] for p in peers if p), default=None)
        lines.append([f"{shape} axis {tuple(r['axis'])}", dtype, direction, f"{r['ms']:.3f}",
                      f"{100 * r['gbs'] / r['copy_gbs']:.0f}",
                      f"{best:.3f}" if best else "", f"{best / r['ms']:.1f}x" if best else ""])
    return (f"## Channels-first and other axes\n\n`python -m lnfast bench --axes --dtypes "
            f"float32 bfloat16 --json benchmarks/results/axes_2core.json` on {machine}. The peer "
            f"is the faster of PyTorch's two ways (permute, copy, normalize and permute back; "
            f"or `mean`/`var` ops); details in [performance_axes.md](performance_axes.md).\n\n"
            + table(["shape", "dtype", "pass", "lnfast ms", "% copy", "faster PyTorch ms",
                     "lnfast speed-up"], lines) + "\n")


def against(rows, case, peer):
    """Rows of (case..., peer ms, lnfast ms, speed-up), lnfast's rows in order."""
    ref = {tuple(r[k] for k in case): r["ms"] for r in rows if r["impl"] == peer}
    out = []
    for r in rows:
        if r["impl"] == "lnfast":
            key = tuple(r[k] for k in case)
            out.append([*key, f"{ref[key]:.3f}", f"{r['ms']:.3f}", f"{ref[key] / r['ms']:.2f}x"])
    return out


def torch_section():
    rows, machine = load("torch_2core")
    lines = against(rows, ("module", "shape", "dtype"), "torch.nn")
    return (f"## PyTorch modules, eager forward + backward\n\n`python -m lnfast bench --torch "
            f"--json benchmarks/results/torch_2core.json` on {machine}; details in [torch.md](torch.md).\n\n"
            + table(["module", "shape", "dtype", "torch.nn ms", "lnfast ms", "speed-up"], lines)
            + "\n")


def dask_section():
    rows, machine = load("dask_2core")
    mem = [[r["pass"], r["shape"], r["chunks"], f"{r['whole_ms']:.2f}", f"{r['dask_ms']:.2f}",
            f"{r['ratio']:.2f}"] for r in rows if r["group"] == "in memory"]
    ooc = [[r["where"], f"{r['gib']:.0f}", f"{r['seconds']:.1f}", f"{r['x_gbs']:.2f}",
            f"{r['rss_before_mib']:.0f}", f"{r['peak_mib']:.0f}"]
           for r in rows if r["group"] == "out of core"]
    return (f"## Dask\n\n`python -m lnfast bench --dask --dask-gib 32 --dask-cluster 2 --json "
            f"benchmarks/results/dask_2core.json` on {machine}; details in [dask.md](dask.md).\n\n"
            + table(["pass", "shape", "rows per chunk", "whole NumPy array ms", "Dask ms",
                     "Dask / whole"], mem) + "\n\n"
            + table(["out of core", "GiB", "s", "GB/s of x", "MiB before", "MiB at most"], ooc)
            + "\n")


def jax_section():
    rows, machine = load("jax_2core")
    lines = against(rows, ("pass", "shape", "dtype"), "jax.numpy")
    return (f"## JAX, jitted\n\n`python -m lnfast bench --jax --json "
            f"benchmarks/results/jax_2core.json` on {machine}; details (and why the float32 "
            f"8192x1024 forward varies) in [jax.md](jax.md).\n\n"
            + table(["pass", "shape", "dtype", "jax.numpy ms", "lnfast.jax ms", "speed-up"],
                     lines) + "\n")


def plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, machine = load("bench_2core")
    pick = {(r["function"], r["impl"], r["M"], r["D"]): r for r in rows if r["dtype"] == "float32"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, f in zip(axes, ("layer_norm forward", "layer_norm backward")):
        shapes = [s for s in CPU_SHAPES if (f, "lnfast", *s) in pick]
        xs = range(len(shapes))
        for k, (impl, color) in enumerate((("lnfast", "tab:blue"), ("torch", "tab:orange"))):
            vals = [100 * pick[(f, impl, *s)]["gbs"] / pick[(f, impl, *s)]["same_copy_gbs"]
                    if (f, impl, *s) in pick else 0 for s in shapes]
            ax.bar([x + (k - 0.5) * 0.38 for x in xs], vals, 0.38, color=color,
                   label="PyTorch" if impl == "torch" else impl)
        ax.axhline(100, color="gray", lw=1, ls="--")
        ax.set_xticks(list(xs), [f"{M}x{D}" for M, D in shapes])
        ax.set_title(f"LayerNorm {f.split()[1]}, float32")
    axes[0].set_ylabel("% of a copy of the same bytes")
    axes[0].legend()
    fig.suptitle(f"Higher is better; 100 = the copy floor ({machine.split(',')[1].strip()})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=90)


def main():
    intro = ("# Performance\n\nThe current numbers, one table per group, each from one run "
             "of the command above it on the machine it names (2 vCPUs of an AMD EPYC with "
             "AVX-512 and 24 GiB, a shared virtual machine: medians, and ratios from the same "
             "run). The full record, with what each change bought, is [performance.md]"
             "(performance.md); ideas measured and dropped are on [speed_experiments.md]"
             "(speed_experiments.md). This page is written by "
             "`python benchmarks/summary.py`.\n\n")
    PAGE.write_text(intro + "\n".join(s() for s in (cpu_section, axes_section, torch_section,
                                                      dask_section, jax_section)))
    plot()


if __name__ == "__main__":
    main()
