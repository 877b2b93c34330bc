"""The CUDA sources compile, every kernel instantiation the GPU path uses
included, with or without a GPU: with nvcc for sm_80 and sm_90 wherever nvcc
is on PATH, and with NVRTC (what CuPy's RawModule compiles with) wherever
CuPy and an NVRTC library are installed."""
import shutil
import subprocess

import pytest

from lnfast import _gpu

NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernels_compile(tmp_path, arch):
    path, _ = _gpu.source()
    lines = [f'#include "{path}"', "void lnf_instantiate_all() {"]
    lines += [f"    (void)&{name};" for name in _gpu.name_expressions()]
    lines.append("}")
    unit = tmp_path / "instantiate.cu"
    unit.write_text("\n".join(lines) + "\n")
    p = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-c", str(unit),
                        "-o", str(tmp_path / "instantiate.o")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr


def _nvrtc_program():
    """CuPy's NVRTC program class and the CUDA headers' folder, or skip."""
    cupy = pytest.importorskip("cupy")
    if cupy.__version__.endswith("emulated"):
        pytest.skip("the CuPy stand-in of tests/gpu/fake_cupy has no NVRTC")
    from cupy.cuda import compiler
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        headers = find_nvidia_header_directory("cudart")
        compiler._get_nvrtc_version()
    except Exception as e:      # no cuda-pathfinder, headers or libnvrtc
        pytest.skip(f"NVRTC is not usable here: {type(e).__name__}: {e}")
    if headers is None:
        pytest.skip("no CUDA headers found (cuda_fp16.h)")
    program = getattr(compiler, "_NVRTCProgram", None)
    if program is None:
        pytest.skip("this CuPy has no _NVRTCProgram")
    return program, headers


@pytest.mark.parametrize("arch", ["80", "90"])
def test_kernels_compile_with_nvrtc(arch):
    # RawModule's compilation without a device: lnfast's options and those
    # CuPy adds (cupy.cuda.compiler), then every name expression looked up.
    program, headers = _nvrtc_program()
    names = _gpu.name_expressions()
    prog = program(_gpu.code(), "norm.cu", (), (), name_expressions=names, method="cubin")
    cubin, mangled = prog.compile(_gpu.OPTIONS + (
        f"-I{headers}", "-ftz=true", f"-arch=sm_{arch}", "--device-as-default-execution-space"))
    assert len(cubin) > 0
    assert sorted(mangled) == sorted(names) and all(mangled.values())


def test_every_dtype_has_instantiations():
    names = _gpu.name_expressions()
    for t in ("float", "double", "__half", "__nv_bfloat16"):
        for kernel in ("norm_forward", "norm_backward_partial"):
            assert any(n.startswith(f"lnf::{kernel}<{t},") for n in names)
