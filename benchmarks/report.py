"""Markdown tables from a `python -m lnfast bench --json` file.

    python benchmarks/report.py benchmarks/results/bench_2core.json
"""
import json
import sys


def tables(results):
    out = []
    groups = dict.fromkeys((r["function"], r["dtype"]) for r in results)
    for func, dtype in groups:
        rows = [r for r in results if (r["function"], r["dtype"]) == (func, dtype)]
        others = [i for i in dict.fromkeys(r["impl"] for r in rows) if i != "lnfast"]
        out.append(f"\n**{func}, {dtype}**\n")
        head = "| shape | copy GB/s | lnfast ms | GB/s | % copy | peak MiB |"
        head += "".join(f" {o} ms | x {o} |" for o in others)
        out.append(head)
        out.append("|" + "---|" * (6 + 2 * len(others)))
        for shape in dict.fromkeys((r["M"], r["D"]) for r in rows):
            by = {r["impl"]: r for r in rows if (r["M"], r["D"]) == shape}
            me = by["lnfast"]
            line = (f"| {shape[0]}x{shape[1]} | {me['copy_gbs']:.1f} | {me['ms']:.4g} | "
                    f"{me['gbs']:.1f} | {100 * me['gbs'] / me['copy_gbs']:.0f} | "
                    f"{me['peak_mib']:.1f} |")
            for o in others:
                line += (f" {by[o]['ms']:.4g} | {by[o]['ms'] / me['ms']:.1f} |"
                         if o in by else " - | - |")
            out.append(line)
    return "\n".join(out)


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    m = data["machine"]
    print(f"{m['platform']}, {m['threads']} threads, lnfast {m['lnfast']}, "
          f"NumPy {m['numpy']}, PyTorch {m['torch']}")
    print(tables(data["results"]))
