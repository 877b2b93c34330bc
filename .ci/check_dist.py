"""Check what the wheel and the sdist in DIR contain (issue: packaging)."""
import pathlib
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
assert any(n.startswith("lnfast/_cpu.") and n.endswith((".so", ".pyd")) for n in names), "no compiled module"
for required in ("lnfast/py.typed", "lnfast/_cpu.pyi", "lnfast/__init__.py",
                 "lnfast/kernels/norm.cu"):
    assert required in names, f"wheel lacks {required}"
for n in names:
    assert not n.endswith((".pyx", ".pxd", ".c", ".h")), f"wheel carries a source file: {n}"

members = [m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m]
print(f"{sdist.name}: {len(members)} files")
for required in ("src/lnfast/_cpu.pyx", "src/lnfast/_openmp_helpers.pxd",
                 "src/lnfast/rowops.h", "src/lnfast/rowops_all.h", "src/lnfast/pool.h",
                 "src/lnfast/halfconv.h", "src/lnfast/kernels/norm.cu",
                 "setup.py", "pyproject.toml", "tests/test_layer_norm.py",
                 "tests/gpu/emulate.h", "tests/gpu/fake_cupy/cupy/__init__.py"):
    assert required in members, f"sdist lacks {required}"
for m in members:
    assert not m.endswith((".so", ".pyd")) and not (m.startswith("src/") and m.endswith(".c")), \
        f"sdist carries a build product: {m}"
print("wheel and sdist contents OK")
