"""Sweep the row length D at a fixed total size (2**24 elements by default)
and write the `python -m lnfast bench` results to benchmarks/results/.

    python benchmarks/sweep_d.py [--elements N] [--threads T] [--dtypes ...]
"""
import argparse
import pathlib
import sys

from lnfast.__main__ import main

RESULTS = pathlib.Path(__file__).parent / "results"


def shapes(elements):
    d = 64
    while d <= 65536:
        yield f"{max(1, elements // d)}x{d}"
        d *= 4


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--elements", type=int, default=1 << 24)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    name = f"sweep_d_{args.threads or 'default'}threads"
    argv = ["bench", "--no-numpy", "--shapes", *shapes(args.elements),
            "--dtypes", *args.dtypes, "--json", str(RESULTS / f"{name}.json")]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    sys.exit(main(argv))
