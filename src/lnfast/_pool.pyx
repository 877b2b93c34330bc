# cython: language_level=3
"""Output buffers from a cache of large blocks (_pool.h), so that repeated
calls do not pay the kernel's page faults and zeroing for every output."""
cimport numpy as cnp
import numpy as np

cnp.import_array()

cdef extern from "_pool.h":
    object lnf_pool_capsule()
    void lnf_pool_set_limit(size_t limit)
    void lnf_pool_clear()
    size_t lnf_pool_bytes()
    size_t lnf_pool_limit()
    size_t LNF_POOL_MIN
    void *lnf_pool_malloc(void *ctx, size_t size)
    void lnf_pool_free(void *ctx, void *ptr, size_t size)

cdef extern from "numpy/arrayobject.h":
    object PyDataMem_SetHandler(object handler)

import os

# The handler (a capsule), for lnfast._kernels' allocations.
handler = lnf_pool_capsule()
MIN_BYTES = LNF_POOL_MIN


def _limit_from_env():
    text = os.environ.get("LNFAST_CACHE_BYTES")
    if not text:                # (unset or empty, as LNFAST_NUM_THREADS)
        return 1 << 30
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if not 0 <= limit < 1 << 64:
        raise ValueError(f"LNFAST_CACHE_BYTES must be an integer from 0 to 2**64 - 1, "
                         f"got {text!r}")
    return limit


lnf_pool_set_limit(_limit_from_env())


def empty(shape, dtype):
    """numpy.empty(shape, dtype), drawing large buffers from the cache."""
    old = PyDataMem_SetHandler(handler)
    try:
        return np.empty(shape, dtype)
    finally:
        PyDataMem_SetHandler(old)


def c_addresses():
    """The addresses of the cache's malloc(ctx, size) and free(ctx, ptr,
    size) (ctx unused), for lnfast.torch's C++ kernels' outputs."""
    return <size_t><void*>lnf_pool_malloc, <size_t><void*>lnf_pool_free


def cache_info():
    """(cached bytes, byte limit, smallest cached block size)."""
    return lnf_pool_bytes(), lnf_pool_limit(), LNF_POOL_MIN


def set_cache_limit(size_t limit):
    """Keep at most `limit` bytes of freed output buffers (0: none)."""
    lnf_pool_set_limit(limit)


def clear_cache():
    """Release the cached output buffers; the limit stays."""
    lnf_pool_clear()
