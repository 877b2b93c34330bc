"""lnfast: fast, accurate, reproducible LayerNorm and RMSNorm kernels for NumPy.

See the README and docs/ for the contract; ``lnfast.show_config()`` prints
how this copy was built.
"""
from lnfast._config import __version__, show_config
from lnfast._kernels import empty_cache
from lnfast._layer_norm import (
    add_layer_norm_backward,
    add_layer_norm_forward,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
)
from lnfast._rms_norm import rms_norm, rms_norm_backward, rms_norm_forward
from lnfast._threads import get_num_threads, set_num_threads

__all__ = [
    "__version__",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "empty_cache",
    "get_num_threads",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "set_num_threads",
    "show_config",
]
