"""Long rows: float32 and float64 outputs with rows of 64 KiB or more (and 8
MiB or more in all) are written with streaming stores, which bypass the
caches (docs/performance_cpu.md).  They hold the same bits as rows written
through the cache: rows are computed independently, so the rows of a short
call (below the size that streams) must match those of the long call."""
import numpy as np
import pytest

import lnfast
from lnfast import _cpu

# (dtype, D): rows of exactly 64 KiB, and a length whose rows end off a
# vector (a scalar tail) and start at alternating 16-byte offsets.
CASES = [(np.float32, 16384), (np.float32, 16391), (np.float64, 8192), (np.float64, 8195)]
FEW = 5         # rows of the short call: 5 rows never reach 8 MiB


def long_rows(rng, dt, D):
    M = -(-(1 << 23) // (D * np.dtype(dt).itemsize))       # 8 MiB of rows
    assert _cpu.streamed(D, np.dtype(dt).itemsize, M * D * np.dtype(dt).itemsize)
    assert not _cpu.streamed(D, np.dtype(dt).itemsize, FEW * D * np.dtype(dt).itemsize)
    return rng.standard_normal((M, D)).astype(dt)


def test_what_streams():
    assert _cpu.streamed(16384, 4, 1 << 23)
    assert not _cpu.streamed(16383, 4, 1 << 24)     # rows under 64 KiB
    assert not _cpu.streamed(32768, 2, 1 << 24)     # 16-bit outputs never
    assert not _cpu.streamed(8192, 8, (1 << 23) - 8)


@pytest.mark.parametrize("dt,D", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_forward_rows_match_rows_written_through_the_cache(rng, dt, D, threads):
    lnfast.set_num_threads(threads)
    x = long_rows(rng, dt, D)
    w, b = rng.standard_normal(D).astype(dt), rng.standard_normal(D).astype(dt)
    r = rng.standard_normal(x.shape).astype(dt)
    pick = [0, 1, len(x) // 2, len(x) - 2, len(x) - 1]
    y, mean, rstd = lnfast.layer_norm_forward(x, w, b)
    y_few, mean_few, rstd_few = lnfast.layer_norm_forward(x[pick], w, b)
    assert np.array_equal(y[pick], y_few) and np.array_equal(rstd[pick], rstd_few)
    assert np.array_equal(lnfast.rms_norm(x, w)[pick], lnfast.rms_norm(x[pick], w))
    y, z, _, _ = lnfast.add_layer_norm_forward(x, r, w, b)
    y_few, z_few, _, _ = lnfast.add_layer_norm_forward(x[pick], r[pick], w, b)
    assert np.array_equal(y[pick], y_few) and np.array_equal(z[pick], z_few)


@pytest.mark.parametrize("dt,D", CASES)
def test_forward_in_place_and_into_misaligned_out(rng, dt, D):
    x = long_rows(rng, dt, D)
    want = lnfast.layer_norm(x)
    buf = np.zeros(x.size + 1, dt)[1:].reshape(x.shape)    # rows off 16 bytes
    assert lnfast.layer_norm(x, out=buf) is buf
    assert np.array_equal(buf, want)
    lnfast.layer_norm(x, out=x)
    assert np.array_equal(x, want)


@pytest.mark.parametrize("dt,D", CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_backward_rows_match_rows_written_through_the_cache(rng, dt, D, threads):
    lnfast.set_num_threads(threads)
    x = long_rows(rng, dt, D)
    dy = rng.standard_normal(x.shape).astype(dt)
    w, b = rng.standard_normal(D).astype(dt), rng.standard_normal(D).astype(dt)
    pick = [0, 1, len(x) // 2, len(x) - 2, len(x) - 1]
    _, mean, rstd = lnfast.layer_norm_forward(x, w, b)
    dx = lnfast.layer_norm_backward(dy, x, mean, rstd, w)[0]
    dx_few = lnfast.layer_norm_backward(dy[pick], x[pick], mean[pick], rstd[pick], w)[0]
    assert np.array_equal(dx[pick], dx_few)
    _, rs = lnfast.rms_norm_forward(x, w)
    dx = lnfast.rms_norm_backward(dy, x, rs, w)[0]
    assert np.array_equal(dx[pick], lnfast.rms_norm_backward(dy[pick], x[pick], rs[pick], w)[0])
    dz = rng.standard_normal(x.shape).astype(dt)
    ds = lnfast.add_layer_norm_backward(dy, x, mean, rstd, w, dz=dz)[0]
    ds_few = lnfast.add_layer_norm_backward(dy[pick], x[pick], mean[pick], rstd[pick], w,
                                            dz=dz[pick])[0]
    assert np.array_equal(ds[pick], ds_few)
