"""docs/performance.md and docs/performance.png from the benchmark results
in benchmarks/results (one table per group, the plot of the CPU group):
`python benchmarks/summary.py` (the plot needs matplotlib).
"""
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
PLOT = ROOT / "docs" / "performance.png"
CPU_SHAPES = [(8192, 1024), (65536, 768), (4096, 4096), (1024, 65536), (256, 1024),
              (32, 768), (1, 768)]
FUNCTIONS = ["layer_norm forward", "layer_norm backward", "add_layer_norm forward",
             "add_layer_norm backward", "rms_norm forward", "rms_norm backward"]
# The CPU group's implementations: name in the results, label, plot colour.
IMPLS = [("lnfast", "lnfast", "tab:blue"), ("torch", "PyTorch", "tab:orange"),
         ("onnxruntime", "onnxruntime", "tab:green"), ("xla", "XLA", "tab:red"),
         ("numpy", "NumPy", "tab:gray")]
PEERS = IMPLS[1:]
VERSIONS = [("numpy", "NumPy"), ("torch", "PyTorch"), ("onnxruntime", "onnxruntime"),
            ("jax", "JAX"), ("dask", "Dask")]
CLOSE = 1.1         # a peer within this factor of lnfast's time is named under the table


def load(name):
    """(results, the machine in words, the machine's record) of one JSON file."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    m = data["machine"]
    cpu = f"{m['processor']} ({m['cpus']} CPUs), " if m.get("processor") else ""
    machine = (f"{cpu}{m['platform']}, {m['threads']} threads"
               + "".join(f", {label} {m[k]}" for k, label in VERSIONS if m.get(k)))
    return data["results"], machine, m


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def cpu_results():
    """{(function, implementation, M, D): row} of the float32 CPU run, and
    the machine."""
    rows, machine, m = load("peers_2core")
    pick = {(r["function"], r["impl"], r["M"], r["D"]): r for r in rows
            if r["dtype"] == "float32"}
    return pick, machine, m


def pct(r, copy="copy_gbs"):
    return f"{100 * r['gbs'] / r[copy]:.0f}"


def cpu_section():
    pick, machine, _ = cpu_results()
    lines, close = [], []
    for f in FUNCTIONS:
        for M, D in CPU_SHAPES:
            me = pick.get((f, "lnfast", M, D))
            if me is None:
                continue
            peers = [(label, pick.get((f, impl, M, D))) for impl, label, _ in PEERS]
            lines.append([f, f"{M}x{D}", f"{me['ms']:.4g}", f"{me['gbs']:.1f}", pct(me),
                          pct(me, "same_copy_gbs")]
                         + [f"{p['ms'] / me['ms']:.1f}x" if p else "" for _, p in peers])
            close += [f"{label} at {f} {M}x{D} ({p['ms'] / me['ms']:.2f}x)"
                      for label, p in peers if p and p["ms"] / me["ms"] < CLOSE]
    return (f"## CPU: LayerNorm, the fused add, RMSNorm (float32)\n\n"
            f"`python -m lnfast bench --peers --dtypes float32 --json "
            f"benchmarks/results/peers_2core.json` on {machine}: each case timed in 3 rounds, "
            f"by turns with the other cases and the copies, its time the median of the "
            f"rounds'. The peers, each as its users call it: PyTorch's own kernels "
            f"(`aten.native_layer_norm` and its backward, `rms_norm`, the add as a separate "
            f"op); onnxruntime's LayerNormalization, RMSNormalization and fused "
            f"SkipLayerNormalization operators (forward only: an inference runtime); XLA "
            f"compiling the NumPy column's code, written over `jax.numpy`, under `jax.jit` "
            f"(the backward from x, dy and the forward's mean and rstd, as lnfast's); NumPy "
            f"in its own ops. \"x\": the peer's time over lnfast's (above 1: lnfast is "
            f"faster). Where a peer comes within {CLOSE:g}x of lnfast or ahead of it: "
            + ("; ".join(close) or "nowhere") + ". All four dtypes, against PyTorch, from "
            f"another run on an Intel Xeon with a larger cache: "
            f"[bench_2core_tables.md](bench_2core_tables.md).\n\n"
            + table(["function", "shape", "lnfast ms", "GB/s", "% copy", "% same"]
                    + [f"{label} x" for _, label, _ in PEERS], lines)
            + "\n\n![CPU](performance.png)\n")


def axes_section():
    rows, machine, _ = load("axes_2core")
    by = {(r["shape"], r["dtype"], r["direction"], r["impl"]): r for r in rows}
    lines = []
    for (shape, dtype, direction, impl), r in by.items():
        if impl != "lnfast":
            continue
        peers = [by.get((shape, dtype, direction, p)) for p in ("torch permute", "torch mean/var")]
        best = min((p["ms"] for p in peers if p), default=None)
        lines.append([f"{shape} axis {tuple(r['axis'])}", dtype, direction, f"{r['ms']:.3f}",
                      pct(r), f"{best:.3f}" if best else "", f"{best / r['ms']:.1f}x" if best else ""])
    return (f"## Channels-first and other axes\n\n`python -m lnfast bench --axes --dtypes "
            f"float32 bfloat16 --json benchmarks/results/axes_2core.json` on {machine}. The peer "
            f"is the faster of PyTorch's two ways (permute, copy, normalize and permute back; "
            f"or `mean`/`var` ops); details in [performance_axes.md](performance_axes.md).\n\n"
            + table(["shape", "dtype", "pass", "lnfast ms", "% copy", "faster PyTorch ms",
                     "lnfast speed-up"], lines) + "\n")


def against(rows, case, peer):
    """Rows of (case..., peer ms, lnfast ms, lnfast % copy, speed-up),
    lnfast's rows in order (% copy empty where the run has no copy)."""
    ref = {tuple(r[k] for k in case): r["ms"] for r in rows if r["impl"] == peer}
    out = []
    for r in rows:
        if r["impl"] == "lnfast":
            key = tuple(r[k] for k in case)
            copy = pct(r) if r.get("copy_gbs") else ""
            out.append([*key, f"{ref[key]:.3f}", f"{r['ms']:.3f}", copy,
                        f"{ref[key] / r['ms']:.2f}x"])
    return out


def torch_section():
    rows, machine, _ = load("torch_2core")
    lines = against(rows, ("module", "shape", "dtype"), "torch.nn")
    return (f"## PyTorch modules, eager forward + backward\n\n`python -m lnfast bench --torch "
            f"--json benchmarks/results/torch_2core.json` on {machine}; details, and how the small shapes "
            f"move from run to run, in [torch.md](torch.md).\n\n"
            + table(["module", "shape", "dtype", "torch.nn ms", "lnfast ms", "lnfast % copy",
                     "speed-up"], lines)
            + "\n")


def dask_section():
    rows, machine, _ = load("dask_2core")
    mem = [[r["pass"], r["shape"], r["chunks"], f"{r['whole_ms']:.2f}", f"{r['dask_ms']:.2f}",
            f"{100 * r['dask_gbs'] / r['copy_gbs']:.0f}", f"{r['ratio']:.2f}"]
           for r in rows if r["group"] == "in memory"]
    ooc = [[r["where"], f"{r['gib']:.0f}", f"{r['seconds']:.1f}", f"{r['x_gbs']:.2f}",
            f"{r['rss_before_mib']:.0f}", f"{r['peak_mib']:.0f}"]
           for r in rows if r["group"] == "out of core"]
    return (f"## Dask\n\n`python -m lnfast bench --dask --dask-gib 32 --dask-cluster 2 --json "
            f"benchmarks/results/dask_2core.json` on {machine}; details, and how the ratios move from "
            f"run to run, in [dask.md](dask.md).\n\n"
            + table(["pass", "shape", "rows per chunk", "whole NumPy array ms", "Dask ms",
                     "Dask % copy", "Dask / whole"], mem) + "\n\n"
            + table(["out of core", "GiB", "s", "GB/s of x", "MiB before", "MiB at most"], ooc)
            + "\n")


def jax_section():
    rows, machine, _ = load("jax_2core")
    lines = against(rows, ("pass", "shape", "dtype"), "jax.numpy")
    return (f"## JAX, jitted\n\n`python -m lnfast bench --jax --json "
            f"benchmarks/results/jax_2core.json` on {machine}; details (and why the float32 "
            f"8192x1024 forward varies) in [jax.md](jax.md).\n\n"
            + table(["pass", "shape", "dtype", "jax.numpy ms", "lnfast.jax ms",
                     "lnfast.jax % copy", "speed-up"], lines) + "\n")


def plot():
    """Bars of % of a copy of the same bytes per shape, lnfast and its peers
    side by side, LayerNorm forward and backward (float32)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pick, _, m = cpu_results()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2), sharey=True)
    for ax, f in zip(axes, ("layer_norm forward", "layer_norm backward")):
        shapes = [s for s in CPU_SHAPES if (f, "lnfast", *s) in pick]
        present = [i for i in IMPLS if any((f, i[0], *s) in pick for s in shapes)]
        width = 0.8 / len(present)
        for k, (impl, label, color) in enumerate(present):
            vals = [100 * pick[(f, impl, *s)]["gbs"] / pick[(f, impl, *s)]["same_copy_gbs"]
                    if (f, impl, *s) in pick else 0 for s in shapes]
            ax.bar([x + (k - (len(present) - 1) / 2) * width for x in range(len(shapes))],
                   vals, width, color=color, label=label)
        ax.axhline(100, color="black", lw=1, ls="--")
        ax.set_xticks(range(len(shapes)), [f"{M}x{D}" for M, D in shapes], rotation=25,
                      fontsize=8)
        ax.set_title(f"LayerNorm {f.split()[1]}, float32")
    axes[0].set_ylabel("% of a copy of the same bytes")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"Higher is better; 100 (dashed) = a parallel copy of the same bytes "
                 f"({m.get('processor') or 'CPU'}, {m['threads']} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=90)


INTRO = """# Performance

The current numbers, one table per group, each from one run of the
command above it on the machine it names (a shared virtual machine:
medians of repeated calls, and ratios from the same run). This page is
written by `python benchmarks/summary.py` from the JSON files in
`benchmarks/results`.

**What the numbers mean.** Normalization does a few operations per element
and touches each element once, so it is bound by memory, not arithmetic.
The fastest possible kernel reads its inputs once and writes its outputs
once: the benchmark counts those bytes (forward: x in, y out; backward: x
and dy in, dx out; the fused add: x and residual in, y and z out) and
divides by the time ("GB/s"). What the machine's memory allows is measured
in the same run by a parallel `memcpy` on the same threads: "% copy" is
GB/s over that of a copy of x, "% same" over that of a copy moving as
many bytes as the kernel (1.5 or 2 times x for the three- and four-array
calls, whose data may spill from a cache that holds a copy of x). Near
100, no kernel can do much better on that machine; above 100 happens
where the kernel's arrays stay in a cache that the copy spills. Small shapes
(256x1024 and below) live in the caches and are dominated by per-call
costs, so their percentages are low for everyone; there the peers'
columns tell more.

**Reproducing.** From a clone, `pip install '.[bench]'` and the command
above each table; `--quick` runs in under a minute, `--json PATH` keeps
the results and `--plot PATH.png` draws them. The peers are optional and left
out where not installed: `pip install '.[peers]'` (onnx, onnxruntime, JAX)
and `'.[torch]'`, `'.[dask]'`. The groups (`--axes`, `--torch`, `--dask`,
`--jax`, `--gpu`) go one per run; an option that the chosen group would
ignore (`--shapes` with `--axes` or `--dask`, which time shapes of their
own; `--plot` and `--peers`, which belong to the default group;
`--dask-gib` without `--dask`) is refused before anything is timed.

How the CPU kernels come near the copy's speed, what each technique bought and where
the targets are missed is in [performance_cpu.md](performance_cpu.md) (the
record, on the machines it names) and, over other axes,
[performance_axes.md](performance_axes.md); ideas measured and dropped are
on [speed_experiments.md](speed_experiments.md).

"""


def main():
    PAGE.write_text(INTRO + "\n".join(s() for s in (cpu_section, axes_section, torch_section,
                                                     dask_section, jax_section)))
    plot()


if __name__ == "__main__":
    main()
