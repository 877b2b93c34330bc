"""`python -m lnfast check`: every function against the float64 reference."""
import numpy as np

import lnfast
from lnfast import reference as ref

# (forward bar, backward bar) per dtype: the SPEC's accuracy targets.
BARS = {np.float32: (2e-6, 2e-5), np.float64: (1e-12, 1e-10)}


def _cases(rng):
    """Yield (function, dtype, shape, quantity, error, bar)."""
    for dtype in (np.float32, np.float64):
        fbar, bbar = BARS[dtype]
        for shape in [(64, 768), (3, 5, 4097), (1000, 7)]:
            D = shape[-1]
            x = rng.standard_normal(shape).astype(dtype) * 2 + 1
            w = (rng.standard_normal(D) + 1).astype(dtype)
            b = rng.standard_normal(D).astype(dtype)
            dy = rng.standard_normal(shape).astype(dtype)
            ry, rmean, rrstd = ref.layer_norm_forward(x, w, b)
            y = lnfast.layer_norm(x, w, b)
            yield "layer_norm", dtype, shape, "y", ref.rel_error(y, ry), fbar
            got = lnfast.layer_norm_forward(x, w, b)
            for name, g, r in zip(("y", "mean", "rstd"), got, (ry, rmean, rrstd)):
                yield "layer_norm_forward", dtype, shape, name, ref.rel_error(g, r), fbar
            back = lnfast.layer_norm_backward(dy, x, got[1], got[2], w)
            rback = ref.layer_norm_backward(dy, x, rmean, rrstd, w)
            for name, g, r in zip(("dx", "dweight", "dbias"), back, rback):
                yield "layer_norm_backward", dtype, shape, name, ref.rel_error(g, r), bbar
    for offset in (1e3, 1e4, 1e5):
        x = (offset + rng.standard_normal((16, 4096))).astype(np.float32)
        err = ref.rel_error(lnfast.layer_norm(x), ref.layer_norm_forward(x)[0])
        yield f"layer_norm (offset {offset:g})", np.float32, x.shape, "y", err, 1e-6


def run(seed=None):
    """Print a pass/fail table; return True when every check passed."""
    rng = np.random.default_rng(seed)
    rows = [(f, np.dtype(t).name, "x".join(map(str, s)), q, e, bar, e <= bar)
            for f, t, s, q, e, bar in _cases(rng)]
    header = ("function", "dtype", "shape", "output", "rel. error", "bar", "result")
    widths = [max(len(header[0]), *(len(r[0]) for r in rows)), 7, 10, 7, 10, 8, 6]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for f, t, s, q, e, bar, ok in rows:
        print(f"{f:<{widths[0]}}  {t:<7}  {s:<10}  {q:<7}  {e:<10.2e}  {bar:<8.0e}  "
              f"{'pass' if ok else 'FAIL'}")
    failed = sum(not r[-1] for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return failed == 0
