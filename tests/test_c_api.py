"""The C API (src/lnfast/cpu/lnfast_cpu.h) used without Python: a C program
(tests/c_api/api_check.c) built from the kernel sources alone runs LayerNorm
with a residual and RMSNorm, forward and backward, on every instruction set
of this CPU, and its outputs are the Python functions' bytes; another
(tests/c_api/fpenv_check.c) holds the kernels' bits with flush-to-zero set
by the caller; tests/c_api/tile_pairs_check.c holds the forward's tiles taken
two at once to those taken one at a time."""
import os
import pathlib
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

import lnfast

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU = ROOT / "src" / "lnfast" / "cpu"
M, D = 37, 333
DTYPES = (np.float32, np.float64, np.float16, ml_dtypes.bfloat16)

pytestmark = pytest.mark.skipif(not CPU.is_dir(), reason="needs the source tree")


def build(tmp, name="api_check", first=()):
    """tests/c_api/NAME.c with the kernel sources, with the flags `first`
    and OpenMP where the compiler takes them (`first` always where
    LNFAST_TEST_SANITIZERS=required)."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    sources = [str(ROOT / "tests" / "c_api" / f"{name}.c"), *map(str, sorted(CPU.glob("*.c")))]
    base = [cc, "-O2", "-ffp-contract=off", "-fno-math-errno", f"-I{CPU}", *sources, "-lm",
            "-o", str(tmp / name)]
    tries = [[*first, "-fopenmp"], ["-fopenmp"], []] if first else [["-fopenmp"], []]
    if first and os.environ.get("LNFAST_TEST_SANITIZERS") == "required":    # (CI)
        tries = [[*first, "-fopenmp"], list(first)]
    for flags in tries:
        p = subprocess.run(base + flags, capture_output=True, text=True, timeout=600)
        if p.returncode == 0:
            return tmp / name
    pytest.fail(f"the C API does not build:\n{p.stderr[-3000:]}")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("c_api")
    exe = build(tmp)
    p = subprocess.run([str(exe), str(tmp / "out.bin")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr     # every instruction set: the same bytes
    return (tmp / "out.bin").read_bytes()


def read(data, pos, dtype, shape):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(data[pos:pos + n], dtype).reshape(shape), pos + n


def test_the_c_api_gives_the_python_functions_bytes(outputs):
    pos = 0
    for dt in DTYPES:
        ct = np.float64 if dt is np.float64 else np.float32
        x, pos = read(outputs, pos, dt, (M, D))
        r, pos = read(outputs, pos, dt, (M, D))
        w, pos = read(outputs, pos, ct, (D,))
        b, pos = read(outputs, pos, ct, (D,))
        got = []
        for shape, t in (((M, D), dt), ((M, D), dt), ((M,), ct), ((M,), ct), ((M, D), dt),
                         ((2, D), ct), ((M, D), dt), ((M,), ct), ((M, D), dt), ((2, D), ct)):
            a, pos = read(outputs, pos, t, shape)
            got.append(a)
        y, z, mean, rstd = lnfast.add_layer_norm_forward(x, r, w, b, eps=1e-5)
        dx, dw, db = lnfast.add_layer_norm_backward(r, z, mean, rstd, w, dz=x)
        ry, rr = lnfast.rms_norm_forward(x, w, eps=1e-5)
        rdx, rdw = lnfast.rms_norm_backward(r, x, rr, w)
        want = [y, z, mean, rstd, dx, np.stack([dw, db]), ry, rr, rdx,
                np.stack([rdw, np.zeros_like(rdw)])]
        for i, (g, e) in enumerate(zip(got, want)):
            assert g.tobytes() == np.ascontiguousarray(e).tobytes(), (np.dtype(dt).name, i)
    assert pos == len(outputs)


def test_flush_to_zero_on_the_calling_threads_changes_no_bit(tmp_path):
    # XLA and torch.set_flush_denormal turn flush-to-zero on; the kernels
    # compute in the default environment and give the caller back its own.
    exe = build(tmp_path, "fpenv_check")
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr


def run_sanitized(tmp, name):
    """Build tests/c_api/NAME.c with ASan and UBSan where the compiler takes
    them, run it, and expect exit status 0."""
    exe = build(tmp, name,
                ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"])
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr


def test_arguments_that_do_not_fit_are_refused_before_use(tmp_path):
    # NULL blocks, negative lengths, misaligned outputs, huge D and thread
    # counts: LNF_EINVAL or a clamp, never a crash
    run_sanitized(tmp_path, "bad_args_check")


def test_tiles_two_at_once_give_the_bits_of_one_at_a_time(tmp_path):
    # channels-first rows: forward outputs in x's layout pair full tiles,
    # outputs channels-last take every tile alone
    run_sanitized(tmp_path, "tile_pairs_check")
