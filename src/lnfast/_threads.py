"""Thread count for the CPU kernels, resolved in one place.

Order: lnfast.set_num_threads(n), else the LNFAST_NUM_THREADS environment
variable, else the calling thread's task default (one thread in a Dask
task, see task_threads), else OpenMP's current default (which threadpoolctl
can limit).
In a process forked after lnfast was imported the count is 1: GNU OpenMP's
thread pool does not survive fork, a threaded call would hang, and whether
the parent (or any other library in it) started that pool cannot be asked.
"""
import contextlib
import multiprocessing
import operator
import os
import threading
from typing import Any, Optional

from lnfast import _cpu

_requested = None
_forked = False
# Each thread of a team is an OS thread: far more than any machine's cores
# only wears the memory bus, and tens of thousands make GNU OpenMP abort the
# process when it cannot create them.
_MAX_THREADS = 1024

# The variable is read on every call, so it may change at run time.  CPython's
# os.environ finds a missing key by raising KeyError inside (a tenth of a
# small call); its underlying dict of encoded keys does not.
_ENV: Any
_ENV_KEY: Any
try:
    _ENV, _ENV_KEY = os.environ._data, os.environ.encodekey(  # type: ignore[attr-defined]
        "LNFAST_NUM_THREADS")
except AttributeError:      # another os.environ
    _ENV, _ENV_KEY = os.environ, "LNFAST_NUM_THREADS"


def _after_fork_in_child():
    global _forked
    _forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

# Below this many elements a call runs on the calling thread: waking the
# thread team costs more than the work.  Measured crossovers (2 threads):
# forward between 12288 and 24576 elements, backward (two parallel regions
# and a reduction) between 24576 and 36864.
PARALLEL_MIN_ELEMENTS = 1 << 14
PARALLEL_MIN_ELEMENTS_BACKWARD = 1 << 15


def set_num_threads(n: Optional[int]) -> None:
    """Use `n` threads in the CPU kernels; None returns to the default.

    Parameters
    ----------
    n : int or None
        From 1 to 1024, or None for the default: ``LNFAST_NUM_THREADS``
        where set, else one in the tasks of lnfast's Dask graphs on Dask's
        workers, else OpenMP's (which threadpoolctl can limit).  Results
        are bitwise the same for any count.

    Raises
    ------
    TypeError
        n is neither an int nor None.
    ValueError
        n is out of range.

    Examples
    --------
    >>> import lnfast
    >>> lnfast.set_num_threads(1)
    >>> lnfast.get_num_threads()
    1
    >>> lnfast.set_num_threads(None)
    """
    global _requested
    if n is not None:
        if isinstance(n, bool):
            raise TypeError("n must be an int or None, got bool")
        try:
            n = operator.index(n)
        except TypeError:
            raise TypeError(f"n must be an int or None, got {type(n).__name__}") from None
        if not 1 <= n <= _MAX_THREADS:
            raise ValueError(f"n must be between 1 and {_MAX_THREADS}, got {n}")
    _requested = n


def get_num_threads() -> int:
    """The thread count the CPU kernels use for large inputs.

    Small calls run on the calling thread alone, where waking the others
    would cost more than it saves.

    Returns
    -------
    int
        `set_num_threads`'s count, else ``LNFAST_NUM_THREADS``, else one
        in the tasks of lnfast's Dask graphs on Dask's workers, else
        OpenMP's default; 1 in a process forked after lnfast was imported.

    Examples
    --------
    >>> import lnfast
    >>> lnfast.get_num_threads() >= 1
    True
    """
    if _forked:
        return 1
    if _requested is not None:
        return _requested
    n = _env_threads() or getattr(_task, "threads", None)
    return n if n else min(_cpu.omp_max_threads(), _MAX_THREADS)


_task = threading.local()


@contextlib.contextmanager
def task_threads():
    """Within: one thread for the calling thread's calls (unless the user
    chose a count), where they run as one of several tasks side by side:
    on a thread other than the main one (Dask's threaded scheduler, a
    dask.distributed worker's threads) or in a child process (Dask's
    processes scheduler).  Tasks on the main thread of the main process
    (Dask's synchronous scheduler) run alone and keep the default."""
    alone = (threading.current_thread() is threading.main_thread()
             and multiprocessing.parent_process() is None)
    old = getattr(_task, "threads", None)
    _task.threads = old if alone else 1
    try:
        yield
    finally:
        _task.threads = old


# (the variable's value, its count): one object, thread-safe
_env_parsed: tuple[Any, Optional[int]] = (None, None)


def _env_threads():
    """LNFAST_NUM_THREADS as a count, or None when unset or empty; a bad
    value raises.  Parsed again only when the variable changes."""
    global _env_parsed
    env = _ENV.get(_ENV_KEY)
    if not env:
        return None
    seen, n = _env_parsed
    if env is not seen:
        try:
            n = int(env)        # (int() reads bytes too)
        except ValueError:
            n = 0
        if not 1 <= n <= _MAX_THREADS:
            raise ValueError(
                f"LNFAST_NUM_THREADS must be an integer from 1 to {_MAX_THREADS}, "
                f"got {os.environ['LNFAST_NUM_THREADS']!r}")
        _env_parsed = (env, n)
    return n


def threads_for(n_elements, min_elements=PARALLEL_MIN_ELEMENTS):
    """Threads to use for a call touching `n_elements` elements.  Small calls
    run on one thread but still check LNFAST_NUM_THREADS, so that a bad value
    fails on every call, not only on large ones."""
    if n_elements >= min_elements:
        return get_num_threads()
    if _requested is None and _ENV.get(_ENV_KEY) is not _env_parsed[0]:
        _env_threads()          # (a new value: parse it, raising if bad)
    return 1
