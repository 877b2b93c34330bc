"""The C API (src/lnfast/cpu/lnfast_cpu.h) used without Python: a C program
(tests/c_api/api_check.c) built from the kernel sources alone runs LayerNorm
with a residual and RMSNorm, forward and backward, on every instruction set
of this CPU, and its outputs are the Python functions' bytes; another
(tests/c_api/fpenv_check.c) holds the kernels' bits with flush-to-zero set
by the caller; tests/c_api/tile_pairs_check.c holds the forward's tiles taken
two at once to those taken one at a time; tests/c_api/bad_args_check.c passes
arguments that do not fit. All four run under ASan and UBSan where the
compiler has them."""
import concurrent.futures
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


SANITIZE = ("-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined")


def compiles(cc, flags, tmp):
    """Whether CC compiles and links a program with FLAGS."""
    (tmp / "probe.c").write_text("int main(void) { return 0; }\n")
    p = subprocess.run([cc, *flags, str(tmp / "probe.c"), "-o", str(tmp / "probe")],
                       capture_output=True, timeout=600)
    return p.returncode == 0


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The kernel sources compiled once, in parallel, for every check below:
    with ASan and UBSan where the compiler takes them (always where
    LNFAST_TEST_SANITIZERS=required, as in CI), and with OpenMP where it
    takes it. A sanitized build of the kernels takes minutes: one build
    serves the four programs."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    tmp = tmp_path_factory.mktemp("kernels")
    tries = [[*SANITIZE, "-fopenmp"], list(SANITIZE)]
    if os.environ.get("LNFAST_TEST_SANITIZERS") != "required":
        tries += [["-fopenmp"], []]
    flags = next((f for f in tries if compiles(cc, f, tmp)), None)
    if flags is None:
        pytest.fail(f"{cc} builds no program with any of {tries}")
    flags = [cc, "-O2", "-ffp-contract=off", "-fno-math-errno", f"-I{CPU}", *flags]

    def compile_one(source):
        obj = tmp / (source.stem + ".o")
        p = subprocess.run([*flags, "-c", str(source), "-o", str(obj)],
                           capture_output=True, text=True, timeout=1200)
        assert p.returncode == 0, f"{source.name} does not build:\n{p.stderr[-3000:]}"
        return str(obj)

    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with concurrent.futures.ThreadPoolExecutor(jobs or 1) as pool:
        # (rows_* first: they take the longest, and the last to start
        # should be short)
        objects = list(pool.map(compile_one, sorted(CPU.glob("*.c"), reverse=True)))
    return flags, objects, tmp


def run(kernels, name, *args):
    """Build tests/c_api/NAME.c against the kernels, run it with ARGS, and
    expect exit status 0."""
    flags, objects, tmp = kernels
    exe = tmp / name
    p = subprocess.run([*flags, str(ROOT / "tests" / "c_api" / f"{name}.c"), *objects, "-lm",
                        "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{name}.c does not build:\n{p.stderr[-3000:]}"
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    p = subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr


@pytest.fixture(scope="module")
def outputs(kernels):
    out = kernels[2] / "out.bin"
    run(kernels, "api_check", str(out))     # every instruction set: the same bytes
    return out.read_bytes()


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


def test_flush_to_zero_on_the_calling_threads_changes_no_bit(kernels):
    # XLA and torch.set_flush_denormal turn flush-to-zero on; the kernels
    # compute in the default environment and give the caller back its own.
    run(kernels, "fpenv_check")


def test_arguments_that_do_not_fit_are_refused_before_use(kernels):
    # NULL blocks, negative lengths, misaligned outputs, huge D and thread
    # counts: LNF_EINVAL or a clamp, never a crash
    run(kernels, "bad_args_check")


def test_tiles_two_at_once_give_the_bits_of_one_at_a_time(kernels):
    # channels-first rows: forward outputs in x's layout pair full tiles,
    # outputs channels-last take every tile alone
    run(kernels, "tile_pairs_check")
