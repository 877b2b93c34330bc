"""Print a hash of every function's outputs on fixed inputs, all dtypes.

Builds that must agree bit for bit (any thread count, SSE2 or AVX-512, with
or without OpenMP, gcc or clang, vector or plain C row loops) print the same
hash.  An argument picks the code the row operations run, as
`lnfast._cpu.simd_path` takes it (best, avx512, avx2, portable).
"""
import hashlib
import sys

import ml_dtypes
import numpy as np

import lnfast
from lnfast import _cpu

if len(sys.argv) > 1:
    _cpu.simd_path(sys.argv[1])
rng = np.random.default_rng(7)
h = hashlib.sha256()
DTYPES = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)
# full blocks and a tail; blocks, single vectors and a tail; then rows long
# enough for streaming stores (float32 and float64, 8 MiB of rows); then few
# rows (one float32 run of dweight/dbias terms), 16-bit weights included
CASES = [(dt, 300, D, None) for D in (777, 100) for dt in DTYPES]
CASES += [(np.float32, 128, 16391, None), (np.float64, 128, 8195, None)]
CASES += [(dt, 7, 777, dt) for dt in DTYPES]
CASES = [case + (None,) for case in CASES]
# long backward rows summed by column blocks (shared by the threads): one at
# the default size, then every dtype with blocks shrunk to 64 columns
CASES += [(np.float64, 40, 32768, None, None)]
CASES += [(dt, 300, 333, None, 64) for dt in DTYPES]
for dt, M, D, wdt, blocks in CASES:
    default = _cpu.blocked_settings(0, blocks) if blocks else None
    x = rng.standard_normal((M, D)).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    if wdt is None:
        wdt = np.float32 if np.dtype(dt).itemsize == 2 else dt
    w = rng.standard_normal(D).astype(wdt)
    y, m, r = lnfast.layer_norm_forward(x, w, w)
    outputs = (y, m, r, *lnfast.layer_norm_backward(dy, x, m, r, w),
               *lnfast.add_layer_norm_forward(x, dy, w, w),
               *lnfast.add_layer_norm_backward(dy, x, m, r, w, dz=y),
               *lnfast.rms_norm_forward(x, w),
               *lnfast.rms_norm_backward(dy, x, lnfast.rms_norm_forward(x, w)[1], w))
    for a in outputs:
        h.update(np.ascontiguousarray(a).tobytes())
    if default:
        _cpu.blocked_settings(*default)
# rows far apart: channels-first tiles (full, short and 8 MiB streamed runs)
# and axes gathered into scratch
AXES = [(dt, (3, 40, 5, 7), 1) for dt in DTYPES]
AXES += [(np.float32, (2, 64, 128, 128), 1), (np.float64, (2, 32, 128, 128), 1)]
AXES += [(dt, (2, 6, 4, 10), (1, 3)) for dt in DTYPES]
for dt, shape, ax in AXES:
    x = rng.standard_normal(shape).astype(dt)
    dy = rng.standard_normal(shape).astype(dt)
    norm = tuple(np.take(shape, np.atleast_1d(ax)))
    w = rng.standard_normal(norm).astype(np.float32 if np.dtype(dt).itemsize == 2 else dt)
    y, m, r = lnfast.layer_norm_forward(x, w, w, axis=ax)
    ry, rr = lnfast.rms_norm_forward(x, w, axis=ax)
    outputs = (y, m, r, *lnfast.layer_norm_backward(dy, x, m, r, w, axis=ax),
               *lnfast.add_layer_norm_forward(x, dy, w, w, axis=ax),
               ry, rr, *lnfast.rms_norm_backward(dy, x, rr, w, axis=ax))
    for a in outputs:
        h.update(np.ascontiguousarray(a).tobytes())
print(h.hexdigest())
