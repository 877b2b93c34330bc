"""A stand-in for CuPy that runs lnfast's GPU path on the CPU, for tests only.

Put this folder first on PYTHONPATH and `import cupy` finds it.  Arrays are
NumPy arrays of a subclass named cupy.ndarray, so lnfast dispatches them to
lnfast._gpu as it would CuPy's, and their memory stands in for device memory.
RawModule compiles the CUDA source it is given with the host C++ compiler and
tests/gpu/emulate.h, which runs each kernel launch block by block on one CPU
thread.  A launch's arguments are checked against the kernel's parameter
types, as a GPU cannot: a wrong count, size or kind of argument raises
TypeError instead of reading garbage.

It covers what lnfast and its GPU tests and benchmark use, not CuPy's API.
"""
import ctypes
import hashlib
import importlib.util
import os
import pathlib
import tempfile
import time
import types

import numpy as np

__version__ = "0+emulated"

# tests/gpu/emulation.py: where emulate.h is, and how to compile it.
_spec = importlib.util.spec_from_file_location(
    "lnfast_tests_emulation", pathlib.Path(__file__).resolve().parents[2] / "emulation.py")
_emulation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_emulation)

SM_COUNT = 4


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class ndarray(np.ndarray):
    """Host memory standing in for device memory."""

    @property
    def data(self):
        return _Pointer(self.__array_interface__["data"][0])

    @property
    def device(self):
        return Device(0)

    def get(self):
        return np.array(self.view(np.ndarray))


def _dev(a):
    return a.view(ndarray)


def asarray(a, dtype=None):
    if isinstance(a, ndarray) and (dtype is None or a.dtype == dtype):
        return a
    return _dev(np.array(a, dtype=dtype))


def asnumpy(a):
    return np.array(a.view(np.ndarray) if isinstance(a, ndarray) else a)


def ascontiguousarray(a, dtype=None):
    return _dev(np.ascontiguousarray(a.view(np.ndarray), dtype=dtype))


def stack(arrays, axis=0):
    return _dev(np.stack([a.view(np.ndarray) for a in arrays], axis))


def concatenate(arrays, axis=0):
    return _dev(np.concatenate([a.view(np.ndarray) for a in arrays], axis))


# (what Dask registers for CuPy arrays when it first meets one)
def take(a, indices, axis=None):
    return _dev(np.take(a.view(np.ndarray), indices, axis))


def tensordot(a, b, axes=2):
    return _dev(np.tensordot(a.view(np.ndarray), b.view(np.ndarray), axes))


def empty(shape, dtype=float):
    return _dev(np.empty(shape, dtype))


def empty_like(a):
    return _dev(np.empty_like(a.view(np.ndarray)))


def zeros(shape, dtype=float):
    return _dev(np.zeros(shape, dtype))


def ones(shape, dtype=float):
    return _dev(np.ones(shape, dtype))


def full(shape, value, dtype=None):
    return _dev(np.full(shape, value, dtype))


may_share_memory = np.may_share_memory
array_equal = np.array_equal
float16, float32, float64 = np.float16, np.float32, np.float64


def is_available():
    return True


class _Generator:
    def __init__(self, seed):
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, shape, dtype=np.float64):
        return _dev(self._rng.standard_normal(shape, dtype=dtype))


random = types.SimpleNamespace(default_rng=_Generator)


def get_default_memory_pool():
    return types.SimpleNamespace(free_all_blocks=lambda: None)


# --- cupy.cuda ----------------------------------------------------------------

class Device:
    def __init__(self, device_id=0):
        self.id = device_id
        # No L2 cache for `bench --gpu` to defeat with copies of its inputs.
        self.attributes = {"MultiProcessorCount": SM_COUNT, "L2CacheSize": 0}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event:
    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass


def _properties(device_id):
    return {"name": b"CPU emulation (tests/gpu/emulate.h)"}


cuda = types.SimpleNamespace(
    Device=Device, Event=Event,
    get_elapsed_time=lambda start, end: 1e3 * (end.t - start.t),
    runtime=types.SimpleNamespace(getDeviceProperties=_properties))


# --- RawModule ------------------------------------------------------------------

_CLASSES = {"f": "f", "i": "i", "u": "u", "b": "u"}


def _pack(arg):
    """(value holder, kind, class, size) of one kernel argument."""
    if isinstance(arg, ndarray):
        c = "f" if arg.dtype.kind == "V" else _CLASSES.get(arg.dtype.kind, "?")  # bfloat16: 'V'
        return ctypes.c_uint64(arg.data.ptr), b"a", c.encode(), arg.itemsize
    if isinstance(arg, np.generic):
        holder = ctypes.create_string_buffer(arg.tobytes(), arg.itemsize)
        kind = b"n" if arg.dtype == np.uint64 and arg == 0 else b"s"
        return holder, kind, _CLASSES.get(arg.dtype.kind, "?").encode(), arg.itemsize
    raise TypeError(f"kernel argument of type {type(arg).__name__}: pass a cupy.ndarray or a "
                    "NumPy scalar, whose size the kernel's parameter must match")


class _Function:
    def __init__(self, lib, name):
        self._lib, self._name = lib, name.encode()

    def __call__(self, grid, block, args):
        if len(grid) != 1 or len(block) != 1:
            raise ValueError("the emulation launches 1-D grids and blocks only")
        packed = [_pack(a) for a in args]
        n = len(packed)
        ptrs = (ctypes.c_void_p * n)(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p)
                                       for h, _, _, _ in packed])
        kinds = b"".join(k for _, k, _, _ in packed)
        classes = b"".join(c for _, _, c, _ in packed)
        sizes = (ctypes.c_long * n)(*[s for _, _, _, s in packed])
        err = ctypes.create_string_buffer(512)
        rc = self._lib.lnf_emu_launch(self._name, int(grid[0]), int(block[0]), n, ptrs,
                                      kinds, classes, sizes, err, len(err))
        if rc:
            raise TypeError(f"{self._name.decode()}: {err.value.decode()}")


class RawModule:
    """Compiles `code` for the emulator; get_function(name) launches one of
    `name_expressions`."""

    def __init__(self, code, options=(), name_expressions=()):
        self._names = list(name_expressions)
        self._lib = _build(code, tuple(options), tuple(self._names))

    def get_function(self, name):
        if name not in self._names:
            raise KeyError(f"{name} is not among the module's name_expressions")
        return _Function(self._lib, name)


def _entries(names):
    table = ",\n".join(f'    {{"{n}", &lnf_emu::Entry<&{n}>::run}}' for n in names)
    return f"""
#include <cstring>
typedef int (*lnf_emu_entry)(unsigned, unsigned, int, void **, const char *, const char *,
                             const long *, char *, size_t);
static const struct {{ const char *name; lnf_emu_entry run; }} lnf_emu_table[] = {{
{table}
}};
extern "C" int lnf_emu_launch(const char *name, unsigned grid, unsigned block, int nargs,
                              void **args, const char *kind, const char *cls,
                              const long *size, char *err, size_t n)
{{
    for (const auto &e : lnf_emu_table)
        if (!strcmp(e.name, name))
            return e.run(grid, block, nargs, args, kind, cls, size, err, n);
    snprintf(err, n, "no kernel named %s", name);
    return 1;
}}
"""


def _build(code, options, names):
    """The shared library of `code` with an entry point per name, cached by
    content in the temporary directory."""
    cxx = _emulation.find_cxx()
    if cxx is None:
        raise RuntimeError("the CuPy emulation needs a C++ compiler (g++ or clang++)")
    std = next((o.split("=", 1)[1] for o in options if o.startswith("--std=")), "c++17")
    contract = "off" if "--fmad=false" in options else "fast"
    source = f'#include "emulate.h"\n{code}\n{_entries(names)}'
    key = hashlib.sha256("\0".join((cxx, std, contract, source)).encode()
                         + (_emulation.HERE / "emulate.h").read_bytes()).hexdigest()[:16]
    out = pathlib.Path(tempfile.gettempdir()) / f"lnfast-emulated-{key}.so"
    if not out.exists():
        with tempfile.TemporaryDirectory() as tmp:
            src = pathlib.Path(tmp) / "module.cpp"
            src.write_text(source)
            lib = pathlib.Path(tmp) / "module.so"
            p = _emulation.compile_cxx(cxx, src, lib, f"-std={std}", f"-ffp-contract={contract}",
                                       "-O2", "-shared", "-fPIC")
            if p.returncode:
                raise RuntimeError(f"compiling the emulated module failed:\n{p.stderr}")
            os.replace(lib, out)   # atomic: concurrent builds of the same key agree
    lib = ctypes.CDLL(str(out))
    lib.lnf_emu_launch.restype = ctypes.c_int
    return lib
