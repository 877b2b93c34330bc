/* The kernels' floating-point environment (src/lnfast/cpu/fpenv.h): with
 * flush-to-zero and denormals-are-zero set on the calling thread and on
 * OpenMP's threads, as XLA and PyTorch's set_flush_denormal set them,
 * float32 and float64 LayerNorm forward and backward on rows of subnormal
 * values, and on rows whose outputs are subnormal, give the bytes they give
 * in the default environment, on one thread and on two, on every
 * instruction set, and the caller's
 * environment is as it was after each call.  x86-64 (MXCSR) and aarch64
 * (FPCR); exits 0 with a note elsewhere.  Built and run by tests/test_c_api.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lnfast_cpu.h"

#if defined(__SSE2__)
#include <xmmintrin.h>
#define FLUSH 0x8040u                           /* MXCSR: FTZ | DAZ */
static unsigned long long get_env(void) { return _mm_getcsr(); }
static void set_env(unsigned long long v) { _mm_setcsr((unsigned)v); }
#elif defined(__aarch64__) && defined(__GNUC__)
#define FLUSH (1ULL << 24)                      /* FPCR: FZ */
static unsigned long long get_env(void)
{
    unsigned long long v;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(v));
    return v;
}
static void set_env(unsigned long long v) { __asm__ __volatile__("msr fpcr, %0" : : "r"(v)); }
#endif

#ifdef FLUSH

enum { M = 48, D = 40, N = M * D };

/* Rows 0-15: values near 1e-40 (subnormal in float32; scaled by 1e-310 in
 * float64); rows 16-31: values near 1e-38 (outputs subnormal with eps 1);
 * rows 32-47: ordinary values.  dy: the same, rows reversed. */
static double value(int r, int i)
{
    double v = ((r * 7919 + i * 104729) % 2003) / 1001.0 - 1.0;
    return v;
}

static void fill(void *x, void *dy, int f64)
{
    for (int r = 0; r < M; r++)
        for (int i = 0; i < D; i++) {
            int g = r / 16, q = M - 1 - r;
            double s = g == 0 ? (f64 ? 1e-310 : 1e-40) : g == 1 ? (f64 ? 1e-306 : 1e-38) : 1.0;
            double sq = q / 16 == 0 ? (f64 ? 1e-310 : 1e-40) : q / 16 == 1 ? (f64 ? 1e-306 : 1e-38) : 1.0;
            double a = value(r, i) * s, b = value(q, i + 3) * sq;
            if (f64)
                ((double *)x)[r * D + i] = a, ((double *)dy)[r * D + i] = b;
            else
                ((float *)x)[r * D + i] = (float)a, ((float *)dy)[r * D + i] = (float)b;
        }
}

static lnf_array arr(void *p, int t, int ndim)
{
    lnf_array a;
    size_t s = t == LNF_FLOAT64 ? 8 : 4;
    ptrdiff_t shape[2] = {M, D}, strides[2] = {(ptrdiff_t)(D * s), (ptrdiff_t)s};
    if (ndim == 1)
        shape[0] = D, strides[0] = (ptrdiff_t)s;
    if (lnf_array_init(&a, p, t, ndim, shape, strides) != LNF_OK)
        exit(2);
    return a;
}

/* Forward (eps) and backward into out: y, mean, rstd, dx, dwdb. */
static int run(int t, void *x, void *dy, void *w, double eps, int nthreads, char *out)
{
    size_t s = t == LNF_FLOAT64 ? 8 : 4;
    char *y = out, *mean = y + N * s, *rstd = mean + M * s, *dx = rstd + M * s, *dwdb = dx + N * s;
    unsigned long long csr = get_env();
    lnf_forward_args fa = {0};
    fa.x = arr(x, t, 2), fa.y = arr(y, t, 2), fa.weight = fa.bias = arr(w, t, 1);
    fa.weight_len = fa.bias_len = D, fa.mean = mean, fa.rstd = rstd;
    fa.M = M, fa.D = D, fa.eps = eps, fa.centered = 1, fa.nthreads = nthreads;
    lnf_backward_args ba = {0};
    ba.x = arr(x, t, 2), ba.dy = arr(dy, t, 2), ba.dx = arr(dx, t, 2), ba.weight = arr(w, t, 1);
    ba.mean = mean, ba.rstd = rstd, ba.dwdb = dwdb, ba.dwdb_dtype = t;
    ba.M = M, ba.D = D, ba.centered = 1, ba.nthreads = nthreads, ba.nchunks = 3;
    if (lnf_forward(&fa) != LNF_OK || lnf_backward(&ba) != LNF_OK)
        exit(2);
    if (get_env() != csr) {
        printf("the caller's environment changed: %#llx -> %#llx\n", csr, get_env());
        return 1;
    }
    return 0;
}

static void set_flush(int on)
{
    /* every thread of the team that the kernels' regions will reuse */
#pragma omp parallel num_threads(2)
    set_env(on ? get_env() | FLUSH : get_env() & ~FLUSH);
    set_env(on ? get_env() | FLUSH : get_env() & ~FLUSH);
}

int main(void)
{
    int bad = 0;
    for (int f64 = 0; f64 < 2; f64++) {
        int t = f64 ? LNF_FLOAT64 : LNF_FLOAT32;
        size_t s = f64 ? 8 : 4, bytes = (2 * N + 2 * M + 2 * D) * s;
        char *x = malloc(N * s), *dy = malloc(N * s), *w = malloc(D * s);
        char *want = malloc(bytes), *got = malloc(bytes);
        fill(x, dy, f64);
        for (int i = 0; i < D; i++)
            if (f64) ((double *)w)[i] = 1.0 + i / 64.0;
            else ((float *)w)[i] = 1.0f + (float)i / 64.0f;
        for (int k = 0; k < 4 * 2 * 2; k++) {
            int path = k / 4, e = k / 2 % 2, nt = 1 + k % 2;
            lnf_select(path);       /* every instruction set (lnf_select) */
            {
                set_flush(0);
                bad |= run(t, x, dy, w, e ? 1.0 : 0.0, nt, want);
                set_flush(1);
                bad |= run(t, x, dy, w, e ? 1.0 : 0.0, nt, got);
                if (!(get_env() & FLUSH)) {
                    printf("flush-to-zero not kept\n");
                    bad = 1;
                }
                if (memcmp(want, got, bytes) != 0) {
                    printf("%s eps %d, %d thread(s), %s: other bytes with flush-to-zero\n",
                           f64 ? "float64" : "float32", e, nt, lnf_simd_name());
                    bad = 1;
                }
            }
        }
        lnf_select(LNF_BEST);
        set_flush(0);
        free(x), free(dy), free(w), free(want), free(got);
    }
    printf("%s\n", bad ? "DIFFERENT" : "same bytes with flush-to-zero");
    return bad;
}
#else
int main(void)
{
    printf("neither x86-64 nor aarch64: nothing checked\n");
    return 0;
}
#endif
