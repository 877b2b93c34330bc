# Type stub for the compiled CPU kernels (src/lnfast/_cpu.pyx).
from typing import TypedDict

import numpy as np

class _BuildInfo(TypedDict):
    compiler: str
    openmp: bool
    simd: str

def build_info() -> _BuildInfo: ...
def omp_max_threads() -> int: ...
def layer_norm_forward(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, b: np.ndarray,
    mean: np.ndarray | None, rstd: np.ndarray | None, eps: float, nthreads: int,
) -> None: ...
def layer_norm_backward(
    dy: np.ndarray, x: np.ndarray, mean: np.ndarray, rstd: np.ndarray,
    w: np.ndarray, dx: np.ndarray, nchunks: int, nthreads: int,
) -> np.ndarray: ...
def parallel_copy(src: np.ndarray, dst: np.ndarray, nthreads: int) -> None: ...
