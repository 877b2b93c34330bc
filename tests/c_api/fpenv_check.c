/* The kernels' floating-point environment (src/lnfast/cpu/fpenv.h): with
 * flush-to-zero (and denormals-are-zero) set on the calling thread and on
 * OpenMP's threads, as XLA and PyTorch's set_flush_denormal set them,
 * LayerNorm forward and backward on rows of subnormal values, and on rows
 * whose outputs are subnormal, give the bytes they give in the default
 * environment: float32, float64 and bfloat16, one thread and two, every
 * instruction set, and shapes that take each parallel region (rows by
 * chunks, column blocks shared by the threads, the partial rows summed in
 * parallel); lnf_round_sums too.  Every thread's environment is as it was
 * after each call.  x86-64 (MXCSR) and aarch64 (FPCR); exits 0 with a note
 * elsewhere.  Built and run by tests/test_c_api.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"

#if defined(__SSE2__)
#include <xmmintrin.h>
#define FLUSH 0x8040ULL                         /* MXCSR: FTZ | DAZ */
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
#ifdef _OPENMP
#include <omp.h>
#endif

typedef struct { int M, D, nchunks, blocked; } shape;
/* rows by chunks; the partial rows summed in parallel (6 column blocks of
 * 48 chunks); column blocks shared by the threads (lnf_set_blocked) */
static const shape shapes[3] = {{48, 40, 3, 0}, {96, 1400, 48, 0}, {48, 40, 3, 1}};
static const int checked[3] = {LNF_FLOAT32, LNF_FLOAT64, LNF_BFLOAT16};
static const char *names[3] = {"float32", "float64", "bfloat16"};

/* Groups of 16 rows in turn, of `groups` kinds: values near 1e-40
 * (subnormal in float32 and bfloat16; 1e-310 in float64), near 1e-38
 * (outputs subnormal with eps 1; 1e-306), ordinary values.  x takes all
 * three, dy the first two, so that dweight and dbias are subnormal too. */
static double value(int r, int i, int groups, int f64)
{
    int g = r / 16 % groups;
    double s = g == 0 ? (f64 ? 1e-310 : 1e-40) : g == 1 ? (f64 ? 1e-306 : 1e-38) : 1.0;
    return (((r * 7919 + i * 104729) % 2003) / 1001.0 - 1.0) * s;
}

static lnf_array arr(void *p, int t, int ndim, int M, int D)
{
    lnf_array a;
    ptrdiff_t s = (ptrdiff_t)itemsize(t);
    ptrdiff_t sh[2] = {M, D}, st[2] = {D * s, s};
    if (ndim == 1)
        sh[0] = D, st[0] = s;
    if (lnf_array_init(&a, p, t, ndim, sh, st) != LNF_OK)
        exit(2);
    return a;
}

/* Whether every thread of a team of two has flush-to-zero `on`. */
static int team_has(int on)
{
    int ok = 1;
#pragma omp parallel num_threads(2) reduction(&& : ok)
    ok = ((get_env() & FLUSH) == FLUSH) == on;
    return ok;
}

static void set_flush(int on)
{
#pragma omp parallel num_threads(2)
    set_env(on ? get_env() | FLUSH : get_env() & ~FLUSH);
    set_env(on ? get_env() | FLUSH : get_env() & ~FLUSH);
}

/* Forward (eps) and backward into out (y, mean, rstd, dx, dwdb, dwdb
 * rounded from float64 by lnf_round_sums); 1 if the environment moved. */
static int run(int t, const shape *c, void *x, void *dy, void *w, double eps, int nthreads,
               char *out, int flush)
{
    int M = c->M, D = c->D, ct = compute(t);
    size_t s = itemsize(t), cs = itemsize(ct), n = (size_t)M * D;
    char *y = out, *mean = y + n * s, *rstd = mean + M * cs, *dx = rstd + M * cs;
    char *dwdb = dx + n * s, *rounded = dwdb + 2 * D * cs;
    double *sums = malloc(2 * (size_t)D * sizeof(double));
    unsigned long long env = get_env();
    lnf_forward_args fa = {0};
    fa.x = arr(x, t, 2, M, D), fa.y = arr(y, t, 2, M, D);
    fa.weight = fa.bias = arr(w, ct, 1, M, D);
    fa.weight_len = fa.bias_len = D, fa.mean = mean, fa.rstd = rstd;
    fa.M = M, fa.D = D, fa.eps = eps, fa.centered = 1, fa.nthreads = nthreads;
    lnf_backward_args ba = {0};
    ba.x = arr(x, t, 2, M, D), ba.dy = arr(dy, t, 2, M, D), ba.dx = arr(dx, t, 2, M, D);
    ba.weight = arr(w, ct, 1, M, D);
    ba.mean = mean, ba.rstd = rstd, ba.dwdb = dwdb, ba.dwdb_dtype = ct;
    ba.M = M, ba.D = D, ba.centered = 1, ba.nthreads = nthreads, ba.nchunks = c->nchunks;
    ptrdiff_t old[2];
    if (c->blocked)
        lnf_set_blocked(0, 16, old);
    if (lnf_forward(&fa) != LNF_OK || lnf_backward(&ba) != LNF_OK)
        exit(2);
    ba.dwdb = sums, ba.dwdb_dtype = LNF_FLOAT64;
    if (lnf_backward(&ba) != LNF_OK)
        exit(2);
    if (c->blocked)
        lnf_set_blocked(old[0], old[1], NULL);
    lnf_round_sums(sums, rounded, 2 * D, t);
    free(sums);
    if (get_env() != env || !team_has(flush)) {
        printf("an environment changed: %#llx -> %#llx\n", env, get_env());
        return 1;
    }
    return 0;
}

int main(void)
{
    int bad = 0;
    for (int k = 0; k < 3; k++)
        for (int c = 0; c < 3; c++) {
            const shape *sh = &shapes[c];
            int t = checked[k], ct = compute(t);
            size_t s = itemsize(t), cs = itemsize(ct), n = (size_t)sh->M * sh->D;
            size_t bytes = 2 * n * s + 2 * (size_t)sh->M * cs + 2 * (size_t)sh->D * (cs + s);
            char *x = malloc(n * s), *dy = malloc(n * s), *w = malloc(sh->D * cs);
            char *want = malloc(bytes), *got = malloc(bytes);
            for (int r = 0; r < sh->M; r++)
                for (int i = 0; i < sh->D; i++) {
                    put(x, t, (size_t)r * sh->D + i, value(r, i, 3, t == LNF_FLOAT64));
                    put(dy, t, (size_t)r * sh->D + i, value(r + 16, i + 3, 2, t == LNF_FLOAT64));
                }
            for (int i = 0; i < sh->D; i++)
                put(w, ct, i, 1.0 + i / 64.0);
            for (int j = 0; j < 4 * 2 * 2; j++) {
                int path = j / 4, e = j / 2 % 2, nt = 1 + j % 2;
                lnf_select(path);       /* every instruction set (lnf_select) */
                set_flush(0);
                bad |= run(t, sh, x, dy, w, e ? 1.0 : 0.0, nt, want, 0);
                set_flush(1);
                bad |= run(t, sh, x, dy, w, e ? 1.0 : 0.0, nt, got, 1);
                if (memcmp(want, got, bytes) != 0) {
                    printf("%s %dx%d, eps %d, %d thread(s), %s: other bytes with flush-to-zero\n",
                           names[k], sh->M, sh->D, e, nt, lnf_simd_name());
                    bad = 1;
                }
            }
            lnf_select(LNF_BEST);
            set_flush(0);
            free(x), free(dy), free(w), free(want), free(got);
        }
#ifdef _OPENMP
    printf("%s (OpenMP, %d threads at most)\n", bad ? "DIFFERENT" : "same bytes with flush-to-zero",
           omp_get_max_threads());
#else
    printf("%s (no OpenMP: one thread)\n", bad ? "DIFFERENT" : "same bytes with flush-to-zero");
#endif
    return bad;
}
#else
int main(void)
{
    printf("neither x86-64 nor aarch64: nothing checked\n");
    return 0;
}
#endif
