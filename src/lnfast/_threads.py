"""Thread count for the CPU kernels, resolved in one place.

Order: lnfast.set_num_threads(n), else the LNFAST_NUM_THREADS environment
variable, else OpenMP's current default (which threadpoolctl can limit).
"""
import operator
import os

from lnfast import _cpu

_requested = None

# Below this many elements a call runs on the calling thread: waking the
# thread team costs more than the work.
PARALLEL_MIN_ELEMENTS = 1 << 13


def set_num_threads(n):
    """Use `n` threads in the CPU kernels; `None` returns to the default."""
    global _requested
    if n is not None:
        try:
            n = operator.index(n)
        except TypeError:
            raise TypeError(f"n must be an int or None, got {type(n).__name__}") from None
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
    _requested = n


def get_num_threads():
    """The thread count the CPU kernels use for large inputs."""
    if _requested is not None:
        return _requested
    env = os.environ.get("LNFAST_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"LNFAST_NUM_THREADS must be an integer >= 1, got {env!r}")
        return n
    return _cpu.omp_max_threads()


def threads_for(n_elements):
    """Threads to use for a call touching `n_elements` elements."""
    return get_num_threads() if n_elements >= PARALLEL_MIN_ELEMENTS else 1
