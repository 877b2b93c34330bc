"""Extra memory of long rows: no scratch or stand-in weight of a row's
length is made before a row needs it."""
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

import lnfast

BF16 = np.dtype(ml_dtypes.bfloat16)
LONG = 2 * 65536 + 7        # longer than the forward's stand-in weights


def _sanitized():
    with open("/proc/self/maps") as f:
        return "libasan" in f.read()


@pytest.mark.skipif(not sys.platform.startswith("linux") or _sanitized(),
                    reason="peak memory from Linux's ru_maxrss, without ASan's shadow memory")
def test_a_long_16bit_row_runs_its_forward_in_little_extra_memory():
    """x of 2**28 + 5 float16 values (512 MiB): the forward's peak is x, y
    and at most 64 MiB more (scratch rows and float32 stand-in weights of
    the row's length would take 2-4 GiB)."""
    code = textwrap.dedent("""
        import resource, numpy as np, lnfast
        n = 2**28 + 5
        x = np.empty(n, np.float16)
        x[0::2] = 1.0
        x[1::2] = -1.0
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        y, mean, rstd = lnfast.layer_norm_forward(x)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert y[0] == 1.0 and y[-1] == 1.0 and y[1] == -1.0, y[:4]
        print((after - before) * 1024 - y.nbytes)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    extra = int(out.stdout.split()[-1])
    assert extra <= 64 << 20, f"{extra / 2**20:.0f} MiB beyond x and y"


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
@pytest.mark.parametrize("given", ["none", "weight", "bias"])
def test_stand_in_weights_by_pieces_give_the_bits_of_full_ones(rng, dtype, given):
    """weight/bias None on rows longer than the stand-ins: the map runs by
    pieces, with the bits of explicit ones and zeros, on direct, gathered
    and rare (redone in float64) rows alike."""
    compute = np.float64 if dtype == np.float64 else np.float32
    x = rng.standard_normal((3, LONG)).astype(dtype)
    x[1] = (rng.standard_normal(LONG) * 1e-18).astype(dtype)    # redone in float64
    x[2, ::5] = 0
    w = (rng.standard_normal(LONG) + 1).astype(compute)
    b = rng.standard_normal(LONG).astype(compute)
    ones, zeros = np.ones(LONG, compute), np.zeros(LONG, compute)
    wt, bt = {"none": (None, None), "weight": (w, None), "bias": (None, b)}[given]
    full = (ones if wt is None else wt, zeros if bt is None else bt)
    for xs in (x, x[:, ::-1].copy()[:, ::-1], np.asfortranarray(x)):
        got = lnfast.layer_norm_forward(xs, wt, bt)
        ref = lnfast.layer_norm_forward(xs, *full)
        for a, r in zip(got, ref):
            np.testing.assert_array_equal(a, r)
        np.testing.assert_array_equal(lnfast.rms_norm(xs, wt), lnfast.rms_norm(xs, full[0]))
        res = rng.standard_normal(xs.shape).astype(dtype)
        for a, r in zip(lnfast.add_layer_norm_forward(xs, res, wt, bt),
                        lnfast.add_layer_norm_forward(xs, res, *full)):
            np.testing.assert_array_equal(a, r)
