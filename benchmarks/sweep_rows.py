"""Sweep the number of rows M at a fixed row length (D = 8192 by default),
from one row to thousands: small batches, where a call has few rows to share
between threads.  Writes the `python -m lnfast bench` results to
benchmarks/results/.

    python benchmarks/sweep_rows.py [--d D] [--threads T] [--dtypes ...]
"""
import argparse
import pathlib
import sys

from lnfast.__main__ import main

RESULTS = pathlib.Path(__file__).parent / "results"
ROWS = (1, 8, 16, 32, 48, 64, 128, 512, 2048)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--d", type=int, default=8192)
    p.add_argument("--threads", type=int)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--functions", nargs="+", default=["layer_norm"])
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    name = f"sweep_rows_d{args.d}_{args.threads or 'default'}threads"
    argv = ["bench", "--no-numpy", "--shapes", *(f"{m}x{args.d}" for m in ROWS),
            "--dtypes", *args.dtypes, "--functions", *args.functions,
            "--json", str(RESULTS / f"{name}.json")]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    sys.exit(main(argv))
