/* Row primitives of the CPU kernels: the inner loops, for one row.
 *
 * This file is a template: rowops_all.h includes it once per element type,
 * with LNF_T (float or double) and LNF_SUFFIX (f32 or f64) defined.  The
 * Cython drivers in _cpu.pyx call these functions per row.
 *
 * Sums are float64 in LNF_LANES lanes: lane k adds the elements k, k + LANES,
 * k + 2 LANES, ... in order, then the lanes are folded pairwise and the
 * n % LANES tail, summed on its own, is added last.  The GCC/clang vector
 * code and the plain C fallback follow exactly this order, so every build
 * and every instruction set gives the same bits.
 */
#define LNF_CAT_(a, b) a##_##b
#define LNF_CAT(a, b) LNF_CAT_(a, b)
#define LNF_FN(name) LNF_CAT(name, LNF_SUFFIX)

#if LNF_VECTOR
/* LNF_T vectors of 8 elements, loaded without alignment requirements.
 * Macros, not functions: wide vectors may not cross a call in the baseline
 * (SSE2) build. */
typedef LNF_T LNF_CAT(lnf_v8, LNF_SUFFIX) __attribute__((vector_size(8 * sizeof(LNF_T))));
#define LNF_VT LNF_CAT(lnf_v8, LNF_SUFFIX)
#define LNF_LOAD(p) ({ LNF_VT v_; memcpy(&v_, (p), sizeof v_); v_; })
#define LNF_WIDEN(v) __builtin_convertvector((v), lnf_vd)
#endif

/* s1 = sum(x - shift), s2 = sum((x - shift)^2), in float64. */
LNF_DISPATCH static void LNF_FN(lnf_row_sums)(const LNF_T *x, ptrdiff_t n, double shift,
                                              double *s1_out, double *s2_out)
{
    double s1[LNF_LANES] = {0}, s2[LNF_LANES] = {0}, t1 = 0.0, t2 = 0.0;
    ptrdiff_t i = 0, body = n - n % LNF_LANES;
#if LNF_VECTOR
    lnf_vd a[LNF_LANES / 8], b[LNF_LANES / 8];
    const lnf_vd sh = shift - (lnf_vd){0};
    for (int v = 0; v < LNF_LANES / 8; v++)
        a[v] = b[v] = (lnf_vd){0};
    for (; i < body; i += LNF_LANES)
        for (int v = 0; v < LNF_LANES / 8; v++) {
            lnf_vd d = LNF_WIDEN(LNF_LOAD(x + i + 8 * v)) - sh;
            a[v] += d;
            b[v] += d * d;
        }
    memcpy(s1, a, sizeof s1);
    memcpy(s2, b, sizeof s2);
#else
    for (; i < body; i += LNF_LANES)
        for (int k = 0; k < LNF_LANES; k++) {
            double d = (double)x[i + k] - shift;
            s1[k] += d;
            s2[k] += d * d;
        }
#endif
    for (; i < n; i++) {
        double d = (double)x[i] - shift;
        t1 += d;
        t2 += d * d;
    }
    *s1_out = lnf_fold(s1) + t1;
    *s2_out = lnf_fold(s2) + t2;
}

/* Row maps take the next row's inputs, pa and pb (either may be NULL), and
 * prefetch one cache line of each per line of output: the next row streams
 * in from memory while this one computes, instead of after it. */
#define LNF_LINE ((ptrdiff_t)(64 / sizeof(LNF_T)))
#define LNF_MAP_PREFETCHING(n, pa, pb, BODY)                      \
    do {                                                          \
        ptrdiff_t i_ = 0;                                         \
        if ((pa) != NULL)                                         \
            for (; i_ + LNF_LINE <= (n); i_ += LNF_LINE) {        \
                LNF_PREFETCH((pa) + i_);                          \
                if ((pb) != NULL)                                 \
                    LNF_PREFETCH((pb) + i_);                      \
                LNF_IVDEP                                         \
                for (ptrdiff_t j = i_; j < i_ + LNF_LINE; j++)    \
                    BODY(j);                                      \
            }                                                     \
        LNF_IVDEP                                                 \
        for (ptrdiff_t j = i_; j < (n); j++)                      \
            BODY(j);                                              \
    } while (0)

/* y = ((x - hi) - lo) * rs * w + b.  y may be x itself (in place): each
 * element is read before it is written, so ivdep is safe. */
LNF_DISPATCH static void LNF_FN(lnf_row_normalize)(const LNF_T *x, LNF_T *y,
                                                   const LNF_T *__restrict w,
                                                   const LNF_T *__restrict b, ptrdiff_t n,
                                                   LNF_T hi, LNF_T lo, LNF_T rs,
                                                   const LNF_T *pa, const LNF_T *pb)
{
#define LNF_NORMALIZE(i) y[i] = ((x[i] - hi) - lo) * rs * w[i] + b[i]
    LNF_MAP_PREFETCHING(n, pa, pb, LNF_NORMALIZE);
#undef LNF_NORMALIZE
}

/* RMSNorm: y = x * rs * w. */
LNF_DISPATCH static void LNF_FN(lnf_row_scale)(const LNF_T *x, LNF_T *y,
                                               const LNF_T *__restrict w, ptrdiff_t n,
                                               LNF_T rs, const LNF_T *pa, const LNF_T *pb)
{
#define LNF_SCALE(i) y[i] = x[i] * rs * w[i]
    LNF_MAP_PREFETCHING(n, pa, pb, LNF_SCALE);
#undef LNF_SCALE
}

/* The backward pass's row sums, with d = x - mean and g = dy * w computed
 * in LNF_T: sd = sum(d), sg = sum(g), sgd = sum(g * d), in float64. */
LNF_DISPATCH static void LNF_FN(lnf_row_grad_sums)(const LNF_T *x, const LNF_T *dy,
                                                   const LNF_T *w, ptrdiff_t n, LNF_T mean,
                                                   double *out)
{
    double sd[LNF_LANES] = {0}, sg[LNF_LANES] = {0}, sgd[LNF_LANES] = {0};
    double td = 0.0, tg = 0.0, tgd = 0.0;
    ptrdiff_t i = 0, body = n - n % LNF_LANES;
#if LNF_VECTOR
    lnf_vd a[LNF_LANES / 8], b[LNF_LANES / 8], c[LNF_LANES / 8];
    const LNF_VT m = mean - (LNF_VT){0};
    for (int v = 0; v < LNF_LANES / 8; v++)
        a[v] = b[v] = c[v] = (lnf_vd){0};
    for (; i < body; i += LNF_LANES)
        for (int v = 0; v < LNF_LANES / 8; v++) {
            ptrdiff_t j = i + 8 * v;
            lnf_vd d = LNF_WIDEN(LNF_LOAD(x + j) - m);
            lnf_vd g = LNF_WIDEN(LNF_LOAD(dy + j) * LNF_LOAD(w + j));
            a[v] += d;
            b[v] += g;
            c[v] += g * d;
        }
    memcpy(sd, a, sizeof sd);
    memcpy(sg, b, sizeof sg);
    memcpy(sgd, c, sizeof sgd);
#else
    for (; i < body; i += LNF_LANES)
        for (int k = 0; k < LNF_LANES; k++) {
            LNF_T d = x[i + k] - mean, g = dy[i + k] * w[i + k];
            sd[k] += d;
            sg[k] += g;
            sgd[k] += (double)g * d;
        }
#endif
    for (; i < n; i++) {
        LNF_T d = x[i] - mean, g = dy[i] * w[i];
        td += d;
        tg += g;
        tgd += (double)g * d;
    }
    out[0] = lnf_fold(sd) + td;
    out[1] = lnf_fold(sg) + tg;
    out[2] = lnf_fold(sgd) + tgd;
}

/* dx = rstd * ((dy * w - mg) - xhat * mgx) with xhat = ((x - mean) - c) * rstd;
 * dw += dy * xhat and db += dy in float64 (db may be NULL: RMSNorm). */
LNF_DISPATCH static void LNF_FN(lnf_row_grad)(const LNF_T *__restrict x,
                                              const LNF_T *__restrict dy,
                                              const LNF_T *__restrict w, LNF_T *__restrict dx,
                                              double *__restrict dw, double *__restrict db,
                                              ptrdiff_t n, LNF_T mean, LNF_T c, LNF_T rstd,
                                              LNF_T mg, LNF_T mgx, const LNF_T *pa,
                                              const LNF_T *pb)
{
#define LNF_XHAT(i) (((x[i] - mean) - c) * rstd)
#define LNF_GRAD(i)                                              \
    do {                                                         \
        LNF_T xh = LNF_XHAT(i);                                  \
        dx[i] = rstd * ((dy[i] * w[i] - mg) - xh * mgx);         \
        dw[i] += (double)dy[i] * xh;                             \
    } while (0)
#define LNF_GRAD_BIAS(i) do { LNF_GRAD(i); db[i] += dy[i]; } while (0)
    if (db != NULL)
        LNF_MAP_PREFETCHING(n, pa, pb, LNF_GRAD_BIAS);
    else
        LNF_MAP_PREFETCHING(n, pa, pb, LNF_GRAD);
#undef LNF_GRAD_BIAS
#undef LNF_GRAD
#undef LNF_XHAT
}

/* out = a + b (out may be a or b). */
LNF_DISPATCH static void LNF_FN(lnf_row_add)(const LNF_T *a, const LNF_T *b, LNF_T *out,
                                             ptrdiff_t n)
{
    LNF_IVDEP
    for (ptrdiff_t i = 0; i < n; i++)
        out[i] = a[i] + b[i];
}

#undef LNF_VT
#undef LNF_LOAD
#undef LNF_WIDEN
#undef LNF_LINE
#undef LNF_MAP_PREFETCHING
#undef LNF_FN
#undef LNF_CAT
#undef LNF_CAT_
