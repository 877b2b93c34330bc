/* The C API refuses arguments that do not fit with LNF_EINVAL, before it
 * reads or writes through them: NULL argument blocks, shapes and strides,
 * negative lengths, leading-axis counts set by hand, misaligned mean, rstd
 * and dwdb, row strides that are not whole elements (every row but the
 * first misaligned), unknown dtypes for lnf_round_sums, a dx in place of x
 * or dy; a refused lnf_array_init writes nothing;
 * a D near PTRDIFF_MAX, or lengths and strides whose products overflow,
 * give no arithmetic trap; arrays past a ptrdiff_t's reach are refused;
 * thread counts out of range are clamped.  Built and
 * run by tests/test_c_api.py, with AddressSanitizer and UBSan where the
 * compiler has them. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "lnfast_cpu.h"

enum { M = 6, D = 8 };
static int bad = 0;

static void expect(int got, int want, const char *what)
{
    if (got != want) {
        printf("%s: got %d, expected %d\n", what, got, want);
        bad = 1;
    }
}

static double xs[M * D + 1], ys[M * D + 1], w[D], st[2 * M + 2], dwdb[2 * D + 1];

static lnf_forward_args forward_args(void)
{
    lnf_forward_args f;
    memset(&f, 0, sizeof f);
    ptrdiff_t shape[2] = {M, D}, strides[2] = {D * 8, 8}, vs[1] = {D}, vt[1] = {8};
    lnf_array_init(&f.x, xs, LNF_FLOAT64, 2, shape, strides);
    lnf_array_init(&f.y, ys, LNF_FLOAT64, 2, shape, strides);
    lnf_array_init(&f.weight, w, LNF_FLOAT64, 1, vs, vt);
    f.bias = f.weight;
    f.weight_len = f.bias_len = D;
    f.mean = st, f.rstd = st + M;
    f.M = M, f.D = D, f.eps = 1e-5, f.centered = 1, f.nthreads = 2;
    return f;
}

static lnf_backward_args backward_args(void)
{
    lnf_forward_args f = forward_args();
    lnf_backward_args b;
    memset(&b, 0, sizeof b);
    b.x = f.x, b.dy = f.x, b.dx = f.y, b.weight = f.weight;
    b.mean = st, b.rstd = st + M, b.dwdb = dwdb, b.dwdb_dtype = LNF_FLOAT64;
    b.M = M, b.D = D, b.centered = 1, b.nthreads = 2;
    return b;
}

int main(void)
{
    for (int i = 0; i < M * D; i++)
        xs[i] = (i * 37 % 11) - 5.0;
    for (int i = 0; i < D; i++)
        w[i] = 1.0;
    lnf_array a;
    ptrdiff_t neg[3] = {-2, -3, D}, strides[3] = {3 * D * 8, D * 8, 8};
    expect(lnf_array_init(&a, xs, LNF_FLOAT64, 3, neg, strides), LNF_EINVAL, "negative shape");
    expect(lnf_array_init(&a, xs, LNF_FLOAT64, 2, NULL, NULL), LNF_EINVAL, "NULL shape");
    expect(lnf_array_init(NULL, xs, LNF_FLOAT64, 2, neg + 1, strides + 1), LNF_EINVAL,
           "NULL array");
    {   /* a failed description leaves its lnf_array as it was */
        enum { N = LNF_MAX_LEAD + 3 };
        ptrdiff_t sh[N], stv[N];
        for (int k = 0; k < N; k++)      /* leading axes that do not merge */
            sh[k] = 2, stv[k] = 24 * (ptrdiff_t)(N - k);
        unsigned char before[sizeof a];
        memset(&a, 0xAB, sizeof a);
        memcpy(before, &a, sizeof a);
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, N, sh, stv), LNF_EINVAL,
               "too many leading axes");
        if (memcmp(before, &a, sizeof a) != 0) {
            printf("a refused lnf_array_init wrote its array\n");
            bad = 1;
        }
    }
    expect(lnf_forward(NULL), LNF_EINVAL, "NULL forward arguments");
    expect(lnf_backward(NULL), LNF_EINVAL, "NULL backward arguments");

    lnf_forward_args f = forward_args();
    expect(lnf_forward(&f), LNF_OK, "a good forward call");
    f.x.nd = 1000;
    expect(lnf_forward(&f), LNF_EINVAL, "nd set by hand past LNF_MAX_LEAD");
    f = forward_args();
    f.x.nd = -1;
    expect(lnf_forward(&f), LNF_EINVAL, "negative nd");
    f = forward_args();
    f.mean = (char *)st + 1;
    expect(lnf_forward(&f), LNF_EINVAL, "misaligned mean");
    f = forward_args();
    f.rstd = (char *)(st + M) + 4;
    expect(lnf_forward(&f), LNF_EINVAL, "misaligned rstd");
    f = forward_args();
    f.x.stride[0] = D * 8 - 4;          /* every row after the first misaligned */
    f.M = f.x.shape[0] = 2;
    f.y.shape[0] = 2;
    expect(lnf_forward(&f), LNF_EINVAL, "a row stride of half an element");
    f = forward_args();
    f.y.stride[0] = D * 8 + 2;
    expect(lnf_forward(&f), LNF_EINVAL, "a row stride of y of a quarter element");
    for (int k = 0; k < 4; k++) {       /* clamped, the same bytes */
        static const int counts[4] = {0, -1, INT32_MIN, INT32_MAX};
        double want[M * D];
        f = forward_args();
        f.nthreads = 1;
        lnf_forward(&f);
        memcpy(want, ys, sizeof want);
        f.nthreads = counts[k];
        expect(lnf_forward(&f), LNF_OK, "a thread count out of range");
        if (memcmp(want, ys, sizeof want) != 0) {
            printf("thread count %d: other bytes\n", counts[k]);
            bad = 1;
        }
    }

    lnf_backward_args b = backward_args();
    f = forward_args();
    lnf_forward(&f);
    expect(lnf_backward(&b), LNF_OK, "a good backward call");
    b.dwdb = (char *)dwdb + 1;
    expect(lnf_backward(&b), LNF_EINVAL, "misaligned dwdb");
    b = backward_args();
    b.rstd = (char *)(st + M) + 2;
    expect(lnf_backward(&b), LNF_EINVAL, "misaligned rstd (backward)");
    b = backward_args();
    b.dx = b.x;
    expect(lnf_backward(&b), LNF_EINVAL, "dx in place of x");
    b = backward_args();
    b.dy = b.dx;
    expect(lnf_backward(&b), LNF_EINVAL, "dx in place of dy");
    b = backward_args();
    b.dz = b.dx, b.has_dz = 1;
    expect(lnf_backward(&b), LNF_OK, "dx in place of dz");
    b = backward_args();
    b.nthreads = INT32_MAX;
    expect(lnf_backward(&b), LNF_OK, "a huge thread count (backward)");
    b = backward_args();
    b.D = (ptrdiff_t)1 << 60;       /* refused before any byte count could overflow */
    expect(lnf_backward(&b), LNF_EINVAL, "D of 2**60 (backward)");
    f = forward_args();
    f.D = f.weight_len = f.bias_len = PTRDIFF_MAX;
    expect(lnf_forward(&f), LNF_EINVAL, "D of PTRDIFF_MAX (forward)");
    if (lnf_num_chunks(1, (ptrdiff_t)1 << 60) < 1 || lnf_num_chunks(1 << 20, PTRDIFF_MAX) < 1) {
        printf("lnf_num_chunks of a huge D\n");
        bad = 1;
    }
    if (lnf_num_chunks(PTRDIFF_MAX, 1) != LNF_MAX_CHUNKS || lnf_num_chunks(PTRDIFF_MAX - 1, 8) < 1) {
        printf("lnf_num_chunks of a huge M\n");
        bad = 1;
    }
    if (!lnf_streamed(PTRDIFF_MAX / 4, 8, PTRDIFF_MAX) || lnf_streamed(-1, 8, PTRDIFF_MAX)) {
        printf("lnf_streamed of a huge or negative D\n");
        bad = 1;
    }

    /* Arrays past a ptrdiff_t's reach; and strides whose products with the
     * lengths overflow though the array fits. */
    {
        ptrdiff_t big = (ptrdiff_t)1 << 40, top = PTRDIFF_MAX / 2 + 1;
        ptrdiff_t sh[3] = {big, big, D}, stv[3] = {8, 8, 8};
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, 3, sh, stv), LNF_EINVAL,
               "2**80 elements");
        ptrdiff_t sh2[2] = {4, D}, st2[2] = {top, 8};
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, 2, sh2, st2), LNF_EINVAL,
               "3 (2**62) bytes from the first row to the last");
        ptrdiff_t sh3[2] = {3, D}, st3[2] = {PTRDIFF_MIN, 8};
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, 2, sh3, st3), LNF_EINVAL,
               "a stride of PTRDIFF_MIN");
        sh3[0] = 1;                     /* (a single element's stride addresses nothing) */
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, 2, sh3, st3), LNF_OK,
               "a stride of PTRDIFF_MIN along one element");
        ptrdiff_t sh4[4] = {2, 2, 0, D}, st4[4] = {16, top, 8, 8};
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, 4, sh4, st4), LNF_OK,
               "an empty array whose stride times length overflows");
        ptrdiff_t sh5[3] = {2, 2, D}, st5[3] = {16, top, 8};
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, 3, sh5, st5), LNF_OK,
               "rows 2**62 bytes apart");
        if (a.nd != 2) {
            printf("axes whose strides do not merge were merged\n");
            bad = 1;
        }
        ptrdiff_t sh6[3] = {3, 2, D}, st6[3] = {2 * D * 8, D * 8, 8};
        expect(lnf_array_init(&a, xs, LNF_FLOAT64, 3, sh6, st6), LNF_OK, "mergeable axes");
        if (a.nd != 1 || a.shape[0] != 6 || a.stride[0] != D * 8) {
            printf("contiguous leading axes were not merged\n");
            bad = 1;
        }
        f = forward_args();         /* lengths set by hand whose product overflows */
        f.x.nd = 2;
        f.x.shape[0] = (ptrdiff_t)1 << 62, f.x.shape[1] = 4 * M + 1;
        f.x.stride[0] = f.x.stride[1] = 0;
        expect(lnf_forward(&f), LNF_EINVAL, "leading lengths whose product overflows");
    }
    b = backward_args();
    f = forward_args();
    f.centered = b.centered = 0;
    lnf_forward(&f);
    b.mean = (char *)st + 3;
    expect(lnf_backward(&b), LNF_OK, "RMSNorm with a misaligned mean it does not read");
    b.mean = NULL;
    expect(lnf_backward(&b), LNF_OK, "RMSNorm without mean");
    {   /* column blocks of PTRDIFF_MAX columns (lnf_set_blocked, for tests) */
        ptrdiff_t old[2];
        lnf_set_blocked(0, PTRDIFF_MAX, old);
        b = backward_args();
        expect(lnf_backward(&b), LNF_OK, "a column block of PTRDIFF_MAX");
        lnf_set_blocked(old[0], old[1], NULL);
    }

    uint16_t out16[4];
    double sums[4] = {1.0, -2.0, 0.5, 3.0};
    expect(lnf_round_sums(sums, out16, 4, 7), LNF_EINVAL, "lnf_round_sums of dtype 7");
    expect(lnf_round_sums(sums, out16, 4, -1), LNF_EINVAL, "lnf_round_sums of dtype -1");
    expect(lnf_round_sums(sums, out16, -1, LNF_BFLOAT16), LNF_EINVAL, "lnf_round_sums of n -1");
    expect(lnf_round_sums(sums, (char *)out16 + 1, 2, LNF_BFLOAT16), LNF_EINVAL,
           "lnf_round_sums into a misaligned output");
    expect(lnf_round_sums(sums, out16, 4, LNF_BFLOAT16), LNF_OK, "lnf_round_sums");
    printf("%s\n", bad ? "WRONG" : "every bad argument refused");
    return bad;
}
