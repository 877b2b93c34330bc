/* The forward rows, for arithmetic in REAL (float or double; forward.c
 * includes this once for each).  Functions are named with the suffix _f32
 * or _f64 (F). */
#if REAL_F64
#define F(name) name##_f64
#else
#define F(name) name##_f32
#endif

/* row_stats: k = {hi, lo, rstd} of a row from its sums s over x - s[2]
 * (RMSNorm: over x); 0 for the rare rows that row_exact must redo.  In two
 * steps: row_moments (the divisions and the square root), then row_ok and
 * row_k.
 *
 * LayerNorm sums run over x - shift, the mean of the row's first few
 * values (row_shift): shifting by a value near the row's keeps the sums of
 * the size of the row's spread rather than its offset (and the differences
 * of nearby values exact), so the cancellation in
 * S2/D - (S1/D)^2 costs at most ~D ulps of float64 (typically one) -- not
 * the textbook E[x^2] - E[x]^2 in working precision, which returns garbage
 * for rows like [40000, 40001, 40002, 40003].  The float64 mean is then
 * applied as hi + lo of type REAL: x - hi is exact for x near the mean, so
 * float32 rows with a large common offset keep the digits that a float32
 * mean would round away; lo also carries the rounding error of the float64
 * mean's own last addition (TwoSum), which float64 rows with a large offset
 * need.  RMSNorm sums x^2 without a shift. */
static inline void F(row_moments)(double s0, double s1, double D, double eps, int centered,
                                  double *mean, double *var, double *rstd)
{
    double q = s0 / D;      /* (divided whether used or not: straight-line code) */
    double m = centered ? q : 0.0;
    double v = s1 / D - m * m;
    v = v < 0.0 ? 0.0 : v;      /* clamp rounding below zero; NaN stays */
    *mean = m;
    *var = v;
    *rstd = 1.0 / sqrt(v + eps);
}

/* Whether a row's sums s0, s1 and row_moments (var, rstd) serve: squares
 * in the working type, so a row whose variance is below its floor may
 * have lost squares to underflow (rows whose sums are exactly zero,
 * constant rows among them, only matter where eps does not swamp that),
 * and one near the type's top may have overflowed; such rows, and float32
 * rows whose deviations or rstd leave float32's range, are redone
 * (row_exact).  NaN rows are redone too, and stay NaN. */
static inline int F(row_ok)(double s0, double s1, double D, double eps, double var,
                            double rstd)
{
    /* (& and |, not && and ||: no branches, so that tile_stats' loop
     * takes it a vector of lanes at a time) */
    double floor = REAL_F64 ? LNF_VAR_FLOOR_F64 : LNF_VAR_FLOOR_F32;
    int ok = ((var >= floor) | ((s0 == 0.0) & (s1 == 0.0) & (eps >= floor))) & (s1 < 1e300);
    return ok & (REAL_F64 | ((D * var < 1e72) & (1e-30 < rstd) & (rstd < 1e30)));
}

/* k = {hi, lo, rstd} from row_moments' mean (of x - shift) and rstd. */
static inline void F(row_k)(double shift, double mean, double rstd, REAL *k)
{
    double hi = mean + shift, t = hi - shift;
    double err = (shift - (hi - t)) + (mean - t);   /* hi + err == shift + mean exactly */
    k[0] = (REAL)hi;
    k[1] = (REAL)((hi - (double)k[0]) + err);
    k[2] = (REAL)rstd;
}

static inline int F(row_stats)(const double *s, ptrdiff_t D, double eps, int centered, REAL *k)
{
    double mean, var, rstd;
    F(row_moments)(s[0], s[1], (double)D, eps, centered, &mean, &var, &rstd);
    if (!F(row_ok)(s[0], s[1], (double)D, eps, var, rstd))
        return 0;
    F(row_k)(s[2], mean, rstd, k);
    return 1;
}

/* Whether a LayerNorm row of mean m (about its shift) and variance var is
 * to be summed again about its mean (var clamped at 0 or not: the same
 * answer, as var < 0 means m != 0). */
static inline int F(far_shift)(double m, double var)
{
    return m * m > LNF_RESHIFT * var;
}

/* row_moments and row_k of a tile's LNF_TILE lanes (sums s[j], s[T + j],
 * shift s[2 T + j]; k[j], k[T + j], k[2 T + j]; mean, var and rstd for
 * resum_far_tile and row_ok): the divisions, square roots and conversions
 * of short rows far apart cost as much as their sums one lane at a time;
 * in a loop of their own they take several lanes per instruction (built
 * for each instruction set, LNF_CLONES).  Returns LNF_TILE_HARD where
 * row_ok turns a lane down, LNF_TILE_FAR where a LayerNorm lane's shift
 * was far (far_shift), or both, so that the driver tests the rows one at
 * a time only where one may fail.  (Lanes past a short tile's rows count
 * too.) */
#ifndef LNF_TILE_HARD
#define LNF_TILE_HARD 1
#define LNF_TILE_FAR 2
#endif
LNF_CLONES static int F(tile_stats)(const double *__restrict s, double D, double eps,
                                    int centered, REAL *__restrict k, double *__restrict mean,
                                    double *__restrict var, double *__restrict rstd)
{
    enum { T = LNF_TILE };
    int64_t hard = 0, far = 0;  /* (as wide as the lanes: GCC then vectorizes the tests) */
    for (int j = 0; j < T; j++) {
        REAL kj[3];
        F(row_moments)(s[j], s[T + j], D, eps, centered, &mean[j], &var[j], &rstd[j]);
        F(row_k)(s[2 * T + j], mean[j], rstd[j], kj);
        k[j] = kj[0];
        k[T + j] = kj[1];
        k[2 * T + j] = kj[2];
    }
    /* (A loop of its own: in the one above, GCC threads the tests through
     * var's clamp at 0, and that control flow stops it vectorizing.) */
    for (int j = 0; j < T; j++) {
        hard |= !F(row_ok)(s[j], s[T + j], D, eps, var[j], rstd[j]);
        far |= centered & F(far_shift)(mean[j], var[j]);
    }
    return (hard ? LNF_TILE_HARD : 0) | (far ? LNF_TILE_FAR : 0);
}

/* Sum a LayerNorm row again, about its mean, where the sums s (about s[2])
 * say the shift was far from it (LNF_RESHIFT): each square (x - shift)^2 is
 * rounded in the working type, an error that the cancellation in
 * S2/D - (S1/D)^2 magnifies by 1 + (S1/D)^2 / var. */
static inline void F(resum_far_shift)(const lnf_row_ops *ops, const void *row, double *s,
                                      ptrdiff_t D, int centered)
{
    double m = s[0] / D;
    if (centered && F(far_shift)(m, s[1] / D - m * m))
        ops->sums(row, NULL, NULL, 2, (REAL)(s[2] + m), s, D, NULL, NULL);
}

/* A row past row_stats' limits, every term in float64: the deviations
 * d = x - x[0] (RMSNorm: x) scaled by the power of two sc that brings the
 * largest near 1 (or as near as float64 allows), so that no square
 * overflows or underflows, and two passes (the mean of d, then the sums
 * about it).  Any finite row at the cost of four reads.  k = {mean, 0,
 * rstd} as stored.  wp, bp: the lengths of w and b (stand-ins repeat). */
static void F(row_exact)(const REAL *x, REAL *y, const REAL *w, const REAL *b, ptrdiff_t D,
                         double eps, int centered, REAL *k, ptrdiff_t wp, ptrdiff_t bp)
{
    double pre = 1.0;   /* 1/2 where x - x[0] could overflow: x / 2 is exact there */
    for (ptrdiff_t j = 0; j < D; j++)
        if (ldexp(1.0, 1022) < fabs((double)x[j]) && fabs((double)x[j]) <= DBL_MAX)
            pre = 0.5;
    eps = eps * pre * pre;
    double shift = (centered ? (double)x[0] : 0.0) * pre;
    double big = 0.0, sc = 1.0, m = 0.0, s1 = 0.0, s2 = 0.0, d, var, rs, rstd;
    int e, esc = 0;     /* sc = 2**esc */
    for (ptrdiff_t i = 0; i < D; i++) {
        d = fabs((double)x[i] * pre - shift);
        if (big < d && d <= DBL_MAX)
            big = d;
    }
    if (big > 0.0) {
        frexp(big, &e);
        esc = e > -1022 ? -e : 1022;                /* (2**1024 overflows) */
        sc = ldexp(1.0, esc);
    }
    if (centered) {
        for (ptrdiff_t i = 0; i < D; i++)
            m += ((double)x[i] * pre - shift) * sc;
        m /= D;
    }
    for (ptrdiff_t i = 0; i < D; i++) {
        d = ((double)x[i] * pre - shift) * sc - m;
        s1 += d;
        s2 += d * d;
    }
    m += centered ? s1 / D : 0.0;
    var = centered ? s2 / D - (s1 / D) * (s1 / D) : s2 / D;
    var = var < 0.0 ? 0.0 : var;
    /* rstd = 1 / sqrt(var / sc^2 + eps) and y = (x - mean) rstd = (d sc - m) rs
     * with rs = rstd / sc, from the scaled variance unless eps sc^2 overflows;
     * there rstd / sc can underflow, so that y is (d sc - m) rstd w / sc with
     * the powers of two of rstd, w and 1 / sc applied last, once (the GPU's
     * row_exact does the same). */
    int apart = !(eps * sc * sc <= DBL_MAX), er = 0;
    if (!apart) {
        rs = 1.0 / sqrt(var + eps * sc * sc);
        rstd = rs * sc * pre;
    } else {
        rstd = 1.0 / sqrt(var / sc / sc + eps);
        rs = frexp(rstd, &er);  /* rstd's fraction */
        rstd *= pre;
    }
    for (ptrdiff_t i = 0; i < D; i++) {
        d = ((double)x[i] * pre - shift) * sc - m;
        d = apart ? scaled_product(d * rs, w[i % wp], er - esc) : d * rs * w[i % wp];
        y[i] = (REAL)(centered ? d + b[i % bp] : d);
    }
    k[0] = (REAL)((shift + m / sc) / pre);
    k[1] = 0;
    k[2] = (REAL)rstd;
}

/* Row r by row_exact, gathered into the thread's rows (2) where not
 * contiguous in the compute type. */
static void F(forward_exact)(const lnf_fwd *f, const REAL *w, const REAL *b, ptrdiff_t r,
                             REAL *k, lnf_scratch *sc)
{
    const lnf_forward_args *a = f->a;
    REAL *buf = sc->rows;
    if (f->direct && !lnf_native(&a->x)) {
        buf = lnf_rare_rows(sc, 2 * (size_t)a->D * sizeof(REAL));
        if (buf == NULL) {
            k[0] = k[1] = k[2] = 0;
            return;
        }
    }
    REAL *ybuf = buf != NULL ? buf + a->D : NULL;
    const REAL *xr = lnf_load_row(a->has_residual ? &a->z : &a->x, r, a->D, buf, sizeof(REAL));
    REAL *yr = lnf_out_row(&a->y, r, ybuf, sizeof(REAL));
    F(row_exact)(xr, yr, w, b, a->D, a->eps, a->centered, k, f->wp, f->bp);
    if (yr == ybuf)
        lnf_store_row(&a->y, r, a->D, yr, sizeof(REAL));
}

/* y = the normalized row x (k: hi, lo, rstd), in pieces of
 * LNF_CONSTANT_MAX_D columns where the weight or bias is a stand-in of that
 * length (the map is elementwise: the same bits as in one piece); isz:
 * bytes per stored value. */
static inline void F(map_row)(const lnf_fwd *f, const lnf_row_ops *ops, ptrdiff_t isz,
                              const void *x, void *y, const REAL *w, const REAL *b,
                              const REAL *k)
{
    ptrdiff_t D = f->a->D, piece = LNF_MIN(f->wp, f->bp);
    for (ptrdiff_t j = 0, n; j < D; j += n) {
        n = LNF_MIN(piece, D - j);
        ops->map((const char *)x + j * isz, (char *)y + j * isz, w + (f->wp == D ? j : 0),
                 f->a->centered ? b + (f->bp == D ? j : 0) : NULL, k, n, f->stream);
    }
}

/* Rows r0..r1-1 of direct arrays, software-pipelined: one sweep
 * normalizes row r and sums row r + 1 (forming z = x + residual of row
 * r + 1), so reading the next row overlaps writing this one; the rare rows
 * go to forward_exact. */
static void F(forward_block)(const lnf_fwd *f, const REAL *w, const REAL *b, REAL *mean_out,
                             REAL *rstd_out, ptrdiff_t r0, ptrdiff_t r1, lnf_scratch *sc)
{
    const lnf_forward_args *a = f->a;
    const lnf_row_ops *ops = f->kx->ops;
    const lnf_array *in = a->has_residual ? &a->z : &a->x;
    ptrdiff_t D = a->D, isz = lnf_native(&a->x) ? (ptrdiff_t)sizeof(REAL) : 2;
    int res = a->has_residual, c = a->centered;
    double s[3], sn[3] = {0.0, 0.0, 0.0};   /* (the last row has no next row to sum) */
    REAL k[3];
    ops->sums(lnf_row(&a->x, r0), lnf_row_or_null(&a->residual, r0, r1, res),
              (void *)lnf_row_or_null(&a->z, r0, r1, res), c, 0, s, D, NULL, NULL);
    for (ptrdiff_t r = r0; r < r1; r++) {
        F(resum_far_shift)(ops, lnf_row(in, r), s, D, c);
        int ok = F(row_stats)(s, D, a->eps, c, k);
        if (ok && f->wp == D && f->bp == D) {
            ops->map_sums(lnf_row(in, r), lnf_row(&a->y, r), w, c ? b : NULL, k,
                          lnf_row_or_null(&a->x, r + 1, r1, 1),
                          lnf_row_or_null(&a->residual, r + 1, r1, res),
                          (void *)lnf_row_or_null(&a->z, r + 1, r1, res), c, sn, D,
                          lnf_row_or_null(&a->x, r + 2, r1, 1),
                          lnf_row_or_null(&a->residual, r + 2, r1, res), f->stream);
        } else {
            if (ok)     /* (a stand-in weight or bias: by pieces) */
                F(map_row)(f, ops, isz, lnf_row(in, r), lnf_row(&a->y, r), w, b, k);
            else
                F(forward_exact)(f, w, b, r, k, sc);
            if (r + 1 < r1)
                ops->sums(lnf_row(&a->x, r + 1), lnf_row_or_null(&a->residual, r + 1, r1, res),
                          (void *)lnf_row_or_null(&a->z, r + 1, r1, res), c, 0, sn, D, NULL,
                          NULL);
        }
        if (mean_out != NULL)
            mean_out[r] = k[0];
        if (rstd_out != NULL)
            rstd_out[r] = k[2];
        memcpy(s, sn, sizeof s);
    }
}

/* Row r of arrays with some rows strided or of another dtype: rows are
 * gathered into the thread's rows (4) in the compute type and stored
 * back.  The same arithmetic as forward_block, one pass after another. */
static void F(forward_row)(const lnf_fwd *f, const REAL *w, const REAL *b, REAL *mean_out,
                           REAL *rstd_out, ptrdiff_t r, lnf_scratch *sc)
{
    const lnf_forward_args *a = f->a;
    const lnf_row_ops *ops = f->kn->ops;
    ptrdiff_t D = a->D;
    int c = a->centered;
    REAL *buf = sc->rows;
    double s[3];
    REAL k[3];
    const REAL *xr = lnf_load_row(&a->x, r, D, buf, sizeof(REAL));
    if (a->has_residual) {      /* z = x + residual, then normalize z from cache */
        REAL *zr = lnf_out_row(&a->z, r, buf + 2 * D, sizeof(REAL));
        ops->sums(xr, lnf_load_row(&a->residual, r, D, buf + D, sizeof(REAL)), zr, c, 0, s, D,
                  NULL, NULL);
        xr = zr;
        if (zr == buf + 2 * D) {                /* computed in scratch */
            lnf_store_row(&a->z, r, D, zr, sizeof(REAL));
            if (!lnf_native(&a->z)) {           /* normalize the z that is returned */
                xr = lnf_load_row(&a->z, r, D, zr, sizeof(REAL));
                ops->sums(xr, NULL, NULL, c, 0, s, D, NULL, NULL);
            }
        }
    } else {
        ops->sums(xr, NULL, NULL, c, 0, s, D, NULL, NULL);
    }
    REAL *yr = lnf_out_row(&a->y, r, buf + 3 * D, sizeof(REAL));
    F(resum_far_shift)(ops, xr, s, D, c);
    if (F(row_stats)(s, D, a->eps, c, k))
        F(map_row)(f, ops, sizeof(REAL), xr, yr, w, b, k);
    else
        F(row_exact)(xr, yr, w, b, D, a->eps, c, k, f->wp, f->bp);
    if (mean_out != NULL)
        mean_out[r] = k[0];
    if (rstd_out != NULL)
        rstd_out[r] = k[2];
    if (yr == buf + 3 * D)
        lnf_store_row(&a->y, r, D, yr, sizeof(REAL));
}

/* The per-lane sums s (tile_sums) of the tile at `in`, n rows, summed
 * again about their means where resum_far_shift would (the same test and
 * shift, lane by lane, from tile_stats' mean and var); whether any was. */
static int F(resum_far_tile)(const lnf_row_ops *ops, const void *in, ptrdiff_t inner, double *s,
                             ptrdiff_t D, ptrdiff_t n, const double *mean, const double *var)
{
    enum { T = LNF_TILE };
    double again[3 * T];
    REAL shift[T] = {0};
    int far[T], any = 0;
    for (ptrdiff_t j = 0; j < n; j++) {
        far[j] = F(far_shift)(mean[j], var[j]);
        any |= far[j];
    }
    if (!any)
        return 0;
    for (ptrdiff_t j = 0; j < n; j++)
        shift[j] = (REAL)(far[j] ? s[2 * T + j] + mean[j] : s[2 * T + j]);
    ops->tile_sums(in, NULL, NULL, inner, 1, shift, again, D, NULL, 1);
    for (ptrdiff_t j = 0; j < n; j++)
        if (far[j])
            for (int q = 0; q < 3; q++)
                s[q * T + j] = again[q * T + j];
    return 1;
}

/* A thread's scratch for tiles, laid out once (tile_scratch): the rare
 * rows of two tiles (one without pairs) and y's, the values the sums keep
 * (as many rows), the copies of a short tile (x, residual, z, y) and of
 * the ends held (x, residual). */
typedef struct {
    REAL *slots, *ybuf, *xs;
    char *stage, *held;
} F(tile_bufs);

static inline F(tile_bufs) F(tile_bufs_of)(const lnf_fwd *f, lnf_scratch *sc)
{
    ptrdiff_t D = f->a->D, most = f->pairs ? 2 : 1;
    F(tile_bufs) t;
    t.slots = (REAL *)sc->rows;
    t.ybuf = t.slots + most * LNF_TILE * D;
    t.xs = t.ybuf + D;
    t.stage = (char *)(t.xs + most * LNF_TILE * D);
    t.held = t.stage + 4 * LNF_TILE * lnf_itemsize(f->a->x.dtype) * D;
    return t;
}

/* One tile's rows (or two tiles', `tiles`), n of them: from row r where g
 * is NULL, else the ends held (lnf_tails); px, pr, pz, py: its x,
 * residual, z and y, `inner` bytes per column, copies where `copy` (then
 * stored to their rows after).  The map reads the values the sums kept
 * (xs).  The rows that row_ok turns down are gathered into the thread's
 * rows before the tile is mapped (y may be x), redone by row_exact and
 * stored after. */
static void F(forward_tile)(const lnf_fwd *f, const REAL *w, const REAL *b, REAL *mean_out,
                            REAL *rstd_out, const F(tile_bufs) *t, const lnf_tails *g,
                            ptrdiff_t r, ptrdiff_t n, int tiles, int copy, const char *px,
                            const char *pr, char *pz, char *py, ptrdiff_t inner)
{
    enum { T = LNF_TILE };
    const lnf_forward_args *a = f->a;
    const lnf_row_ops *ops = f->kx->ops;
    const lnf_array *in = a->has_residual ? &a->z : &a->x;
    ptrdiff_t D = a->D, isz = lnf_itemsize(a->x.dtype);
    int c = a->centered, res = a->has_residual;
    REAL *slots = t->slots, *ybuf = t->ybuf, *xs = t->xs;
    double s[2 * 3 * T];                    /* per tile: 3 T sums (tile_sums) */
    REAL k[2 * 3 * T];                      /* per tile: hi, lo, rstd (tile_map) */
    int hard[2 * T], nhard = 0;
    ops->tile_sums(px, pr, pz, inner, c, NULL, s, D, xs, tiles);
    if (res && copy)        /* (z in place before its rare rows are read) */
        lnf_tile_scatter_lanes(pz, &a->z, f->z_like, g, r, n, isz, D);
    double mean[T], var[2 * T], rstd[2 * T];
    int tests = 0;
    for (int q = 0; q < tiles; q++) {
        double *sq = s + 3 * T * q;
        int st = F(tile_stats)(sq, (double)D, a->eps, c, k + 3 * T * q, mean, var + T * q,
                               rstd + T * q);
        if ((st & LNF_TILE_FAR)
            && F(resum_far_tile)(ops, (res ? pz : px) + q * T * isz, inner, sq, D,
                                 LNF_MIN(n - q * T, (ptrdiff_t)T), mean, var + T * q))
            st = F(tile_stats)(sq, (double)D, a->eps, c, k + 3 * T * q, mean, var + T * q,
                               rstd + T * q);
        tests |= st;
    }
    for (ptrdiff_t j = 0; j < n && (tests & LNF_TILE_HARD); j++) {
        ptrdiff_t o = lnf_tile_lane(j);
        hard[j] = !F(row_ok)(s[o], s[o + T], (double)D, a->eps, var[j], rstd[j]);
        if (hard[j]) {      /* (copied: the map may overwrite it, y being x) */
            for (int q = 0; q < 3; q++)
                k[o + q * T] = 0;
            REAL *slot = slots + j * D;
            const void *row = lnf_load_row(in, lnf_lane_row(g, r, j), D, slot, sizeof(REAL));
            if (row != slot)
                memcpy(slot, row, (size_t)D * sizeof(REAL));
            nhard++;
        }
    }
    ops->tile_map(xs, py, inner, w, c ? b : NULL, k, D, f->stream && !copy, tiles);
    if (copy)
        lnf_tile_scatter_lanes(py, &a->y, f->y_like, g, r, n, isz, D);
    if (nhard > 0 && f->stream)     /* (the streamed lines before the rare rows) */
        lnf_stream_fence();
    for (ptrdiff_t j = 0; j < n && nhard > 0; j++) {
        if (!hard[j])
            continue;
        ptrdiff_t o = lnf_tile_lane(j);
        REAL kj[3];
        F(row_exact)(slots + j * D, ybuf, w, b, D, a->eps, c, kj, f->wp, f->bp);
        lnf_store_row(&a->y, lnf_lane_row(g, r, j), D, ybuf, sizeof(REAL));
        k[o] = kj[0];
        k[o + 2 * T] = kj[2];
    }
    /* (each tile's lanes in a row; each end's where ends are held) */
    ptrdiff_t part = g == NULL ? T : g->t;
    for (ptrdiff_t j = 0; j < n; j += part) {
        ptrdiff_t o = lnf_tile_lane(j), row = lnf_lane_row(g, r, j);
        size_t bytes = (size_t)LNF_MIN(n - j, part) * sizeof(REAL);
        if (mean_out != NULL)
            memcpy(mean_out + row, k + o, bytes);
        if (rstd_out != NULL)
            memcpy(rstd_out + row, k + o + 2 * T, bytes);
    }
}

/* The ends held (g), gathered into t->held (x, then residual), as a copied
 * tile whose z and y go through t->stage; none held after. */
static void F(forward_held)(const lnf_fwd *f, const REAL *w, const REAL *b, REAL *mean_out,
                            REAL *rstd_out, const F(tile_bufs) *t, lnf_tails *g)
{
    ptrdiff_t isz = lnf_itemsize(f->a->x.dtype), tb = LNF_TILE * isz * f->a->D;
    int res = f->a->has_residual;
    F(forward_tile)(f, w, b, mean_out, rstd_out, t, g, 0, g->count * g->t, 1, 1, t->held,
                    res ? t->held + tb : NULL, res ? t->stage + 2 * tb : NULL,
                    t->stage + 3 * tb, LNF_TILE * isz);
    g->count = 0;
}

/* Rows r0..r1-1 far apart whose neighbours are adjacent, by tiles of
 * LNF_TILE rows; a run of f->run adjacent rows ends in a shorter tile,
 * which runs on copies (lnf_tile_gather), as every tile does where y or z
 * is not in x's layout (then stored to its own rows, lnf_tile_scatter_to);
 * short ends of runs go several to a copied tile (lnf_tails), after the
 * full tiles before them.  Two full tiles of the arrays side by side go
 * together where the rows are short (f->pairs): each column's two tiles
 * are then read together, adjacent, which the memory serves faster than
 * pieces a tile apart (the arithmetic, and so every bit, is that of one
 * tile at a time). */
static void F(forward_tiles)(const lnf_fwd *f, const REAL *w, const REAL *b, REAL *mean_out,
                             REAL *rstd_out, ptrdiff_t r0, ptrdiff_t r1, lnf_scratch *sc)
{
    enum { T = LNF_TILE };
    const lnf_forward_args *a = f->a;
    ptrdiff_t D = a->D, n, isz = lnf_itemsize(a->x.dtype), tb = T * isz * D;
    int res = a->has_residual, whole = f->y_like && f->z_like;
    int most = f->pairs ? 2 : 1;            /* tiles at once */
    const F(tile_bufs) t = F(tile_bufs_of)(f, sc);
    char *stage = t.stage, *held = t.held;
    lnf_tails g;
    const int ahead = lnf_tile_runs_ahead();
    lnf_tails_init(&g, f->run);
    for (ptrdiff_t r = r0; r < r1; r += n) {
        ptrdiff_t inner = a->x.inner;
        const char *px = lnf_row(&a->x, r), *pr = res ? lnf_row(&a->residual, r) : NULL;
        char *pz = res ? lnf_row(&a->z, r) : NULL, *py = lnf_row(&a->y, r);
        n = LNF_MIN(LNF_MIN((ptrdiff_t)T, f->run - r % f->run), r1 - r);
        if (lnf_tails_take(&g, r, n, f->run)) {
            lnf_tails_gather(px, inner, held, g.count, n, isz, D);
            if (res)
                lnf_tails_gather(pr, inner, held + tb, g.count, n, isz, D);
            g.first[g.count++] = r;
            if (g.count == g.most)
                F(forward_held)(f, w, b, mean_out, rstd_out, &t, &g);
            continue;
        }
        int copy = n < T || !whole;
        int tiles = !copy && most == 2 && lnf_tile_next_full(r, r1, f->run) ? 2 : 1;
        if (copy) {
            lnf_tile_gather(px, inner, stage, n, isz, D);
            if (res)
                lnf_tile_gather(pr, inner, stage + tb, n, isz, D);
            px = stage, pr = res ? stage + tb : NULL, pz = res ? stage + 2 * tb : NULL;
            py = stage + 3 * tb;
            inner = T * isz;
        }
        for (int q = 0; q < tiles && !copy && ahead; q++) {
            ptrdiff_t o = r % f->run + q * T, at = q * T * isz;
            lnf_tile_prefetch_runs(px + at, inner, isz, D, o, f->run);
            if (res) {  /* (the outputs' lines too, where they are not streamed) */
                lnf_tile_prefetch_runs(pr + at, inner, isz, D, o, f->run);
                lnf_tile_prefetch_runs(pz + at, inner, isz, D, o, f->run);
            }
            if (!f->stream)
                lnf_tile_prefetch_runs(py + at, inner, isz, D, o, f->run);
        }
        n *= tiles;
        F(forward_tile)(f, w, b, mean_out, rstd_out, &t, NULL, r, n, tiles, copy, px, pr, pz,
                        py, inner);
    }
    if (g.count > 0)
        F(forward_held)(f, w, b, mean_out, rstd_out, &t, &g);
    if (f->stream)
        lnf_stream_fence();
}

/* Rows r0..r1-1: pipelined for direct arrays, by tiles for rows far apart
 * (f->run), else row by row. */
static void F(forward_range)(const lnf_fwd *f, const REAL *w, const REAL *b, REAL *mean_out,
                             REAL *rstd_out, ptrdiff_t r0, ptrdiff_t r1, lnf_scratch *sc)
{
    if (f->run) {
        F(forward_tiles)(f, w, b, mean_out, rstd_out, r0, r1, sc);
    } else if (f->direct) {
        if (r0 < r1)
            F(forward_block)(f, w, b, mean_out, rstd_out, r0, r1, sc);
    } else {
        for (ptrdiff_t r = r0; r < r1; r++)
            F(forward_row)(f, w, b, mean_out, rstd_out, r, sc);
    }
}

/* Each thread takes one contiguous block of rows.  One thread: no OpenMP
 * region at all (a region costs a small call time even on one thread,
 * docs/performance.md).  sc: each thread's scratch. */
static void F(forward_rows)(const lnf_fwd *f, void *mean_out, void *rstd_out, lnf_scratch *sc)
{
    const lnf_forward_args *a = f->a;
    ptrdiff_t M = a->M, D = a->D, nt = f->nthreads;
    if (nt == 1) {
        const REAL *w = lnf_param(&a->weight, sc->params, D);
        /* (RMSNorm: b unread) */
        const REAL *b = a->centered ? lnf_param(&a->bias, sc->params ? (REAL *)sc->params + D : NULL, D) : w;
        F(forward_range)(f, w, b, mean_out, rstd_out, 0, M, sc);
        return;
    }
#pragma omp parallel num_threads(nt)
    {
        lnf_fpenv env = lnf_fpenv_enter();
        lnf_scratch *mine = sc + omp_get_thread_num();
        const REAL *w = lnf_param(&a->weight, mine->params, D);
        const REAL *b = a->centered ? lnf_param(&a->bias, mine->params ? (REAL *)mine->params + D : NULL, D) : w;
#pragma omp for schedule(static)
        for (ptrdiff_t t = 0; t < nt; t++)
            F(forward_range)(f, w, b, mean_out, rstd_out,
                             lnf_tile_start(lnf_part_start(t, nt, M), f->run),
                             lnf_tile_start(lnf_part_start(t + 1, nt, M), f->run), mine);
        lnf_fpenv_leave(env);
    }
}

#undef F
