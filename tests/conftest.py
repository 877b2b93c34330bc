import numpy as np
import pytest

import lnfast

# SPEC accuracy bars: relative error ||out - ref|| / ||ref|| against float64.
FORWARD_TOL = {np.float32: 2e-6, np.float64: 1e-12}
BACKWARD_TOL = {np.float32: 2e-5, np.float64: 1e-10}
DTYPES = [np.float32, np.float64]


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test.
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


@pytest.fixture(autouse=True)
def _default_threads():
    lnfast.set_num_threads(None)
    yield
    lnfast.set_num_threads(None)
