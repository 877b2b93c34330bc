"""Shared test constants."""
import numpy as np

# SPEC accuracy bars: relative error ||out - ref|| / ||ref|| against float64.
FORWARD_TOL = {np.float32: 2e-6, np.float64: 1e-12}
BACKWARD_TOL = {np.float32: 2e-5, np.float64: 1e-10}
DTYPES = [np.float32, np.float64]
