"""SPEC "Introspection and command line"."""
import json
import os
import subprocess
import sys

import pytest

import lnfast


def run(*args):
    return subprocess.run([sys.executable, "-m", "lnfast", *args],
                          capture_output=True, text=True, timeout=300)


def test_show_config(capsys):
    lnfast.show_config()
    text = capsys.readouterr().out
    for key in ("version", "compiler", "openmp", "simd", "threads", "gpu"):
        assert key in text
    assert lnfast.__version__ in text


def test_check_passes():
    p = run("check")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 failed" in p.stdout and "FAIL" not in p.stdout


def test_bench_prints_a_table_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    p = run("bench", "--quick", "--shapes", "64x256", "--dtypes", "float32",
            "--repeat", "3", "--rounds", "2", "--json", str(path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "layer_norm forward, float32" in p.stdout
    assert "layer_norm backward, float32" in p.stdout
    assert "numpy ms" in p.stdout
    data = json.loads(path.read_text())
    impls = {(r["function"], r["impl"]) for r in data["results"]}
    assert ("layer_norm forward", "numpy") in impls
    assert all(r["ms"] > 0 and r["gbs"] > 0 for r in data["results"])
    # the copy moving a kernel's bytes: that of x for a forward pass (2 arrays)
    assert "%same" in p.stdout
    for r in data["results"]:
        assert r["same_copy_gbs"] > 0
        if r["function"] == "layer_norm forward":
            assert r["same_copy_gbs"] == r["copy_gbs"]


def test_bench_runs_a_lesser_instruction_set(tmp_path):
    # --isa portable: the baseline sweeps, named in the header and the JSON
    path = tmp_path / "bench.json"
    p = run("bench", "--quick", "--no-numpy", "--shapes", "64x256", "--dtypes", "float32",
            "--functions", "layer_norm", "--repeat", "3", "--isa", "portable",
            "--json", str(path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "baseline sweeps" in p.stdout
    assert json.loads(path.read_text())["machine"]["sweeps"] == "baseline"
    p = run("bench", "--isa", "avx1024")
    assert p.returncode == 2 and "--isa" in p.stderr and "Traceback" not in p.stderr


def test_bench_peers_time_onnxruntime_and_xla(tmp_path):
    # --peers: onnxruntime's operators (forward only) and XLA's jitted
    # jax.numpy functions (forward and backward) beside lnfast, same run
    for name in ("onnx", "onnxruntime", "jax"):
        pytest.importorskip(name)
    path = tmp_path / "bench.json"
    p = run("bench", "--quick", "--no-numpy", "--peers", "--shapes", "64x256", "--dtypes",
            "float32", "float64", "--repeat", "3", "--json", str(path))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "onnxruntime ms" in p.stdout and "xla ms" in p.stdout
    data = json.loads(path.read_text())
    machine = data["machine"]
    assert machine["onnxruntime"] and machine["jax"] and machine["processor"]
    impls = {(r["function"], r["impl"], r["dtype"]) for r in data["results"]}
    for dtype in ("float32", "float64"):
        for f in ("layer_norm", "rms_norm"):
            assert (f"{f} forward", "onnxruntime", dtype) in impls
            assert (f"{f} forward", "xla", dtype) in impls
            assert (f"{f} backward", "xla", dtype) in impls
            assert (f"{f} backward", "onnxruntime", dtype) not in impls
        assert ("add_layer_norm backward", "xla", dtype) in impls
    # onnxruntime's fused add has no float64 kernel: left out, not an error
    assert ("add_layer_norm forward", "onnxruntime", "float32") in impls
    assert ("add_layer_norm forward", "onnxruntime", "float64") not in impls
    assert all(r["ms"] > 0 for r in data["results"])


def test_bench_rejects_a_bad_shape():
    # as argparse refuses a bad value: exit status 2 and the usage line, in every group
    for group in ([], ["--torch"], ["--jax"], ["--gpu"]):
        for shape in ("64by256", "0x5", "5x0", "-1x5"):
            p = run("bench", *group, f"--shapes={shape}")
            assert p.returncode == 2 and "Traceback" not in p.stderr, (group, shape)
            assert "usage:" in p.stderr and f"--shapes: expected MxD" in p.stderr


def test_version():
    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"lnfast {lnfast.__version__}"


def test_bench_rejects_bad_counts_and_paths_before_running(tmp_path):
    (tmp_path / "d.png").mkdir()
    for option, value in (("--threads", "0"), ("--threads", "2000"), ("--repeat", "0"),
                          ("--repeat", "-1"), ("--rounds", "0"),
                          ("--json", str(tmp_path / "no" / "x.json")),
                          ("--plot", str(tmp_path / "no" / "x.png")),
                          ("--json", str(tmp_path)), ("--plot", str(tmp_path / "d.png")),
                          ("--plot", str(tmp_path / "x.pdf"))):
        p = run("bench", option, value)
        assert p.returncode == 2 and option in p.stderr and "Traceback" not in p.stderr
    if os.path.isdir("/proc"):          # a folder that takes no new file
        p = run("bench", "--json", "/proc/lnfast.json")
        assert p.returncode == 2 and "cannot write '/proc/lnfast.json'" in p.stderr
    # without matplotlib, --plot is refused before the run
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['lnfast', 'bench', '--plot', {str(tmp_path / 'p.png')!r}]; "
            "runpy.run_module('lnfast', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--plot needs matplotlib" in p.stderr
    assert not (tmp_path / "p.png").exists()


def test_bench_refuses_options_its_group_would_ignore():
    # each before any timing: exit status 2, the option named, no traceback
    for args, option in ((["--axes", "--torch"], "--axes, --torch"),
                         (["--axes", "--shapes", "64x64"], "--shapes"),
                         (["--dask", "--shapes", "64x64"], "--shapes"),
                         (["--torch", "--plot", "x.png"], "--plot"),
                         (["--jax", "--peers"], "--peers"),
                         (["--dask", "--dask-gib", "-1"], "--dask-gib"),
                         (["--dask", "--dask-gib", "nan"], "--dask-gib"),
                         (["--dask-gib", "1"], "--dask-gib needs --dask"),
                         (["--dask", "--dask-cluster", "2"], "--dask-cluster needs"),
                         (["--torch", "--functions", "rms_norm"], "--functions"),
                         (["--gpu", "--isa", "portable"], "--isa"),
                         (["--gpu", "--threads", "1"], "--threads"),
                         (["--axes", "--no-numpy"], "--no-numpy"),
                         (["--dask", "--rounds", "2"], "--rounds"),
                         (["--jax", "--dtypes", "float64"], "--dtypes"),
                         (["--torch", "--dtypes", "float32", "float16"], "float16"),
                         (["--axes", "--dtypes", "float64"], "--dtypes"),
                         (["--dask", "--dtypes", "bfloat16"], "--dtypes")):
        p = run("bench", *args)
        assert p.returncode == 2 and option in p.stderr and "Traceback" not in p.stderr, args


def test_a_bad_thread_count_variable_is_reported_not_a_traceback():
    env = {**os.environ, "LNFAST_NUM_THREADS": "abc"}
    for command, status in (("config", 0), ("check", 2), ("bench", 2)):
        p = subprocess.run([sys.executable, "-m", "lnfast", command], capture_output=True,
                           text=True, timeout=300, env=env)
        assert p.returncode == status and "Traceback" not in p.stderr
        assert "LNFAST_NUM_THREADS" in p.stdout + p.stderr
    # bench --threads sets the count, so the variable is not read
    p = subprocess.run([sys.executable, "-m", "lnfast", "bench", "--threads", "1", "--quick",
                        "--no-numpy", "--shapes", "64x64", "--dtypes", "float32"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0 and "64x64" in p.stdout, p.stderr


def test_check_refuses_a_negative_seed():
    p = run("check", "--seed", "-1")
    assert p.returncode == 2 and "--seed" in p.stderr and "Traceback" not in p.stderr


def test_bench_says_when_shapes_do_not_fit_in_memory():
    p = run("bench", "--shapes", "1000000x1000000", "--dtypes", "float32", "--no-numpy")
    assert p.returncode == 1 and "not enough memory" in p.stderr and "Traceback" not in p.stderr
    # past any address space: refused as argparse refuses a bad value
    p = run("bench", "--shapes", "99999999999x99999999999", "--no-numpy")
    assert p.returncode == 2 and "Traceback" not in p.stderr and "usage:" in p.stderr
    assert "more elements than a process can address" in p.stderr


def test_a_bad_cache_limit_names_the_variable():
    for value in ("-1", "abc", str(2**64)):
        p = subprocess.run([sys.executable, "-c", "import lnfast"], capture_output=True,
                           text=True, timeout=120,
                           env={**os.environ, "LNFAST_CACHE_BYTES": value})
        assert p.returncode != 0 and "ValueError: LNFAST_CACHE_BYTES" in p.stderr
    # set but empty, as containers and CI often leave a variable: the default
    p = subprocess.run([sys.executable, "-c", "import lnfast; lnfast.show_config()"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "LNFAST_CACHE_BYTES": ""})
    assert p.returncode == 0 and "1024 MiB" in p.stdout, p.stdout + p.stderr


def test_bench_gpu_explains_what_it_needs():
    # Without CuPy or a device, a clear message and a non-zero exit status.
    p = subprocess.run([sys.executable, "-c",
                        "import sys; sys.modules['cupy'] = None\n"
                        "from lnfast.__main__ import main; sys.exit(main(['bench', '--gpu']))"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "bench --gpu needs CuPy" in p.stderr
