"""The CUDA kernels run on the CPU (tests/gpu/emulate.cpp over emulate.h: each
CUDA thread a fiber, barriers for __syncthreads and warp shuffles) against a float64
reference: float, double, float16 and bfloat16; 16-byte packs and strided
rows; residual, RMSNorm, one-element and long rows; fewer blocks than rows.
This checks the kernels' logic where no GPU is at hand, not their speed."""
import subprocess

import pytest

from tests.gpu.emulation import HERE, compile_cxx

# relative error bars per element type: forward, dx, dweight/dbias
BARS = {"float": (2e-6, 2e-5, 2e-5), "double": (1e-12, 1e-10, 1e-10),
        "half": (1.5 * 2**-11, 2 * 2**-11, 1e-4), "bfloat16": (1.5 * 2**-8, 2 * 2**-8, 1e-4)}


@pytest.fixture(scope="module")
def emulator(emulation, tmp_path_factory):
    exe = tmp_path_factory.mktemp("emulate") / "emulate"
    p = compile_cxx(emulation[0], HERE / "emulate.cpp", exe, "-O1")
    assert p.returncode == 0, p.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return dict(line.rsplit(" ", 1) for line in run.stdout.splitlines())


def test_every_case_ran(emulator):
    cases = {k.rsplit(".", 1)[0] for k in emulator}
    assert len(cases) == 14 and len(emulator) == 42


@pytest.mark.parametrize("kind,index", [("forward", 0), ("dx", 1), ("dweight_dbias", 2)])
def test_kernels_match_the_reference(emulator, kind, index):
    for key, err in emulator.items():
        if key.endswith("." + kind):
            bar = BARS[key.split(".")[0]][index]
            assert float(err) <= bar, (key, err)


DIVERGENT = r"""
#include "emulate.h"
static void kernel(int *)
{
    if (threadIdx.x < 32)   // a barrier that half the block never reaches
        __syncthreads();
}
int main() { launch(1, 64, kernel, (int *)nullptr); }
"""


def test_threads_waiting_at_different_barriers_stop_the_launch(emulation, tmp_path):
    (tmp_path / "divergent.cpp").write_text(DIVERGENT)
    p = compile_cxx(emulation[0], tmp_path / "divergent.cpp", tmp_path / "divergent")
    assert p.returncode == 0, p.stderr
    run = subprocess.run([str(tmp_path / "divergent")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 4
    assert "threads wait at different barriers" in run.stderr
