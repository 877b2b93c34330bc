import zlib

import numpy as np
import pytest

import lnfast


@pytest.fixture
def rng(request):
    # A fresh, reproducible stream per test: seeded from the test's id by
    # crc32, not hash(), which Python salts anew in every process.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _default_threads():
    lnfast.set_num_threads(None)
    yield
    lnfast.set_num_threads(None)
