# Type stub for the compiled CPU kernels (src/lnfast/_cpu.pyx).
from typing import TypedDict

import numpy as np
from numpy.typing import DTypeLike

class _BuildInfo(TypedDict):
    compiler: str
    openmp: bool
    simd: str

def build_info() -> _BuildInfo: ...
def omp_max_threads() -> int: ...
def empty(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray: ...
def cache_info() -> tuple[int, int, int]: ...
def set_cache_limit(limit: int) -> None: ...
def forward(
    x: np.ndarray, residual: np.ndarray | None, z: np.ndarray | None, y: np.ndarray,
    w: np.ndarray, b: np.ndarray, mean: np.ndarray | None, rstd: np.ndarray | None,
    eps: float, centered: bool, nthreads: int,
) -> None: ...
def backward(
    dy: np.ndarray, x: np.ndarray, dz: np.ndarray | None, mean: np.ndarray | None,
    rstd: np.ndarray, w: np.ndarray, dx: np.ndarray, nchunks: int, centered: bool,
    nthreads: int,
) -> np.ndarray: ...
def parallel_copy(src: np.ndarray, dst: np.ndarray, nthreads: int) -> None: ...
