"""GPU tests: those marked `gpu` run only where CuPy finds a CUDA device."""
import pytest


def _gpu_available():
    try:
        import cupy
    except ImportError:
        return False, "CuPy is not installed"
    try:
        if cupy.is_available():
            return True, ""
    except Exception as e:  # a broken driver counts as no GPU
        return False, f"CuPy cannot reach a GPU: {e}"
    return False, "CuPy finds no CUDA device"


def pytest_collection_modifyitems(config, items):
    ok, why = _gpu_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
