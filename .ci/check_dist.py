"""Check what the wheel and the sdist in DIR contain (issue: packaging)."""
import pathlib
import re
import sys
import tarfile
import zipfile

dist = pathlib.Path(sys.argv[1])
(wheel,) = dist.glob("lnfast-*.whl")
(sdist,) = dist.glob("lnfast-*.tar.gz")

names = zipfile.ZipFile(wheel).namelist()
print(f"{wheel.name}:")
for n in names:
    print("   ", n)
for module in ("_cpu", "_pool"):
    assert any(n.startswith(f"lnfast/{module}.") and n.endswith((".so", ".pyd")) for n in names), \
        f"no compiled module {module}"
for required in ("lnfast/py.typed", "lnfast/_cpu.pyi", "lnfast/__init__.py",
                 "lnfast/kernels/norm.cu", "lnfast/jax_ffi/lnfast_ffi.cc",
                 "lnfast/torch_ext/lnfast_torch.cc"):
    assert required in names, f"wheel lacks {required}"
# (the C API's headers, which lnfast.jax's and lnfast.torch's C++ are compiled against)
public_headers = {"lnfast/cpu/lnfast_cpu.h", "lnfast/cpu/config.h"}
assert public_headers <= set(names), f"wheel lacks {public_headers - set(names)}"
for n in names:
    assert n in public_headers or not n.endswith((".pyx", ".pxd", ".c", ".h")), \
        f"wheel carries a source file: {n}"

members = [m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m]
print(f"{sdist.name}: {len(members)} files")
for required in ("src/lnfast/_cpu.pyx", "src/lnfast/_pool.pyx", "src/lnfast/_pool.h",
                 "src/lnfast/cpu/lnfast_cpu.h", "src/lnfast/cpu/rowops.h",
                 "src/lnfast/cpu/forward.c", "src/lnfast/cpu/rows_f32_avx2.c",
                 "src/lnfast/cpu/halfconv.h", "src/lnfast/kernels/norm.cu",
                 "src/lnfast/jax_ffi/lnfast_ffi.cc", "src/lnfast/torch_ext/lnfast_torch.cc",
                 "setup.py", "pyproject.toml", "tests/test_layer_norm.py",
                 "tests/gpu/emulate.h", "tests/gpu/fake_cupy/cupy/__init__.py",
                 "docs/conf.py", "benchmarks/tile_floor.c",
                 "benchmarks/results/bench_2core.json"):
    assert required in members, f"sdist lacks {required}"
for m in members:
    assert not m.endswith((".so", ".pyd")) and not re.fullmatch(r"src/lnfast/_\w+\.c", m), \
        f"sdist carries a build product: {m}"
print("wheel and sdist contents OK")
