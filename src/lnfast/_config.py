"""Version and build introspection."""
import platform
import sys
from importlib import metadata

import numpy as np

from lnfast import _cpu, _pool
from lnfast._threads import get_num_threads

try:
    __version__ = metadata.version("lnfast")
except metadata.PackageNotFoundError:  # imported from a source tree
    __version__ = "0+unknown"


def _gpu_status():
    from lnfast import _gpu      # imports CuPy only inside usable()

    return _gpu.usable()[1]


def _threads():
    """The thread count, or what is wrong with LNFAST_NUM_THREADS (every
    call raises it too)."""
    try:
        return get_num_threads()
    except ValueError as e:
        return f"error: {e}"


def config():
    """The facts show_config() prints, as a dict."""
    build = _cpu.build_info()
    return {
        "version": __version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "platform": f"{platform.system()} {platform.machine()}",
        "compiler": build["compiler"],
        "openmp": build["openmp"],
        "simd": build["simd"],
        "threads": _threads(),
        "output cache": "{:.0f} MiB held, limit {:.0f} MiB".format(
            *(n / 2**20 for n in _pool.cache_info()[:2])),
        "gpu": _gpu_status(),
    }


def show_config() -> None:
    """Print the version, the build (compiler, OpenMP, SIMD), threads and GPU.

    Examples
    --------
    >>> import lnfast
    >>> lnfast.show_config()  # doctest: +ELLIPSIS
    version ...
    """
    c = config()
    c["openmp"] = "on" if c["openmp"] else "off (serial build)"
    width = max(map(len, c))
    for key, value in c.items():
        print(f"{key:<{width}} : {value}")
