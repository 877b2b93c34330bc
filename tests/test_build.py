"""lnfast._build: the small C++ libraries compiled on first use (lnfast.torch's
kernels, lnfast.jax's handlers), kept in a cache, and a failed compile
recorded so that later imports fail at once."""
import ctypes
import os
import shutil
import stat
import sys

import pytest

from lnfast import _build

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not (os.environ.get("CXX") or any(
        shutil.which(c) for c in ("c++", "g++", "clang++"))),
    reason="needs a C++ compiler and a POSIX shell")

GOOD = 'extern "C" int lnfast_test_answer(void) { return 42; }\n'
BAD = 'extern "C" int lnfast_test_answer(void) { return 42 }\n'     # (no semicolon)


@pytest.fixture
def cxx(tmp_path, monkeypatch):
    """$CXX as a wrapper of the real compiler that logs its arguments."""
    real = os.environ.get("CXX") or next(c for c in ("c++", "g++", "clang++") if shutil.which(c))
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "cxx"
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec {real} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(wrapper))
    monkeypatch.setenv("LNFAST_CACHE_DIR", str(tmp_path / "cache"))
    return log


def _load(source):
    return _build.load("test", "a test library", "lnfast_test", source,
                       ["-shared", "-fPIC", "-O0"], (), ["1"])


def _compiles(log):
    """The compiler's calls so far that were compiles (not --version)."""
    return [line for line in log.read_text().splitlines() if "--version" not in line]


def test_compiled_once_then_loaded_from_the_cache(tmp_path, cxx):
    src = tmp_path / "good.cc"
    src.write_text(GOOD)
    for _ in range(2):
        lib = _load(src)
        assert ctypes.CFUNCTYPE(ctypes.c_int)(("lnfast_test_answer", lib))() == 42
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
    assert ctypes.CFUNCTYPE(ctypes.c_int)(("lnfast_test_answer", _load(src)))() == 42
    assert len(_compiles(cxx)) == 2
    # the record deleted: compiled again
    src.write_text(BAD)
    records = list((tmp_path / "cache").glob("*.failed"))
    assert len(records) == 1
    records[0].unlink()
    with pytest.raises(ImportError, match="could not compile"):
        _load(src)
    assert len(_compiles(cxx)) == 3
