#!/usr/bin/env bash
# The aarch64 build, tested under emulation on an x86-64 Debian machine.
#
#   .ci/arm64.sh WORK PIP    (root: installs qemu-user and the cross gcc)
#
# Debian's aarch64 CPython runs under qemu-user.  It builds the extension
# with setup.py, as a native build would, except that its compiler is
# Debian's cross gcc (its sysconfig names aarch64-linux-gnu-gcc).  The
# aarch64 wheels of NumPy, ml_dtypes, Cython and pytest come from PyPI,
# fetched by PIP (an x86-64 pip) into a folder.  Then the kernels' tests run
# on the NEON build, and .ci/fingerprint.py's hash is written to
# WORK/fingerprint for the caller to compare with the x86-64 build's.
# Afterwards `python benchmarks/arm64_instructions.py WORK` counts the
# instructions per element this build executes.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$1
pip=$2
root=$work/root          # the aarch64 Debian files, unpacked
site=$work/site          # the aarch64 wheels, unpacked
mkdir -p "$work/debs" "$root" "$site"

export DEBIAN_FRONTEND=noninteractive
dpkg --add-architecture arm64
apt-get update -q
apt-get install -y -q qemu-user gcc-aarch64-linux-gnu
# CPython 3.11 and what it and the OpenMP build load.
debs="python3.11-minimal libpython3.11-minimal libpython3.11-stdlib libpython3.11-dev
      libc6 libgcc-s1 libgomp1 libstdc++6 libexpat1 zlib1g libffi8 libssl3
      libbz2-1.0 liblzma5 libuuid1 libcrypt1"
(cd "$work/debs" && apt-get download $(printf '%s:arm64 ' $debs))
for d in "$work"/debs/*.deb; do dpkg -x "$d" "$root"; done

"$pip" install --quiet --target "$site" --only-binary=:all: \
    --platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64 \
    --platform manylinux_2_17_aarch64 --python-version 3.11 \
    --implementation cp --abi cp311 \
    "numpy>=2.0" "ml_dtypes>=0.4" "cython>=3.1" "setuptools>=77" pytest threadpoolctl mpmath \
    pytest-xdist

# The interpreter, as a script that starts qemu: the tests that run
# sys.executable in a subprocess start it the same way (no binfmt_misc).
py=$root/usr/bin/python3.11-qemu
printf '#!/bin/sh\nexec qemu-aarch64 -L "%s" -0 "$0" "%s" "$@"\n' \
    "$root" "$root/usr/bin/python3.11" > "$py"
chmod +x "$py"

git clone -q "$repo" "$work/lnfast"
cd "$work/lnfast"
# Python.h and pyconfig.h of the aarch64 CPython, ahead of the host's.
PYTHONPATH=$site "$py" setup.py -q build_ext --inplace \
    -I "$root/usr/include/python3.11:$root/usr/include"
export PYTHONPATH=$work/lnfast/src:$site
"$py" -c "import lnfast, platform; assert platform.machine() == 'aarch64'; lnfast.show_config()"
# The kernels' tests. Left to the x86-64 steps: the C API's checks (built
# by this machine's compiler, for x86-64), tests/gpu (the CUDA source), the
# CLI's and the docs' (the same Python on every platform, and slow here:
# they start interpreters), and the peak-memory test (it measures qemu's
# own memory too). One emulated interpreter keeps one core busy: a worker
# per core (pytest-xdist's workers start as sys.executable, this script).
"$py" -m pytest tests -q -p no:cacheprovider -n auto --ignore=tests/test_c_api.py \
    --ignore=tests/gpu --ignore=tests/test_cli.py --ignore=tests/test_docs.py \
    --deselect tests/test_memory.py::test_a_long_16bit_row_runs_its_forward_in_little_extra_memory
"$py" .ci/fingerprint.py > "$work/fingerprint"
