"""Instructions per element of the aarch64 build, counted under qemu-user.

    python benchmarks/arm64_instructions.py WORK

WORK is the folder that `.ci/arm64.sh WORK PIP` filled: Debian's aarch64
CPython in WORK/root (started under qemu by its python3.11-qemu script),
the aarch64 wheels in WORK/site and the aarch64 build of lnfast in
WORK/lnfast.  A small TCG plugin (built here with gcc, handed to qemu in
QEMU_PLUGIN) counts the guest instructions qemu executes.  Each figure is the count of a run
making 20 calls less that of a run making none, per element, on one thread,
with PYTHONHASHSEED=0 so that the count repeats exactly.  Instructions are
not time: this is for comparing code paths where no aarch64 machine is at
hand.
"""
import os
import subprocess
import sys
import tempfile

# The plugin API of qemu 7.2 (QEMU_PLUGIN_VERSION 1), declared here.
PLUGIN = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
typedef struct qemu_info_t qemu_info_t;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t,
                                           void (*)(qemu_plugin_id_t, struct qemu_plugin_tb *));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *, enum qemu_plugin_op,
                                              void *, uint64_t);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t, void (*)(qemu_plugin_id_t, void *), void *);
__attribute__((visibility("default"))) int qemu_plugin_version = 1;
static uint64_t count;   /* one counter: run the guest on one thread */
static void translated(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &count,
                                             qemu_plugin_tb_n_insns(tb));
}
static void done(qemu_plugin_id_t id, void *p)
{
    FILE *f = fopen(getenv("INSN_COUNT_OUT"), "w");
    fprintf(f, "%llu\n", (unsigned long long)count);
    fclose(f);
}
__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id,
                                                               const qemu_info_t *info,
                                                               int argc, char **argv)
{
    qemu_plugin_register_vcpu_tb_trans_cb(id, translated);
    qemu_plugin_register_atexit_cb(id, done, NULL);
    return 0;
}
"""

# The guest's side: one function, dtype and conversion path, `calls` times.
GUEST = r"""
import sys
import ml_dtypes, numpy as np, lnfast
from lnfast import _cpu
fn, dtype, path, calls = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dt = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
rng = np.random.default_rng(0)
x, r, dy = (rng.standard_normal((256, 1024)).astype(dt) for _ in range(3))
w, b = (rng.standard_normal(1024).astype(dt) for _ in range(2))
_, mean, rstd = lnfast.layer_norm_forward(x, w, b)
_cpu.simd_path(path)
call = {"forward": lambda: lnfast.layer_norm_forward(x, w, b),
        "backward": lambda: lnfast.layer_norm_backward(dy, x, mean, rstd, w),
        "fused forward": lambda: lnfast.add_layer_norm_forward(x, r, w, b)}[fn]
call()
for _ in range(calls):
    call()
"""
CALLS = 20
ELEMENTS = 256 * 1024
FUNCTIONS = ["forward", "backward", "fused forward"]


def count(work, plugin, tmp, fn, dtype, path, calls):
    out = os.path.join(tmp, "count")
    env = dict(os.environ, PYTHONHASHSEED="0", LNFAST_NUM_THREADS="1", OMP_NUM_THREADS="1",
               OPENBLAS_NUM_THREADS="1", QEMU_PLUGIN=plugin, INSN_COUNT_OUT=out,
               PYTHONPATH=f"{work}/lnfast/src:{work}/site")
    subprocess.run([f"{work}/root/usr/bin/python3.11-qemu", "-c", GUEST, fn, dtype, path,
                    str(calls)], env=env, check=True)
    with open(out) as f:
        return int(f.read())


def main():
    work = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        src, plugin = os.path.join(tmp, "insn.c"), os.path.join(tmp, "libinsn.so")
        with open(src, "w") as f:
            f.write(PLUGIN)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", plugin, src], check=True)
        print("| aarch64 instructions per element | " + " | ".join(FUNCTIONS) + " |")
        print("|---" * (len(FUNCTIONS) + 1) + "|")
        rows = [("float32", "best", "float32")]
        rows += [(dt, path, f"{dt}, {name}") for dt in ("float16", "bfloat16")
                 for path, name in (("portable", "portable code"), ("best", "NEON"))]
        for dtype, path, label in rows:
            cells = []
            for fn in FUNCTIONS:
                n = [count(work, plugin, tmp, fn, dtype, path, c) for c in (0, CALLS)]
                cells.append(f"{(n[1] - n[0]) / CALLS / ELEMENTS:.1f}")
            print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
