"""`python -m lnfast check`: every function against the float64 reference."""
import numpy as np

import lnfast
from lnfast import reference as ref
from lnfast._checks import HALF_DTYPES

# (forward bar, backward bar) per dtype: the accuracy targets.  16-bit types:
# 1.5 u for outputs and 2 u for gradients, u the dtype's unit roundoff.
BARS = {np.dtype(np.float32): (2e-6, 2e-5), np.dtype(np.float64): (1e-12, 1e-10),
        HALF_DTYPES[0]: (1.5 * 2**-11, 2 * 2**-11), HALF_DTYPES[1]: (1.5 * 2**-8, 2 * 2**-8)}


def _compare(function, dtype, shape, names, got, want, bar):
    for name, g, w in zip(names, got, want):
        yield function, dtype, shape, name, ref.rel_error(g, w), bar


def _cases(rng):
    """Yield (function, dtype, shape, output, error, bar) for every output.
    16-bit inputs get float32 weights: dweight then comes back in float32."""
    for dtype in BARS:
        fbar, bbar = BARS[dtype]
        wdtype = np.float32 if dtype in HALF_DTYPES else dtype
        for shape in [(64, 768), (3, 5, 4097), (1000, 7)]:
            D = shape[-1]
            x, r, dy, dz = ((rng.standard_normal(shape) * 2 + 1).astype(dtype)
                            for _ in range(4))
            w = (rng.standard_normal(D) + 1).astype(wdtype)
            b = rng.standard_normal(D).astype(wdtype)
            case = (dtype, shape)

            ry, rmean, rrstd = ref.layer_norm_forward(x, w, b)
            yield from _compare("layer_norm", *case, ["y"], [lnfast.layer_norm(x, w, b)],
                                [ry], fbar)
            y, mean, rstd = lnfast.layer_norm_forward(x, w, b)
            yield from _compare("layer_norm_forward", *case, ["y", "mean", "rstd"],
                                [y, mean, rstd], [ry, rmean, rrstd], fbar)
            yield from _compare("layer_norm_backward", *case, ["dx", "dweight", "dbias"],
                                lnfast.layer_norm_backward(dy, x, mean, rstd, w),
                                ref.layer_norm_backward(dy, x, rmean, rrstd, w), bbar)

            got = lnfast.add_layer_norm_forward(x, r, w, b)
            yield from _compare("add_layer_norm_forward", *case,
                                ["y", "z", "mean", "rstd"], got,
                                ref.add_layer_norm_forward(x, r, w, b), fbar)
            z = got[1]
            _, zmean, zrstd = ref.layer_norm_forward(z, w, b)
            yield from _compare("add_layer_norm_backward", *case,
                                ["dsum", "dweight", "dbias"],
                                lnfast.add_layer_norm_backward(dy, z, got[2], got[3], w, dz=dz),
                                ref.add_layer_norm_backward(dy, z, zmean, zrstd, w, dz), bbar)

            ry, rrstd = ref.rms_norm_forward(x, w)
            yield from _compare("rms_norm", *case, ["y"], [lnfast.rms_norm(x, w)], [ry], fbar)
            y, rstd = lnfast.rms_norm_forward(x, w)
            yield from _compare("rms_norm_forward", *case, ["y", "rstd"], [y, rstd],
                                [ry, rrstd], fbar)
            yield from _compare("rms_norm_backward", *case, ["dx", "dweight"],
                                lnfast.rms_norm_backward(dy, x, rstd, w),
                                ref.rms_norm_backward(dy, x, rrstd, w), bbar)
    for offset in (1e3, 1e4, 1e5):
        x = (offset + rng.standard_normal((16, 4096))).astype(np.float32)
        yield from _compare(f"layer_norm (offset {offset:g})", np.float32, x.shape, ["y"],
                            [lnfast.layer_norm(x)], [ref.layer_norm_forward(x)[0]], 1e-6)


def run(seed=None):
    """Print a pass/fail table; return True when every check passed."""
    rng = np.random.default_rng(seed)
    rows = [(f, np.dtype(t).name, "x".join(map(str, s)), q, e, bar, e <= bar)
            for f, t, s, q, e, bar in _cases(rng)]
    header = ("function", "dtype", "shape", "output", "rel. error", "bar", "result")
    widths = [max(len(header[0]), *(len(r[0]) for r in rows)), 8, 10, 7, 10, 8, 6]
    line = "  ".join(f"{h:<{w}}" for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for f, t, s, q, e, bar, ok in rows:
        print(f"{f:<{widths[0]}}  {t:<8}  {s:<10}  {q:<7}  {e:<10.2e}  {bar:<8.1e}  "
              f"{'pass' if ok else 'FAIL'}")
    failed = sum(not r[-1] for r in rows)
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return failed == 0
