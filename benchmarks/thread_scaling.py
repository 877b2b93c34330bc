"""Thread scaling: every function on one shape for 1..N threads, results in
benchmarks/results/thread_scaling.json.

    python benchmarks/thread_scaling.py [--shape 16384x1024] [--max-threads N]
"""
import argparse
import json
import os
import pathlib
import sys

from lnfast.__main__ import main

RESULTS = pathlib.Path(__file__).parent / "results"

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="16384x1024")
    p.add_argument("--max-threads", type=int, default=os.cpu_count())
    p.add_argument("--dtypes", nargs="+", default=["float32"])
    args = p.parse_args()
    RESULTS.mkdir(exist_ok=True)
    runs = {}
    for n in range(1, args.max_threads + 1):
        path = RESULTS / f"thread_scaling_{n}.json.tmp"
        main(["bench", "--no-numpy", "--shapes", args.shape, "--dtypes", *args.dtypes,
              "--threads", str(n), "--json", str(path)])
        runs[n] = json.loads(path.read_text())
        path.unlink()
    out = RESULTS / "thread_scaling.json"
    out.write_text(json.dumps(runs, indent=1))
    print(f"wrote {out}")
    sys.exit(0)
