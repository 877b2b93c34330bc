"""The CUDA sources compile with nvcc for sm_80 and sm_90, every kernel
instantiation the GPU path uses included.  Runs wherever nvcc is on PATH,
with or without a GPU."""
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


def test_every_dtype_has_instantiations():
    names = _gpu.name_expressions()
    for t in ("float", "double", "__half", "__nv_bfloat16"):
        for kernel in ("norm_forward", "norm_backward_partial"):
            assert any(n.startswith(f"lnf::{kernel}<{t},") for n in names)
