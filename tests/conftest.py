import numpy as np
import pytest

import lnfast


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test.
    return np.random.default_rng(abs(hash(request.node.nodeid)) % 2**32)


@pytest.fixture(autouse=True)
def _default_threads():
    lnfast.set_num_threads(None)
    yield
    lnfast.set_num_threads(None)
