"""Shared test constants."""
import numpy as np

# SPEC accuracy bars: relative error ||out - ref|| / ||ref|| against float64.
FORWARD_TOL = {np.float32: 2e-6, np.float64: 1e-12}
BACKWARD_TOL = {np.float32: 2e-5, np.float64: 1e-10}
DTYPES = [np.float32, np.float64]


def data(rng, shape, dtype, scale=1.0, shift=0.0):
    """Normal values * scale + shift, rounded to dtype."""
    return (rng.standard_normal(shape) * scale + shift).astype(dtype)


def same(got, want):
    """Bitwise equal arrays of one dtype and shape (NaN never passes)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not np.isnan(got.astype(np.float64)).any()
    assert got.tobytes() == want.tobytes()
