"""GPU tests: those marked `gpu` run only where CuPy finds a CUDA device.

Where none is, the CUDA kernels still run on the CPU through emulate.h
(test_cuda_emulated.py, test_gpu_emulated.py); the `emulation` fixture
gives the C++ compiler that builds it, or skips."""
import ctypes
import subprocess

import pytest

from tests.gpu.emulation import PROBE, compile_cxx, find_cxx


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


@pytest.fixture(scope="session")
def emulation(tmp_path_factory):
    """(compiler, loads): the C++ compiler that builds and runs emulate.h
    here, and whether this interpreter can load what it builds as a shared
    library (not so where the compiler targets another machine)."""
    cxx = find_cxx()
    if cxx is None:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("probe")
    (tmp / "probe.cpp").write_text(PROBE)
    p = compile_cxx(cxx, tmp / "probe.cpp", tmp / "probe")
    if p.returncode != 0:       # e.g. a C library without ucontext (musl)
        pytest.skip(f"emulate.h does not build here: {p.stderr[-300:]}")
    assert subprocess.run([str(tmp / "probe")], timeout=60).returncode == 0
    p = compile_cxx(cxx, tmp / "probe.cpp", tmp / "probe.so", "-shared", "-fPIC")
    try:
        loads = p.returncode == 0 and ctypes.CDLL(str(tmp / "probe.so")).probe() == 1
    except OSError:
        loads = False
    return cxx, loads
