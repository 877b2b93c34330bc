/* The CPU kernels through their C API alone (src/lnfast/cpu/lnfast_cpu.h),
 * without Python: LayerNorm with a residual and RMSNorm, forward and
 * backward, for every storage type, on every instruction set this CPU
 * has (lnf_select).  Exits 1 when two instruction sets give different
 * bytes, or when the unrounded float64 dweight/dbias (dwdb_dtype
 * LNF_FLOAT64, what lnfast's Dask backend sums over blocks) do not round
 * to the bytes of the call that rounds them itself.  With a file name, writes the inputs and the outputs there, for
 * tests/test_c_api.py to compare with the Python functions:
 *   per dtype: x, r, w, b, then y, z, mean, rstd, dx, dwdb (LayerNorm),
 *   then y, rstd, dx, dwdb (RMSNorm); raw, C order.
 * Built by tests/test_c_api.py (gcc or clang, OpenMP when it has it) and
 * by .ci/run against musl. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"

enum { M = 37, D = 333, NOUT = 10, NPATHS = 4 };
static const char *names[4] = {"float32", "float64", "float16", "bfloat16"};

/* A deterministic value in [-2, 2) stored as type t at p[i]. */
static uint32_t seed = 12345;
static void fill(void *p, int t, size_t n, double scale, double offset)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        put(p, t, i, ((seed >> 8) / 16777216.0 * 4 - 2) * scale + offset);
    }
}

static lnf_array rows(void *p, int t, ptrdiff_t nrows, ptrdiff_t ncols)
{
    lnf_array a;
    ptrdiff_t shape[2] = {nrows, ncols}, strides[2] = {ncols * (ptrdiff_t)itemsize(t), (ptrdiff_t)itemsize(t)};
    if (lnf_array_init(&a, p, t, 2, shape, strides) != LNF_OK)
        exit(2);
    return a;
}

/* The backward `ba` again with float64 dwdb, rounded here to its own
 * dwdb_dtype and to t: the same bytes as the kernel's own rounding. */
static int unrounded_sums_round_alike(const lnf_backward_args *ba, int t, const char *name)
{
    lnf_backward_args a = *ba;
    double *sums = malloc(2 * D * sizeof(double));
    char *dx = malloc((size_t)M * D * itemsize(t)), *own = malloc(2 * D * sizeof(double));
    int bad = 0;
    a.dx = rows(dx, t, M, D);
    a.dwdb = sums, a.dwdb_dtype = LNF_FLOAT64;
    if (lnf_backward(&a) != LNF_OK)
        exit(2);
    for (int k = 0; k < 2 * D; k++) {
        if (ba->dwdb_dtype == LNF_FLOAT32)
            bad |= (float)sums[k] != ((const float *)ba->dwdb)[k];
        else if (ba->dwdb_dtype == LNF_FLOAT64)
            bad |= memcmp(&sums[k], (const double *)ba->dwdb + k, sizeof(double)) != 0;
    }
    if (t == LNF_FLOAT16 || t == LNF_BFLOAT16) {     /* 16-bit dwdb, rounded by the kernel */
        unsigned short mine[2 * D];
        a.dwdb = own, a.dwdb_dtype = t;
        if (lnf_backward(&a) != LNF_OK)
            exit(2);
        lnf_round_sums(sums, mine, 2 * D, t);
        bad |= memcmp(mine, own, sizeof(mine)) != 0;
    }
    if (bad)
        printf("%s: float64 dwdb rounds to other bytes\n", name);
    free(sums), free(dx), free(own);
    return bad;
}

int main(int argc, char **argv)
{
    FILE *f = argc > 1 ? fopen(argv[1], "wb") : NULL;
    int bad = 0;
    for (int k = 0; k < 4; k++) {
        int t = types[k], ct = compute(t);
        size_t s = itemsize(t), cs = itemsize(ct), n = (size_t)M * D;
        void *x = malloc(n * s), *r = malloc(n * s), *w = malloc(D * cs), *b = malloc(D * cs);
        fill(x, t, n, 1.0, 0.5);
        fill(r, t, n, 0.5, 0.0);
        fill(w, ct, D, 0.5, 1.0);
        fill(b, ct, D, 0.5, 0.0);
        size_t sizes[NOUT] = {n * s, n * s, M * cs, M * cs, n * s, 2 * D * cs,
                              n * s, M * cs, n * s, 2 * D * cs};
        char *out[NPATHS][NOUT];
        for (int p = 0; p < NPATHS; p++) {
            lnf_select(p);
            for (int o = 0; o < NOUT; o++)
                out[p][o] = calloc(1, sizes[o]);
            lnf_forward_args fa = {0};
            fa.x = rows(x, t, M, D);
            fa.residual = rows(r, t, M, D);
            fa.z = rows(out[p][1], t, M, D);
            fa.y = rows(out[p][0], t, M, D);
            fa.weight = vector(w, ct, D);
            fa.bias = vector(b, ct, D);
            fa.weight_len = fa.bias_len = D;
            fa.mean = out[p][2];
            fa.rstd = out[p][3];
            fa.M = M, fa.D = D, fa.eps = 1e-5;
            fa.has_residual = 1, fa.centered = 1, fa.nthreads = 2;
            lnf_backward_args ba = {0};
            ba.x = rows(out[p][1], t, M, D);        /* the gradient of z's LayerNorm, */
            ba.dy = rows(r, t, M, D);
            ba.dz = rows(x, t, M, D);               /* plus x as dz */
            ba.dx = rows(out[p][4], t, M, D);
            ba.weight = vector(w, ct, D);
            ba.mean = out[p][2];
            ba.rstd = out[p][3];
            ba.dwdb = out[p][5];
            ba.dwdb_dtype = ct;
            ba.M = M, ba.D = D;
            ba.has_dz = 1, ba.centered = 1, ba.nthreads = 2;
            if (lnf_forward(&fa) != LNF_OK || lnf_backward(&ba) != LNF_OK)
                return 2;
            bad |= unrounded_sums_round_alike(&ba, t, names[k]);
            /* RMSNorm of x: no residual, no bias, no mean */
            fa.has_residual = 0, fa.centered = 0;
            fa.y = rows(out[p][6], t, M, D);
            fa.mean = NULL;
            fa.rstd = out[p][7];
            ba.x = rows(x, t, M, D);
            ba.has_dz = 0, ba.centered = 0;
            ba.dx = rows(out[p][8], t, M, D);
            ba.rstd = out[p][7];
            ba.dwdb = out[p][9];
            if (lnf_forward(&fa) != LNF_OK || lnf_backward(&ba) != LNF_OK)
                return 2;
            for (int o = 0; o < NOUT; o++)
                if (p > 0 && memcmp(out[p][o], out[0][o], sizes[o]) != 0) {
                    printf("%s: output %d differs on path %d\n", names[k], o, p);
                    bad = 1;
                }
        }
        lnf_select(LNF_BEST);
        if (f != NULL) {
            fwrite(x, s, n, f), fwrite(r, s, n, f), fwrite(w, cs, D, f), fwrite(b, cs, D, f);
            for (int o = 0; o < NOUT; o++)
                fwrite(out[0][o], 1, sizes[o], f);
        }
        for (int p = 0; p < NPATHS; p++)
            for (int o = 0; o < NOUT; o++)
                free(out[p][o]);
        free(x), free(r), free(w), free(b);
    }
    if (f != NULL)
        fclose(f);
    printf("%s (%s)\n", bad ? "DIFFERENT" : "same bytes on every path", lnf_simd_name());
    return bad;
}
