"""The small C++ libraries lnfast builds on first use, against a
framework's own headers: lnfast.jax's XLA FFI handlers and lnfast.torch's
operator kernels.

Each is compiled once with the machine's C++ compiler ($CXX, else c++,
g++ or clang++) and kept (LNFAST_CACHE_DIR, else $XDG_CACHE_HOME/lnfast or
~/.cache/lnfast, else a folder of the user's own in the temporary
directory) under a name that changes with its source, lnfast's C API, the
framework headers and versions its caller names, Python's version, the
compiler and the machine.  They link none of lnfast: lnfast._cpu hands
them the C API's addresses when they are loaded.  What goes wrong is an
ImportError that says what it needs.  A compile that fails with the
compiler's own error is recorded beside the library's name (NAME.failed),
so that later imports fail at once with the same error instead of
compiling again, for a day at most and while the include folders are
unchanged (a change of source, flags, versions or compiler makes another
name; deleting the record retries too).  Processes that import at once
compile a library once: the others wait for it (NAME.lock) and load it.
"""
import contextlib
import ctypes
import hashlib
import os
import pathlib
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

try:
    import fcntl
except ImportError:                         # (Windows: no lock; see _lock)
    fcntl = None  # type: ignore[assignment]

HERE = pathlib.Path(__file__).parent
# lnfast's C API, which every library includes.
API_HEADERS = (HERE / "cpu" / "lnfast_cpu.h", HERE / "cpu" / "config.h")


def _cache_dirs():
    """Where a library may be kept: LNFAST_CACHE_DIR, else the user's
    cache; then a folder of the user's own in the temporary directory,
    where those cannot be written."""
    env = os.environ.get("LNFAST_CACHE_DIR")
    if env:
        yield pathlib.Path(env)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
        yield pathlib.Path(base) / "lnfast"
    user = os.getuid() if hasattr(os, "getuid") else 0
    yield pathlib.Path(tempfile.gettempdir()) / f"lnfast-{user}"


def _private(folder):
    """`folder` in the shared temporary directory, made for this user alone;
    an OSError where it exists as someone else's or others may write to it
    (they could put a library there to be loaded)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    st = folder.stat()
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise OSError(f"{folder} belongs to another user or others may write to it")


def compiler(who, what):
    """The C++ compiler's command, as a list."""
    cxx = os.environ.get("CXX")
    cmd = shlex.split(cxx) if cxx else next(
        ([c] for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    if not cmd:
        raise ImportError(f"{who} compiles {what} on first import and needs a C++ compiler: "
                          "install g++ or clang++, or set CXX")
    return cmd


def _run(cmd, who, what):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise ImportError(f"{who} could not run the C++ compiler for {what} "
                          f"({' '.join(cmd)}): {e}") from None


def _key(stem, cxx, flags, files, versions, who):
    """The library's file name: it changes with the flags, the files, the
    versions given, the compiler and the machine."""
    digest = hashlib.sha256(" ".join(cxx + flags).encode())
    for f in files:
        digest.update(f.read_bytes())
    version = _run(cxx + ["--version"], who, "its version").stdout
    for part in (*versions, platform.machine(), version):
        digest.update(part.encode())
    return f"{stem}-{digest.hexdigest()[:20]}.so"


# A recorded failure is trusted this long (seconds), and only while the
# include folders the flags name are as they were (a header installed
# since, such as Python's, changes its folder).
RECORD_SECONDS = 24 * 3600


def _failed(out):
    """Where a failed compile of `out` is recorded."""
    return out.with_name(out.name + ".failed")


def _folders_state(cmd):
    """The include folders of the command as they are now: each one's
    modification time, or that it is absent."""
    state = []
    for arg in cmd:
        if arg.startswith("-I"):
            try:
                state.append(f"{arg} {os.stat(arg[2:]).st_mtime_ns}")
            except OSError:
                state.append(f"{arg} absent")
    return hashlib.sha256("\n".join(state).encode()).hexdigest()


def _recorded(out, cmd):
    """The error a failed compile of `out` recorded, while it holds (same
    include folders, under RECORD_SECONDS old); else None."""
    record = _failed(out)
    try:
        if time.time() - record.stat().st_mtime > RECORD_SECONDS:
            return None
        state, _, error = record.read_text().partition("\n")
    except OSError:
        return None
    return error if state == _folders_state(cmd) else None


@contextlib.contextmanager
def _lock(out):
    """Held while `out` is compiled: an exclusive lock on NAME.lock beside
    it, so that a process importing at the same time waits for the
    compile instead of running its own (it may take tens of seconds).
    Without fcntl, none: the rename in _compile keeps concurrent compiles
    safe, only slower.  The lock file stays (one per library name):
    removing it could let a third process lock a new file while the
    second holds the old one."""
    if fcntl is None:
        yield
        return
    with open(out.with_name(out.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _compile(out, cmd, who, what):
    """Compile into `out`, through a temporary file of the same directory
    (the rename is atomic: a concurrent import sees all of it or none).  A
    compiler's own error (it exited with diagnostics, not killed) is
    recorded (_failed, with the include folders' state) as well as
    raised."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name, suffix=".tmp")
    os.close(fd)
    try:
        p = _run(cmd + ["-o", tmp], who, what)
        if p.returncode != 0:
            error = (f"{who} could not compile {what} (the compiler exited with "
                     f"{p.returncode}):\n" + " ".join(cmd) + "\n" + p.stderr[-3000:])
            if p.returncode > 0 and p.stderr.strip():
                with open(tmp, "w") as f:     # (replaced whole: read whole or not at all)
                    f.write(_folders_state(cmd) + "\n" + error)
                os.replace(tmp, _failed(out))
            raise ImportError(error)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(who, what, stem, source, flags, headers, versions, libraries=()):
    """The library compiled from `source` with `flags` (and linked with
    `libraries`, which follow the source), loaded: from the cache, else
    compiled first (again, once, where a cached file does not load).  who,
    what: the module that asks and what the library is, for errors;
    `headers`: the files besides the source and lnfast's API whose change
    makes it another library; `versions`: strings that do the same (the
    framework's version)."""
    cxx = compiler(who, what)
    flags = [*flags, f"-I{API_HEADERS[0].parent}", str(source), *libraries]
    try:
        name = _key(stem, cxx, flags, (source, *API_HEADERS, *headers),
                    (*versions, sys.version), who)
    except OSError as e:                    # (a file missing from the installation)
        raise ImportError(f"{who} cannot build {what}: {e}") from None
    errors = []
    folders = list(_cache_dirs())
    for folder in folders:
        out = folder / name
        try:
            if folder == folders[-1]:
                _private(folder)
            else:
                folder.mkdir(parents=True, exist_ok=True)
            if out.exists():
                try:
                    return ctypes.CDLL(str(out))
                except OSError as e:        # (a damaged file: compiled again)
                    errors.append(f"{out}: {e}")
                    out.unlink()
            with _lock(out):
                if not out.exists():        # (else compiled while this one waited)
                    error = _recorded(out, cxx + flags)
                    if error is not None:
                        raise ImportError(f"{error}\n(as recorded by an earlier import; "
                                          f"delete {_failed(out)} to compile again)")
                    _compile(out, cxx + flags, who, what)
        except OSError as e:                # (a folder that cannot be written)
            errors.append(f"{folder}: {e}")
            continue
        try:
            return ctypes.CDLL(str(out))
        except OSError as e:                # (freshly built, and still not loadable)
            raise ImportError(f"{who} could not load {what}: {e}") from None
    raise ImportError(f"{who} could not keep or load {what}: " + "; ".join(errors))
