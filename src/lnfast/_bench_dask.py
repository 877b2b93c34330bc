"""`python -m lnfast bench --dask`: lnfast on Dask arrays.

- In memory: LayerNorm of a float32 65536x768 array in 8192-row chunks on
  Dask's threaded scheduler (results persisted), forward and forward plus
  backward, against lnfast on the whole NumPy array and a parallel copy
  of x (forward moves 2 x.nbytes, with the backward 5: "% copy"), same
  run.
- `--dask-gib N`: out of core, N GiB of float32 rows of 768 generated
  block by block (never all in memory), LayerNorm forward and backward
  reduced to dweight, dbias and float64 checksums of y and dx; wall time,
  GB/s of x, and the peak resident memory of the process (or of each
  worker), against one chunk's size.
- `--dask-cluster N`: the out-of-core run again on a dask.distributed
  LocalCluster of N worker processes.
"""
import os
import sys
import threading
import time

import numpy as np

import lnfast
from lnfast._bench import _copy_gbs, _median_seconds

ROWS, D, CHUNK = 65536, 768, 8192


def run(args, threads):
    try:
        import dask
        import dask.array as da
    except ImportError:
        print("bench --dask needs Dask (pip install lnfast[dask])", file=sys.stderr)
        return []
    rows = _in_memory(dask, da, args, threads)
    if args.dask_gib:
        rows.append(_out_of_core(dask, da, args.dask_gib, None))
        if args.dask_cluster:
            rows.append(_out_of_core(dask, da, args.dask_gib, args.dask_cluster))
    _print(rows, threads)
    return rows


def _in_memory(dask, da, args, threads):
    repeat = args.repeat or (3 if args.quick else 9)
    rows_n = ROWS // 8 if args.quick else ROWS
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal((rows_n, D), np.float32) for _ in range(2))
    w, b = (rng.standard_normal(D, np.float32) for _ in range(2))
    X, DY = (da.from_array(a, chunks=(CHUNK // 8 if args.quick else CHUNK, D)) for a in (x, dy))
    X, DY = dask.persist(X, DY)

    def whole_step():
        _, mean, rstd = lnfast.layer_norm_forward(x, w, b)
        return lnfast.layer_norm_backward(dy, x, mean, rstd, w)

    def dask_step():
        _, mean, rstd = lnfast.layer_norm_forward(X, w, b)
        return dask.persist(*lnfast.layer_norm_backward(DY, X, mean, rstd, w),
                            scheduler="threads")

    cases = [("forward", lambda: lnfast.layer_norm(x, w, b),
              lambda: lnfast.layer_norm(X, w, b).persist(scheduler="threads")),
             ("forward + backward", whole_step, dask_step)]
    out = []
    for (name, whole, chunked), traffic in zip(cases, (2, 5)):
        copy = _copy_gbs(x, 2, threads, repeat, 2.0)
        t_whole = _median_seconds(whole, repeat, 2.0)
        t_dask = _median_seconds(chunked, repeat, 2.0)
        out.append({"group": "in memory", "pass": name, "shape": f"{rows_n}x{D}",
                    "chunks": X.chunksize[0], "whole_ms": t_whole * 1e3,
                    "dask_ms": t_dask * 1e3, "ratio": t_dask / t_whole,
                    "copy_gbs": copy, "dask_gbs": traffic * x.nbytes / t_dask / 1e9})
    return out


def _block(block_id, rows, seed):
    """Rows of block `block_id`, the same whoever computes them."""
    rng = np.random.default_rng([seed, block_id[0]])
    return rng.random((rows, D), dtype=np.float32) * 4 - 2


def _generated(da, total_rows, seed):
    n = -(-total_rows // CHUNK)
    chunks = ((CHUNK,) * (n - 1) + (total_rows - CHUNK * (n - 1),), (D,))
    return da.map_blocks(lambda block_id=None: _block(block_id, chunks[0][block_id[0]], seed),
                         chunks=chunks, dtype=np.float32, meta=np.empty((0, 0), np.float32),
                         name=f"lnfast-bench-rows-{seed}-{total_rows}")


class _PeakRSS:
    """The largest resident set of processes `pids` while within, sampled
    every 20 ms (psutil, which dask.distributed brings), and before."""

    def __init__(self, pids):
        import psutil

        self.procs = [psutil.Process(p) for p in pids]
        self.before = max(p.memory_info().rss for p in self.procs) / 2**20
        self.peak = self.before
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, max(p.memory_info().rss for p in self.procs) / 2**20)
            self.stop.wait(0.02)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def _out_of_core(dask, da, gib, workers):
    total_rows = int(gib * 2**30 // (4 * D))
    X, DY = _generated(da, total_rows, 1), _generated(da, total_rows, 2)
    w = np.linspace(0.5, 1.5, D, dtype=np.float32)
    b = np.linspace(-1, 1, D, dtype=np.float32)
    y, mean, rstd = lnfast.layer_norm_forward(X, w, b)
    dx, dw, db = lnfast.layer_norm_backward(DY, X, mean, rstd, w)
    wanted = (dw, db, y.sum(dtype=np.float64), dx.sum(dtype=np.float64))
    print(f"\rout of core: {X.nbytes / 2**30:.1f} GiB "
          f"{'threads' if workers is None else f'{workers} worker processes'} ...",
          end="", file=sys.stderr, flush=True)
    if workers is None:
        with _PeakRSS([os.getpid()]) as rss:
            t0 = time.perf_counter()
            dask.compute(*wanted, scheduler="threads")
            sec = time.perf_counter() - t0
        where = "threaded scheduler"
    else:
        import distributed

        with distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                      host="127.0.0.1", dashboard_address=None,
                                      memory_limit=0) as cluster, \
                distributed.Client(cluster) as client:
            with _PeakRSS(client.run(os.getpid).values()) as rss:
                t0 = time.perf_counter()
                client.compute(list(wanted), sync=True)
                sec = time.perf_counter() - t0
        where = f"LocalCluster of {workers} worker processes, memory of the largest worker"
    print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    return {"group": "out of core", "where": where, "gib": X.nbytes / 2**30,
            "rows": total_rows, "chunk_mib": CHUNK * D * 4 / 2**20, "seconds": sec,
            "x_gbs": X.nbytes / sec / 1e9, "rss_before_mib": rss.before, "peak_mib": rss.peak}


def _print(rows, threads):
    print(f"Dask, LayerNorm float32 rows of {D}, {threads} thread(s)")
    print("| pass | shape | rows per chunk | whole NumPy array ms | Dask ms | Dask % copy "
          "| Dask / whole |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["group"] == "in memory":
            print(f"| {r['pass']} | {r['shape']} | {r['chunks']} | {r['whole_ms']:.2f} "
                  f"| {r['dask_ms']:.2f} | {100 * r['dask_gbs'] / r['copy_gbs']:.0f} "
                  f"| {r['ratio']:.2f} |")
    for r in rows:
        if r["group"] == "out of core":
            print(f"out of core ({r['where']}): {r['gib']:.1f} GiB of x in chunks of "
                  f"{r['chunk_mib']:.0f} MiB, forward + backward + checksums in "
                  f"{r['seconds']:.1f} s ({r['x_gbs']:.2f} GB/s of x); resident memory "
                  f"{r['rss_before_mib']:.0f} MiB before, at most {r['peak_mib']:.0f} MiB during")
