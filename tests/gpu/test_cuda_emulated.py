"""The CUDA kernels run on the CPU (tests/gpu/emulate.cpp: one std::thread per
CUDA thread, barriers for __syncthreads and warp shuffles) against a float64
reference: float, double, float16 and bfloat16; 16-byte packs and strided
rows; residual, RMSNorm, one-element and long rows; fewer blocks than rows.
This checks the kernels' logic where no GPU is at hand, not their speed."""
import pathlib
import shutil
import subprocess

import pytest

HERE = pathlib.Path(__file__).parent
SRC = HERE.parents[1] / "src" / "lnfast"
CXX = shutil.which("g++") or shutil.which("clang++")

PROBE = "#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n"

# relative error bars per element type: forward, dx, dweight/dbias
BARS = {"float": (2e-6, 2e-5, 2e-5), "double": (1e-12, 1e-10, 1e-10),
        "half": (1.5 * 2**-11, 2 * 2**-11, 1e-4), "bfloat16": (1.5 * 2**-8, 2 * 2**-8, 1e-4)}


def _compile(tmp_path, source, out):
    return subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", f"-I{SRC}",
                           f"-I{SRC / 'kernels'}", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("emulate")
    if CXX is None:
        pytest.skip("no C++ compiler")
    probe = tmp / "probe.cpp"
    probe.write_text(PROBE)
    if _compile(tmp, probe, tmp / "probe").returncode != 0:
        pytest.skip("the C++ compiler lacks C++20 std::barrier")
    p = _compile(tmp, HERE / "emulate.cpp", tmp / "emulate")
    assert p.returncode == 0, p.stderr
    run = subprocess.run([str(tmp / "emulate")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    return dict(line.rsplit(" ", 1) for line in run.stdout.splitlines())


def test_every_case_ran(emulator):
    cases = {k.rsplit(".", 1)[0] for k in emulator}
    assert len(cases) == 10 and len(emulator) == 30


@pytest.mark.parametrize("kind,index", [("forward", 0), ("dx", 1), ("dweight_dbias", 2)])
def test_kernels_match_the_reference(emulator, kind, index):
    for key, err in emulator.items():
        if key.endswith("." + kind):
            bar = BARS[key.split(".")[0]][index]
            assert float(err) <= bar, (key, err)
