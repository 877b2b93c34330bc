"""Build the lnfast extension modules.

Environment switches:
  LNFAST_OPENMP = auto (default) | 0 | required
      auto: use OpenMP when a test program compiles and links, else build
      serially with a warning; 0: never; required: fail without OpenMP.
  LNFAST_NATIVE = 1
      opt in to -march=native (LNFAST_NATIVE only: wheels must run on any CPU).
  LNFAST_SANITIZE = address,undefined (or any -fsanitize= list; gcc and clang)
      a debugging build: -fsanitize=LIST -fno-sanitize-recover=all
      -fno-omit-frame-pointer -g on the compile, -fsanitize=LIST on the link,
      of both the extension and the OpenMP probe, so OpenMP stays on. Python
      itself is not sanitized: run it with the sanitizer's runtime preloaded,
      e.g. LD_PRELOAD=$(gcc -print-file-name=libasan.so) (see .ci/run).

The OpenMP probe links its test program with CFLAGS, CPPFLAGS and LDFLAGS from
the environment, as the extension itself is linked (distutils links
executables without them), so flags such as CFLAGS=-fsanitize=... that need
the same flag on the link do not turn OpenMP off.
"""
import concurrent.futures
import glob
import os
import re
import shlex
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


def sanitize_flags(compiler_type):
    """(compile_args, link_args) for LNFAST_SANITIZE; ([], []) when unset."""
    value = os.environ.get("LNFAST_SANITIZE", "").strip().lower()
    if value in ("", "0"):
        return [], []
    names = [n.strip() for n in value.split(",")]
    if not all(re.fullmatch(r"[a-z][a-z0-9-]*", n) for n in names):
        raise SystemExit(f"LNFAST_SANITIZE must be a list like address,undefined, got {value!r}")
    if compiler_type == "msvc":
        raise SystemExit("LNFAST_SANITIZE needs gcc or clang")
    flag = "-fsanitize=" + ",".join(names)
    # -fno-sanitize-recover=all: an UndefinedBehaviorSanitizer report aborts
    # the process (it only prints and goes on by default), so tests fail.
    return [flag, "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"], [flag]


def environment_link_flags(compiler_type):
    """The environment's flags that distutils adds to the extension's link
    (CFLAGS, CPPFLAGS, LDFLAGS) but not to link_executable's."""
    if compiler_type == "msvc":
        return []
    return [a for v in ("LDFLAGS", "CFLAGS", "CPPFLAGS") for a in shlex.split(os.environ.get(v, ""))]


def probe_openmp(compiler, cflags, ldflags):
    """True when a small OpenMP program compiles and links with `compiler`."""
    ldflags = environment_link_flags(compiler.compiler_type) + ldflags
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


def compile_in_parallel(compiler):
    """Make `compiler` compile an extension's sources as many at a time as
    this process has CPUs: the kernels are many units of one extension,
    which setuptools would compile one after another."""
    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if compiler.compiler_type != "unix" or not jobs or jobs < 2:
        return
    one_by_one = compiler.compile

    def compile(sources, output_dir=None, **kwargs):
        # (the object folders first: distutils' mkpath is not safe to race)
        for obj in compiler.object_filenames(sources, output_dir=output_dir or ""):
            os.makedirs(os.path.dirname(obj) or ".", exist_ok=True)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            parts = pool.map(lambda s: one_by_one([s], output_dir=output_dir, **kwargs), sources)
            return [obj for part in parts for obj in part]

    compiler.compile = compile


class BuildExt(build_ext):
    def build_extensions(self):
        mode = os.environ.get("LNFAST_OPENMP", "auto").strip().lower()
        if mode not in ("auto", "0", "required"):
            raise SystemExit(f"LNFAST_OPENMP must be auto, 0 or required, got {mode!r}")
        ctype = self.compiler.compiler_type
        cflags, ldflags = openmp_flags(ctype)
        san_cflags, san_ldflags = sanitize_flags(ctype)
        use_omp = mode != "0" and probe_openmp(
            self.compiler, san_cflags + cflags, san_ldflags + ldflags
        )
        if mode == "required" and not use_omp:
            raise SystemExit("LNFAST_OPENMP=required but no working OpenMP was found")
        if mode == "auto" and not use_omp:
            warnings.warn("lnfast: OpenMP not found, building serial kernels")
        print(f"lnfast: OpenMP {'on' if use_omp else 'off'} (LNFAST_OPENMP={mode})")
        if san_cflags:
            print(f"lnfast: sanitized build ({san_ldflags[0]})")

        if ctype == "msvc":
            opt = ["/O2", "/fp:precise"]
        else:
            # -ffp-contract=off: no FMA contraction, so every build and CPU
            # rounds the same way (bitwise reproducibility).
            opt = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi"]
            if os.environ.get("LNFAST_NATIVE", "0") == "1":
                opt.append("-march=native")  # opt-in via LNFAST_NATIVE=1 only
        for ext in self.extensions:
            ext.extra_compile_args = opt + san_cflags + (cflags if use_omp else [])
            ext.extra_link_args = san_ldflags + (ldflags if use_omp else [])
        compile_in_parallel(self.compiler)
        super().build_extensions()


NUMPY_API = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
extensions = [
    # The kernels: the C library (src/lnfast/cpu, its units each compiled
    # on their own) under its Cython face.
    Extension(
        "lnfast._cpu",
        ["src/lnfast/_cpu.pyx"] + sorted(glob.glob("src/lnfast/cpu/*.c")),
        include_dirs=["src/lnfast", numpy.get_include()],
        depends=sorted(glob.glob("src/lnfast/cpu/*.h")),   # (an edit rebuilds the module)
        define_macros=NUMPY_API,
    ),
    # The CPU backend: a call's checks, outputs and kernel arguments.
    Extension(
        "lnfast._kernels",
        ["src/lnfast/_kernels.pyx"],
        include_dirs=["src/lnfast", numpy.get_include()],
        depends=["src/lnfast/_cpu.pxd", "src/lnfast/cpu/lnfast_cpu.h"],
        define_macros=NUMPY_API,
    ),
    # The backend for the arrays' kind.
    Extension("lnfast._dispatch", ["src/lnfast/_dispatch.pyx"],
              include_dirs=[numpy.get_include()], define_macros=NUMPY_API),
    # The output buffer cache.
    Extension(
        "lnfast._pool",
        ["src/lnfast/_pool.pyx"],
        include_dirs=["src/lnfast", numpy.get_include()],
        depends=["src/lnfast/_pool.h"],
        define_macros=NUMPY_API,
    ),
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
