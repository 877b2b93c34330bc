"""Markdown tables from a `python -m lnfast bench --json` file.

    python benchmarks/report.py benchmarks/results/bench_2core.json
"""
import json
import sys

from lnfast._bench import table_groups


def tables(results):
    out = []
    for func, dtype, others, shapes in table_groups(results):
        out.append(f"\n**{func}, {dtype}**\n")
        out.append("| shape | copy GB/s | lnfast ms | GB/s | % copy | % same | peak MiB |"
                   + "".join(f" {o} ms | x {o} |" for o in others))
        out.append("|" + "---|" * (7 + 2 * len(others)))
        for (m, d), me, by in shapes:
            # (files written before the same-bytes copy existed have no % same)
            same = me.get("same_copy_gbs")
            line = (f"| {m}x{d} | {me['copy_gbs']:.1f} | {me['ms']:.4g} | {me['gbs']:.1f} | "
                    f"{100 * me['gbs'] / me['copy_gbs']:.0f} | "
                    f"{'%.0f' % (100 * me['gbs'] / same) if same else '-'} | "
                    f"{me['peak_mib']:.1f} |")
            line += "".join(f" {by[o]['ms']:.4g} | {by[o]['ms'] / me['ms']:.1f} |" if o in by
                            else " - | - |" for o in others)
            out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    m = data["machine"]
    print(f"{m['platform']}, {m['threads']} threads, lnfast {m['lnfast']}, "
          f"NumPy {m['numpy']}, PyTorch {m['torch']}"
          + (f", {m['sweeps']} sweeps" if "sweeps" in m else ""))
    print(tables(data["results"]))
