/* The forward's tiles taken two at once give the bits of tiles taken one
 * at a time (docs/design.md, "Rows far apart"), through the C API: a
 * channels-first (N, C, H, W) array normalized over C, outputs (y, z, dx)
 * once in x's layout, where the forward pairs full tiles of a run, and
 * once channels-last, where every tile runs alone on copies (the outputs'
 * layout changes no bit; the backward's dx and dweight/dbias too, whose
 * runs of 16 tiles end inside runs of rows: 72 rows, four full tiles and
 * one of 8, or 64, in one chunk).  Every storage type and instruction
 * set, x and dy 16 bytes into a cache line (the backward's carry), with a
 * residual and dz, LayerNorm and RMSNorm, rows redone in float64 in both
 * tiles of a pair, 1 and 3 threads (the third starting at tile 1 of a run
 * of 72 rows).  Exits 1 on any difference.  Built by tests/test_c_api.py. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check_util.h"

enum { N = 5, C = 40, H = 8 };
static ptrdiff_t W, HW, M, SIZE;     /* W: 9 or 8 */
static uint32_t seed = 777;

/* Values in [-2, 2) * scale + offset with all of float64's digits (so that
 * sums of them round, whatever their order). */
static void fill(void *p, int t, size_t n, double scale, double offset)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        double hi = seed >> 5;
        seed = seed * 1664525u + 1013904223u;
        double u = (hi * 67108864.0 + (seed >> 6)) / 9007199254740992.0;
        put(p, t, i, (u * 4 - 2) * scale + offset);
    }
}

/* The rows (n, h, w) of an (N, C, H, W) array over C, channels-first (as
 * x) or channels-last (last: element (n, c, h, w) at ((n H + h) W + w) C + c). */
static lnf_array rows(void *p, int t, int last)
{
    lnf_array a;
    ptrdiff_t s = (ptrdiff_t)itemsize(t), shape[4] = {N, H, W, C};
    ptrdiff_t first[4] = {C * HW * s, W * s, s, HW * s};
    ptrdiff_t other[4] = {C * HW * s, W * C * s, C * s, s};
    if (lnf_array_init(&a, p, t, 4, shape, last ? other : first) != LNF_OK)
        exit(2);
    return a;
}

/* Element (n, c, h, w) of a channels-first array, and of a channels-last one. */
static size_t at_first(size_t n, size_t c, size_t hw) { return (n * C + c) * HW + hw; }
static size_t at_last(size_t n, size_t c, size_t hw) { return (n * HW + hw) * C + c; }

static int same_values(const char *a, const char *b, size_t s)
{
    for (size_t n = 0; n < N; n++)
        for (size_t c = 0; c < C; c++)
            for (size_t hw = 0; hw < HW; hw++)
                if (memcmp(a + at_first(n, c, hw) * s, b + at_last(n, c, hw) * s, s) != 0)
                    return 0;
    return 1;
}

/* 16 bytes into a 64-byte line. */
static void *off16(size_t bytes)
{
    char *p = aligned_alloc(64, bytes + 64);
    return p == NULL ? NULL : p + 16;
}

int main(void)
{
    int bad = 0;
    for (W = 9; W >= 8; W--)
    for (int k = 0; k < 4; k++) {
        HW = H * W, M = N * HW, SIZE = N * C * HW;
        int t = types[k], ct = compute(t);
        size_t s = itemsize(t), cs = itemsize(ct), bytes = SIZE * s;
        char *x = off16(bytes), *r = off16(bytes), *dy = off16(bytes), *dz = off16(bytes);
        char *w = malloc(C * cs), *b = malloc(C * cs);
        fill(x, t, SIZE, 1.0, 0.5);
        fill(r, t, SIZE, 0.5, 0.0);
        fill(dy, t, SIZE, 1.0, 0.0);
        fill(dz, t, SIZE, 1.0, 0.0);
        fill(w, ct, C, 0.5, 1.0);
        fill(b, ct, C, 0.5, 0.0);
        /* rows redone in float64 (squares that underflow or overflow the
         * compute type): rows 3 and 20 of run 0 (tiles 0 and 1), row 35 of
         * run 3 (tile 2) */
        double tiny = t == LNF_FLOAT64 ? 1e-300 : t == LNF_FLOAT32 ? 1e-40 : 0;
        double huge = t == LNF_BFLOAT16 ? 1e37 : 0;
        for (size_t c = 0; c < C && (tiny || huge); c++) {
            size_t at[3] = {at_first(0, c, 3), at_first(0, c, 20), at_first(3, c, 35)};
            for (int q = 0; q < 3; q++) {
                put(x, t, at[q], (tiny + huge) * ((double)((c + q) % 7) - 3.0));
                put(r, t, at[q], 0.0);      /* (z = x there: the same rows redone) */
            }
        }
        for (int isa = LNF_BEST; isa <= LNF_BASELINE; isa++) {
            lnf_select(isa);
            for (int threads = 1; threads <= 3; threads += 2)
                for (int centered = 0; centered < 2; centered++) {
                    char *out[2][6];        /* per layout: y, z, mean, rstd, dx, dwdb */
                    for (int last = 0; last < 2; last++) {
                        char **o = out[last];
                        o[0] = malloc(bytes), o[1] = malloc(bytes), o[4] = malloc(bytes);
                        o[2] = malloc(M * cs), o[3] = malloc(M * cs), o[5] = calloc(2 * C, cs);
                        lnf_forward_args fa = {0};
                        fa.x = rows(x, t, 0);
                        fa.residual = rows(r, t, 0);
                        fa.z = rows(o[1], t, last);
                        fa.y = rows(o[0], t, last);
                        fa.weight = vector(w, ct, C), fa.bias = vector(b, ct, C);
                        fa.weight_len = fa.bias_len = C;
                        fa.mean = o[2], fa.rstd = o[3];
                        fa.M = M, fa.D = C, fa.eps = 1e-5;
                        fa.has_residual = centered, fa.centered = centered;
                        fa.nthreads = threads;
                        lnf_backward_args ba = {0};
                        ba.x = rows(x, t, 0);
                        ba.dy = rows(dy, t, 0);
                        ba.dz = rows(dz, t, 0);
                        ba.dx = rows(o[4], t, last);
                        ba.weight = vector(w, ct, C);
                        ba.mean = o[2], ba.rstd = o[3];
                        ba.dwdb = o[5], ba.dwdb_dtype = ct;
                        ba.M = M, ba.D = C, ba.nchunks = 1;
                        ba.has_dz = centered, ba.centered = centered, ba.nthreads = threads;
                        if (lnf_forward(&fa) != LNF_OK || lnf_backward(&ba) != LNF_OK)
                            return 2;
                    }
                    int ok = same_values(out[0][0], out[1][0], s)
                             && (!centered || same_values(out[0][1], out[1][1], s))
                             && memcmp(out[0][2], out[1][2], M * cs) == 0
                             && memcmp(out[0][3], out[1][3], M * cs) == 0
                             && same_values(out[0][4], out[1][4], s)
                             && memcmp(out[0][5], out[1][5], 2 * C * cs) == 0;
                    if (!ok) {
                        printf("type %d, %s, %d threads, centered %d, W %td: outputs in "
                               "x's layout differ from channels-last ones\n", t,
                               lnf_simd_name(), threads, centered, W);
                        bad = 1;
                    }
                    for (int last = 0; last < 2; last++)
                        for (int q = 0; q < 6; q++)
                            free(out[last][q]);
                }
        }
        free(x - 16), free(r - 16), free(dy - 16), free(dz - 16), free(w), free(b);
    }
    return bad;
}
