"""lnfast._build: the small C++ libraries compiled on first use (lnfast.torch's
kernels, lnfast.jax's handlers), kept in a cache, and a compiler's error
recorded so that later imports fail at once."""
import ctypes
import os
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from lnfast import _build

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not os.path.exists("/bin/sh") or not (
        os.environ.get("CXX") or any(shutil.which(c) for c in ("c++", "g++", "clang++"))),
    reason="needs a C++ compiler and /bin/sh")

GOOD = 'extern "C" int lnfast_test_answer(void) { return 42; }\n'
BAD = 'extern "C" int lnfast_test_answer(void) { return 42 }\n'     # (no semicolon)
NEEDS_HEADER = '#include "lnfast_test_answer.h"\n' + GOOD


@pytest.fixture
def cxx(tmp_path, monkeypatch):
    """$CXX as a wrapper of the real compiler that logs its arguments."""
    real = shlex.split(os.environ["CXX"]) if os.environ.get("CXX") else [
        next(c for c in ("c++", "g++", "clang++") if shutil.which(c))]
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\n'
                       f'exec {" ".join(shlex.quote(c) for c in real)} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    probe, lib = tmp_path / "probe.cc", tmp_path / "probe.so"
    probe.write_text(GOOD)
    try:
        subprocess.run([str(wrapper), "-shared", "-fPIC", str(probe), "-o", str(lib)],
                       capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("cannot run a compiler wrapper from the temporary folder")
    try:
        ctypes.CDLL(str(lib))
    except OSError:
        pytest.skip("the compiler's libraries do not load in this Python (a cross or emulated "
                    "environment)")
    log.write_text("")
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("LNFAST_CACHE_DIR", str(tmp_path / "cache"))
    return log


def _load(source, flags=()):
    return _build.load("test", "a test library", "lnfast_test", source,
                       ["-shared", "-fPIC", "-O0", *flags], (), ["1"])


def _answer(lib):
    return ctypes.CFUNCTYPE(ctypes.c_int)(("lnfast_test_answer", lib))()


def _compiles(log):
    """The compiler's calls so far that were compiles (not --version)."""
    return [line for line in log.read_text().splitlines() if "--version" not in line]


def test_compiled_once_then_loaded_from_the_cache(tmp_path, cxx):
    src = tmp_path / "good.cc"
    src.write_text(GOOD)
    for _ in range(2):
        assert _answer(_load(src)) == 42
    assert len(_compiles(cxx)) == 1


def test_a_failed_compile_is_recorded_and_not_repeated(tmp_path, cxx):
    src = tmp_path / "bad.cc"
    src.write_text(BAD)
    with pytest.raises(ImportError, match="could not compile a test library") as first:
        _load(src)
    assert len(_compiles(cxx)) == 1
    with pytest.raises(ImportError, match="delete .*\\.failed to compile again") as again:
        _load(src)
    assert len(_compiles(cxx)) == 1                     # (not compiled again)
    assert str(first.value) in str(again.value)         # (the compiler's own error kept)
    # a changed source is another library: compiled
    src.write_text(GOOD)
    assert _answer(_load(src)) == 42
    assert len(_compiles(cxx)) == 2
    # the record deleted: compiled again
    src.write_text(BAD)
    records = list((tmp_path / "cache").glob("*.failed"))
    assert len(records) == 1
    records[0].unlink()
    with pytest.raises(ImportError, match="could not compile"):
        _load(src)
    assert len(_compiles(cxx)) == 3


def test_a_header_installed_since_the_failure_is_tried(tmp_path, cxx):
    src, inc = tmp_path / "needs.cc", tmp_path / "include"
    src.write_text(NEEDS_HEADER)
    with pytest.raises(ImportError, match="lnfast_test_answer.h"):
        _load(src, [f"-I{inc}"])
    inc.mkdir()                                         # (the header installed)
    (inc / "lnfast_test_answer.h").write_text("/* nothing */\n")
    assert _answer(_load(src, [f"-I{inc}"])) == 42
    assert len(_compiles(cxx)) == 2


def test_a_stale_record_is_tried_again(tmp_path, cxx, monkeypatch):
    src = tmp_path / "bad.cc"
    src.write_text(BAD)
    with pytest.raises(ImportError):
        _load(src)
    monkeypatch.setattr(_build, "RECORD_SECONDS", -1)   # (every record too old)
    with pytest.raises(ImportError, match="could not compile"):
        _load(src)
    assert len(_compiles(cxx)) == 2


def test_a_compiler_that_says_nothing_is_not_recorded(tmp_path, cxx, monkeypatch):
    # (killed, say: exit status without diagnostics)
    silent = tmp_path / "silent-cxx"
    silent.write_text(f'#!/bin/sh\ncase "$*" in *--version*) exec "{os.environ["CXX"]}" "$@";; '
                      'esac\nexit 1\n')
    silent.chmod(silent.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(silent))
    src = tmp_path / "good.cc"
    src.write_text(GOOD)
    with pytest.raises(ImportError, match="exited with 1"):
        _load(src)
    assert not list((tmp_path / "cache").glob("*.failed"))


def test_processes_importing_at_once_compile_once(tmp_path, cxx):
    # (the compiler made slow, so that both processes ask before either is done)
    slow = tmp_path / "slow-cxx"
    slow.write_text(f'#!/bin/sh\ncase "$*" in *--version*) ;; *) sleep 2;; esac\n'
                    f'exec "{os.environ["CXX"]}" "$@"\n')
    slow.chmod(slow.stat().st_mode | stat.S_IXUSR)
    src = tmp_path / "good.cc"
    src.write_text(GOOD)
    script = ("import ctypes, pathlib\nfrom lnfast import _build\n"
              "lib = _build.load('test', 'a test library', 'lnfast_test', "
              f"pathlib.Path({str(src)!r}), "
              "['-shared', '-fPIC', '-O0'], (), ['1'])\n"
              "print(ctypes.CFUNCTYPE(ctypes.c_int)(('lnfast_test_answer', lib))())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(_build.__file__)))
    env = dict(os.environ, CXX=str(slow),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [(p.returncode, out.strip()) for p, (out, _) in zip(procs, outs)] == [(0, "42")] * 3, outs
    assert len(_compiles(cxx)) == 1
    assert not list((tmp_path / "cache").glob("*.tmp"))
