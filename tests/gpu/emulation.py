"""Building tests/gpu/emulate.h, the CUDA kernels' CPU emulation."""
import os
import pathlib
import shutil
import subprocess

HERE = pathlib.Path(__file__).parent
SRC = HERE.parents[1] / "src" / "lnfast"

# One launch of 64 threads through a block barrier and a warp shuffle.
PROBE = r"""
#include "emulate.h"
static void kernel(double *out)
{
    double v = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, v, 1);
}
extern "C" int probe()
{
    std::vector<double> out(64);
    launch(1, 64, kernel, out.data());
    return out[0] == 1.0 && out[63] == 62.0;
}
int main() { return !probe(); }
"""


def find_cxx():
    """The C++ compiler: $CXX, else g++, else clang++; None if none is found."""
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("clang++")


def compile_cxx(cxx, source, out, *flags):
    return subprocess.run([cxx, "-std=c++17", *flags, f"-I{HERE}", f"-I{SRC}",
                           f"-I{SRC / 'kernels'}", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
