"""Build the lnfast extension modules.

Environment switches:
  LNFAST_OPENMP = auto (default) | 0 | required
      auto: use OpenMP when a test program compiles and links, else build
      serially with a warning; 0: never; required: fail without OpenMP.
  LNFAST_NATIVE = 1
      opt in to -march=native (LNFAST_NATIVE only: wheels must run on any CPU).
"""
import glob
import os
import sys
import tempfile
import textwrap
import warnings

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP_PROBE = textwrap.dedent(
    """
    #include <omp.h>
    int main(void) {
        int n = 0;
        #pragma omp parallel reduction(+:n)
        n += 1;
        return n > 0 && omp_get_max_threads() > 0 ? 0 : 1;
    }
    """
)


def openmp_flags(compiler_type):
    """(compile_args, link_args) that enable OpenMP for this compiler."""
    if compiler_type == "msvc":
        return ["/openmp"], []
    if sys.platform == "darwin":
        # Apple clang: libomp from llvm-openmp (Homebrew or conda), bundled by delocate.
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    return ["-fopenmp"], ["-fopenmp"]


def probe_openmp(compiler, cflags, ldflags):
    """True when a small OpenMP program compiles and links with `compiler`."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe_openmp.c")
        with open(src, "w") as f:
            f.write(OPENMP_PROBE)
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=cflags)
            compiler.link_executable(
                objs, "probe_openmp", output_dir=tmp, extra_postargs=ldflags
            )
        except Exception:  # any compile or link error means "no OpenMP"
            return False
    return True


class BuildExt(build_ext):
    def build_extensions(self):
        mode = os.environ.get("LNFAST_OPENMP", "auto").strip().lower()
        if mode not in ("auto", "0", "required"):
            raise SystemExit(f"LNFAST_OPENMP must be auto, 0 or required, got {mode!r}")
        ctype = self.compiler.compiler_type
        cflags, ldflags = openmp_flags(ctype)
        use_omp = mode != "0" and probe_openmp(self.compiler, cflags, ldflags)
        if mode == "required" and not use_omp:
            raise SystemExit("LNFAST_OPENMP=required but no working OpenMP was found")
        if mode == "auto" and not use_omp:
            warnings.warn("lnfast: OpenMP not found, building serial kernels")
        print(f"lnfast: OpenMP {'on' if use_omp else 'off'} (LNFAST_OPENMP={mode})")

        if ctype == "msvc":
            opt = ["/O2", "/fp:precise"]
        else:
            # -ffp-contract=off: no FMA contraction, so every build and CPU
            # rounds the same way (bitwise reproducibility).
            opt = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi"]
            if os.environ.get("LNFAST_NATIVE", "0") == "1":
                opt.append("-march=native")  # opt-in via LNFAST_NATIVE=1 only
        for ext in self.extensions:
            ext.extra_compile_args = opt + (cflags if use_omp else [])
            ext.extra_link_args = ldflags if use_omp else []
        super().build_extensions()


extensions = [
    Extension(
        "lnfast._cpu",
        ["src/lnfast/_cpu.pyx"],
        include_dirs=[numpy.get_include()],
        # the C kernels: an edit to one rebuilds the module
        depends=glob.glob("src/lnfast/*.h"),
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        include_path=["src"],
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
    cmdclass={"build_ext": BuildExt},
)
