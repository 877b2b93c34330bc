"""The GPU path end to end where no GPU is: tests/gpu/test_gpu.py and
`python -m lnfast bench --gpu` run in a subprocess with tests/gpu/fake_cupy
standing in for CuPy.  lnfast._gpu then builds norm.cu as it would with
CuPy, for the CPU (emulate.h), and launches its kernels with arguments
checked against their parameters.  This tests the launcher, the dispatch
and the GPU tests themselves; not the GPU's compiler, lockstep warps,
memory model or speed."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from tests.gpu.emulation import HERE

# Bit-for-bit repetition is a property of the GPU's scheduling, which the
# emulation runs in one fixed order; at 4096x1024 it would also take half a
# minute here.  The emulation has one device.
DESELECT = ("tests/gpu/test_gpu.py::test_results_repeat_bit_for_bit",
            "tests/gpu/test_gpu.py::test_arrays_on_a_second_device")


@pytest.fixture(scope="module")
def env(emulation):
    if not emulation[1]:
        pytest.skip("this interpreter cannot load the C++ compiler's shared libraries")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE / "fake_cupy"), os.environ.get("PYTHONPATH")) if p)
    return env


def run(env, *args, timeout=600):
    return subprocess.run([sys.executable, *args], env=env, cwd=HERE.parents[1],
                          capture_output=True, text=True, timeout=timeout)


def test_gpu_tests_pass_on_the_emulation(env):
    # (Dask is optional, lnfast[dask]: its test runs where it is installed)
    no_dask = ["-k", "not dask"] if importlib.util.find_spec("dask") is None else []
    p = run(env, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
            "tests/gpu/test_gpu.py", "tests/gpu/emulated_launch_checks.py", *no_dask,
            *(arg for test in DESELECT for arg in ("--deselect", test)))
    summary = p.stdout.strip().splitlines()[-1]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1))
    assert passed >= 60 and "skipped" not in summary, summary


def test_gpu_benchmark_runs_on_the_emulation(env, tmp_path):
    out = tmp_path / "gpu.json"
    p = run(env, "-m", "lnfast", "bench", "--gpu", "--shapes", "8x64", "--repeat", "1",
            "--dtypes", "float32", "bfloat16", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "CPU emulation" in p.stdout
    rows = json.loads(out.read_text())["results"]
    assert [(r["function"], r["dtype"]) for r in rows] == [
        ("layer_norm forward", "float32"), ("layer_norm backward", "float32"),
        ("layer_norm forward", "bfloat16"), ("layer_norm backward", "bfloat16")]
    assert all(r["ms"] > 0 and r["copy_gbs"] > 0 for r in rows)
