/* The backward rows, for arithmetic in REAL (float or double; backward.c
 * includes this once for each).  Functions are named with the suffix _f32
 * or _f64 (F). */
#if REAL_F64
#define F(name) name##_f64
#else
#define F(name) name##_f32
#endif

/* The per-row scalars of the backward map from the row's sums s =
 * {sum(x - mean), sum(g), sum(g * (x - mean))}, g = dy * w:
 * k = {mean, c, rstd, mean(g), mean(g * xhat)} (row_grad_k); row_grad_ok
 * turns down the rare rows that backward_exact must redo (row_grad_scalars
 * returns 0 for them): rows whose sums came out infinite or NaN (float32:
 * past 1e300), and rows whose terms g * (x - mean) are tiny on average
 * (LNF_TINY_TERMS_*), where deviations or dweight terms may be rounded to
 * subnormals.  Rows where g sums to zero too lose nothing there and are
 * not redone where dy is all zero (padding), but are where their products
 * dy w underflowed (row_grad_ok); rows whose deviations are all zero
 * (constant rows) are redone unless dy is zero, since a row of a few
 * subnormal values can sum to exactly zero as well.
 *
 * LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
 * RMSNorm (centered 0, mean 0): dx = rstd * (g - xhat * mean(g * xhat)).
 * The stored mean (rounded to REAL) serves as a shift; the residual
 * c = mean(x - mean) is recovered in float64, so xhat = (x - mean - c) * rstd
 * is as accurate as the forward pass even for large common offsets. */
static inline void F(row_grad_k)(double s0, double s1, double s2, double D, int centered,
                                 REAL mean, REAL rstd, REAL *k)
{
    double c = centered ? s0 / D : 0.0;
    k[0] = mean;
    k[1] = (REAL)c;
    k[2] = rstd;
    k[3] = centered ? (REAL)(s1 / D) : 0;                       /* mean(g) */
    k[4] = (REAL)(rstd * (s2 - c * s1) / D);                    /* mean(g * xhat) */
}

/* Whether row_grad_k's row serves (1; else backward_exact redoes it, 0),
 * or its g and g (x - mean) sum to exactly zero (LNF_GRAD_ZERO): padding
 * where its dy is all zero (the callers look: row_grad_scalars,
 * tile_zero_lanes), and it serves; else its products dy w underflowed (dy
 * and w both near 1e-200), and it is redone. */
static inline int F(row_grad_ok)(double s0, double s1, double s2, double D, double rstd)
{
    double tiny = REAL_F64 ? LNF_TINY_TERMS_F64 : LNF_TINY_TERMS_F32;
    double all = s0 + s1 + s2;
    /* (float64: not where rstd is NaN or 0, x itself NaN or infinite, whose
     * outputs are NaN either way) */
    if (REAL_F64 ? rstd > 0.0 && !(fabs(all) <= DBL_MAX) : !(-1e300 < all && all < 1e300))
        return 0;
    if (s1 == 0.0 && s2 == 0.0)
        return LNF_GRAD_ZERO;
    return !(fabs(s2) < D * tiny);
}

/* row_grad_k and row_grad_ok of row r (dy: its array, read again where g
 * sums to zero). */
static inline int F(row_grad_scalars)(const double *s, ptrdiff_t D, int centered, REAL mean,
                                      REAL rstd, REAL *k, const lnf_array *dy, ptrdiff_t r)
{
    F(row_grad_k)(s[0], s[1], s[2], (double)D, centered, mean, rstd, k);
    int ok = F(row_grad_ok)(s[0], s[1], s[2], (double)D, rstd);
    return ok == LNF_GRAD_ZERO ? lnf_row_zero(dy, r, D) : ok;
}

/* zero[j]: whether lane j of a tile's dy (dys: D columns of LNF_TILE
 * values) is all zeros; at once where the whole tile is (padding). */
static void F(tile_zero_lanes)(const REAL *dys, ptrdiff_t D, int *zero)
{
    enum { T = LNF_TILE };
    int all = lnf_words_zero(dys, D * T * (ptrdiff_t)sizeof(REAL),
                             lnf_unsigned_mask(sizeof(REAL)));
    for (int j = 0; j < T; j++) {
        zero[j] = 1;
        for (ptrdiff_t i = 0; i < D && !all && zero[j]; i++)
            zero[j] = dys[i * T + j] == 0;
    }
}

/* row_grad_k of a tile's LNF_TILE lanes (sums s[j], s[T + j], s[2 T + j];
 * k[q T + j]) in a loop of their own, which takes several lanes per
 * instruction (built for each instruction set, LNF_CLONES), as the
 * forward's tile_stats. */
LNF_CLONES static void F(tile_grad_k)(const double *__restrict s, double D, int centered,
                                      const REAL *__restrict mean, const REAL *__restrict rstd,
                                      REAL *__restrict k)
{
    enum { T = LNF_TILE };
    for (int j = 0; j < T; j++) {
        REAL kj[5];
        F(row_grad_k)(s[j], s[T + j], s[2 * T + j], D, centered, mean[j], rstd[j], kj);
        for (int q = 0; q < 5; q++)
            k[q * T + j] = kj[q];
    }
}

/* After the i-th of a chunk's n rows (from 0): add a full or final run of
 * float32 sums g into dw (and zero g), the first run setting dw, in
 * columns c0..c1-1 of dweight and dbias (backward_blocks gives each thread
 * its own).  float64 sums are in dw itself; a call's one run stays in g. */
static inline void F(end_of_run)(const lnf_bwd *b, REAL *g, double *dw, ptrdiff_t i, ptrdiff_t n,
                                 ptrdiff_t c0, ptrdiff_t c1)
{
    ptrdiff_t D = b->a->D;
    if (!REAL_F64 && !b->one_run && (i % LNF_RUN_ROWS == LNF_RUN_ROWS - 1 || i == n - 1)) {
        add_run(dw + c0, (float *)(void *)g + c0, c1 - c0, i < LNF_RUN_ROWS);
        if (b->a->centered)
            add_run(dw + D + c0, (float *)(void *)g + D + c0, c1 - c0, i < LNF_RUN_ROWS);
    }
}

/* (x - m) * up, exactly where it does not overflow or underflow: scaled
 * down (up < 1), x and m each before their difference. */
static inline double F(deviation)(double x, double m, double up)
{
    return up < 1.0 ? x * up - m * up : (x - m) * up;
}

/* g = dy * w, scaled by 2**-eg: the product of dy's and w's fractions
 * (frexp), rounded once, times 2 to its exponent less eg, so that the
 * product itself cannot leave the range where its scaled value does not. */
static inline double F(grad_term)(double dy, double w, int eg)
{
    int a, b;
    if (!eg)
        return dy * w;
    double f = frexp(dy, &a) * frexp(w, &b);
    return ldexp(f, a + b - eg);
}

/* The exponent (frexp's) of the largest |dy[i] * w[i]| of nonzero pairs,
 * INT_MIN where there is none; *finite: whether dy and w are finite (else
 * the row's dx is NaN, and INT_MIN).  The products themselves serve where
 * the largest is a normal number; else (it underflowed or overflowed) the
 * product of each pair's fractions (frexp) does. */
static inline int F(grad_exponent)(const REAL *dy, const REAL *w, ptrdiff_t D, int *finite)
{
    double big = 0.0;
    int e = INT_MIN, a, b;
    *finite = 1;
    for (ptrdiff_t i = 0; i < D; i++) {
        double p = fabs((double)dy[i] * w[i]);
        if (!(p <= big)) {
            if (!(fabs((double)dy[i]) <= DBL_MAX && fabs((double)w[i]) <= DBL_MAX)) {
                *finite = 0;
                return INT_MIN;
            }
            big = p;
        }
    }
    if (big >= DBL_MIN && big <= DBL_MAX) {
        frexp(big, &e);
        return e;
    }
    for (ptrdiff_t i = 0; i < D; i++) {
        double f = fabs(frexp(dy[i], &a) * frexp(w[i], &b));
        if (f > 0.0 && a + b - (f < 0.5) > e)
            e = a + b - (f < 0.5);
    }
    return e;
}

/* Row r in float64 throughout, for the rows row_grad_scalars turns down.
 * float32 rows whose sums overflow overflow float32 in the map too (x near
 * float32's limit, or dy * weight past it), where the true dx and dweight
 * terms may be finite.  float64 rows are scaled where their terms would
 * leave float64's range: deviations from the mean all below 2**-900 by
 * 2**1000 (up), so that none is rounded to a subnormal when the mean's
 * residual c is taken off it; deviations past 2**960 (values of opposite
 * sign near float64's maximum) down to below 1, x and the mean each
 * before their difference; and g = dy * w, where it is below 1 (scaled
 * up, nothing is lost) or its products with the deviations could
 * underflow, where it is near float64's maximum, or where the sums
 * overflow or give a mean(g * xhat) * xs past 2**1000, to below 1 (by
 * 2**-eg, without forming dy * w unscaled); dx is then taken as rstd
 * scaled into [1, 2) times the scaled terms, and scaled back once.  xhat
 * is computed unscaled where the deviations are scaled down, so that a
 * small one does not become subnormal, and its dweight term dy * xhat
 * unscaled where it could overflow scaled.  The
 * dweight/dbias terms of float32 arithmetic are added in float64
 * (sc->grads, fold_grads), not rounded to float32: a subnormal float32
 * term keeps few digits.  Rows are gathered into the thread's rows (4)
 * where not contiguous in the compute type; dx is rounded once (16-bit dx:
 * then to 16 bits, as the forward's row_exact; a subnormal float64 dx of
 * a scaled row, twice). */
static void F(backward_exact)(const lnf_bwd *b, const REAL *w, const REAL *mean,
                              const REAL *rstd, ptrdiff_t r, REAL *g, lnf_scratch *sc)
{
    const lnf_backward_args *a = b->a;
    ptrdiff_t D = a->D;
    double s0 = 0.0, s1 = 0.0, s2 = 0.0;
    double m = a->centered ? mean[r] : 0.0;
    double rs = rstd[r], c, mg, mgx, xh, d, gi, big = 0.0, up = 1.0;
    int eg = 0, er = 0, e = INT_MIN, finite = 0;    /* g scaled by 2**-eg, rstd by 2**-er */
    REAL *buf = sc->rows;
    double *grads = NULL;
    if (b->direct && !lnf_native(&a->x)) {
        buf = lnf_rare_rows(sc, 4 * (size_t)D * sizeof(REAL));
        if (buf == NULL)
            return;
    }
    if (!REAL_F64) {
        grads = lnf_rare_grads(sc, D);
        if (grads == NULL)
            return;
    }
    REAL *dxbuf = buf != NULL ? buf + 2 * D : NULL;
    const REAL *xr = lnf_load_row(&a->x, r, D, buf, sizeof(REAL));
    const REAL *dyr = lnf_load_row(&a->dy, r, D, buf != NULL ? buf + D : NULL, sizeof(REAL));
    REAL *dxr = lnf_out_row(&a->dx, r, dxbuf, sizeof(REAL));
    const REAL *dzr = a->has_dz ? lnf_load_row(&a->dz, r, D, buf != NULL ? buf + 3 * D : NULL,
                                               sizeof(REAL))
                                : NULL;
    if (REAL_F64) {
        for (ptrdiff_t i = 0; i < D; i++) {
            d = fabs(xr[i] - m);        /* (infinite where it overflows) */
            if (big < d)
                big = d;
        }
        if (big < ldexp(1.0, -900))
            up = ldexp(1.0, 1000);
        else if (big > ldexp(1.0, 960))
            up = big > DBL_MAX ? ldexp(1.0, -1025) : ldexp(1.0, -ilogb(big) - 1);
        /* e, ed: the exponents of the largest g and scaled deviation */
        e = F(grad_exponent)(dyr, w, D, &finite);
        int ed = up < 1.0 || big == 0.0 ? 0 : ilogb(big * up);
        if (e != INT_MIN && (e < 0 || e + ed < -900 || e > 1000))
            eg = e;
    }
    /* xhat = (deviation - c) * rsx, unscaled where deviations are scaled
     * down; scaled by up where they are scaled up */
    double rsx = up < 1.0 ? rs / up : rs, xs = up < 1.0 ? 1.0 : up;
    for (int pass = 0;; pass++) {
        s0 = s1 = s2 = 0.0;
        for (ptrdiff_t i = 0; i < D; i++) {
            d = F(deviation)(xr[i], m, up);
            gi = F(grad_term)(dyr[i], w[i], eg);
            s0 += d;
            s1 += gi;
            s2 += gi * d;
        }
        c = a->centered ? s0 / D : 0.0; /* (c: scaled by up; mgx by xs; mg, mgx by g's scale) */
        mg = a->centered ? s1 / D : 0.0;
        mgx = rsx * (s2 - c * s1) / D;
        /* Sums that overflowed, or a mean(g * xhat) * xs past 2**1000 that
         * could overflow the map (deviations scaled up, or an rstd that does
         * not fit x), with finite dy and w: once more, g scaled.  (Scaled
         * only where it must be, since a g far below the row's largest is
         * then lost.) */
        if (pass || eg || !finite || e == INT_MIN
            || (fabs(mgx) < ldexp(1.0, 1000) && fabs(s1) <= DBL_MAX))
            break;
        eg = e;
    }
    /* An infinity or NaN in dy or w (sums not finite, as no finite row's
     * are here): every dx of the row NaN, where some would come out
     * infinite, as the GPU's (api.md); dweight's terms as they are. */
    if (!(fabs(s1) <= DBL_MAX && fabs(s2) <= DBL_MAX))
        mgx = NAN;
    if (eg && rs > 0.0 && rs <= DBL_MAX)
        er = ilogb(rs);
    for (ptrdiff_t i = 0; i < D; i++) {
        xh = (F(deviation)(xr[i], m, up) - c) * rsx;    /* xhat * xs */
        gi = F(grad_term)(dyr[i], w[i], eg);
        d = (gi - mg) - xh * (mgx / xs) / xs;
        d = eg ? ldexp(ldexp(rs, -er) * d, eg + er) : rs * d;
        if (dzr != NULL)
            d += dzr[i];
        dxr[i] = (REAL)d;
        if (!REAL_F64) {
            grads[i] += dyr[i] * xh;
            if (a->centered)
                grads[D + i] += dyr[i];
        } else {
            g[i] += xs == 1.0 ? dyr[i] * xh
                    : fabs(xh) >= 1.0 ? dyr[i] * (xh / xs) : dyr[i] * xh / xs;
            if (a->centered)
                g[D + i] += dyr[i];
        }
    }
    if (dxr == dxbuf)
        lnf_store_row(&a->dx, r, D, dxr, sizeof(REAL));
}

/* Rows r0..r1-1 of direct arrays, in order, software-pipelined as
 * forward_block: one sweep maps row r (dx, and its terms into g[0:D],
 * g[D:2D]) and sums row r + 1; the rare rows go to backward_exact. */
static void F(backward_block)(const lnf_bwd *b, const REAL *w, const REAL *mean,
                              const REAL *rstd, ptrdiff_t r0, ptrdiff_t r1, double *dw, REAL *g,
                              lnf_scratch *sc)
{
    const lnf_backward_args *a = b->a;
    const lnf_row_ops *ops = b->kx->ops;
    ptrdiff_t D = a->D;
    int c = a->centered;
    double s[3];
    REAL k[5];
    if (r0 >= r1)
        return;
    ops->grad_sums(lnf_row(&a->x, r0), lnf_row(&a->dy, r0), w, c ? mean[r0] : 0, s, D, NULL,
                   NULL);
    for (ptrdiff_t r = r0; r < r1; r++) {
        if (!F(row_grad_scalars)(s, D, c, c ? mean[r] : 0, rstd[r], k, &a->dy, r)) {
            F(backward_exact)(b, w, mean, rstd, r, g, sc);
            if (r + 1 < r1)
                ops->grad_sums(lnf_row(&a->x, r + 1), lnf_row(&a->dy, r + 1), w,
                               c ? mean[r + 1] : 0, s, D, NULL, NULL);
        } else {
            ops->grad_map_sums(lnf_row(&a->x, r), lnf_row(&a->dy, r),
                               lnf_row_or_null(&a->dz, r, r1, a->has_dz), lnf_row(&a->dx, r), k,
                               g, c ? g + D : NULL, w, lnf_row_or_null(&a->x, r + 1, r1, 1),
                               lnf_row_or_null(&a->dy, r + 1, r1, 1),
                               c && r + 1 < r1 ? mean[r + 1] : 0, s, D,
                               lnf_row_or_null(&a->x, r + 2, r1, 1),
                               lnf_row_or_null(&a->dy, r + 2, r1, 1),
                               b->stream ? LNF_STREAMED : 0);
        }
        F(end_of_run)(b, g, dw, r - r0, r1 - r0, 0, D);
    }
}

/* The backward sums s of a row's x and dy (D values of the compute type):
 * in one sweep, or where b->blocked by column blocks, added in block order
 * as backward_blocks adds them, so that dx's layout changes no bit. */
static void F(row_grad_sums)(const lnf_bwd *b, const lnf_row_ops *ops, const REAL *x,
                             const REAL *dy, const REAL *w, REAL m, double *s)
{
    ptrdiff_t D = b->a->D, cbk = b->blocked ? b->col_block : D;
    ops->grad_sums(x, dy, w, m, s, LNF_MIN(cbk, D), NULL, NULL);
    for (ptrdiff_t cb = cbk; cb < D; cb += cbk) {
        double t[3];
        ops->grad_sums(x + cb, dy + cb, w + cb, m, t, LNF_MIN(cbk, D - cb), NULL, NULL);
        for (int q = 0; q < 3; q++)
            s[q] += t[q];
    }
}

/* Row r of arrays with some rows strided or of another dtype, gathered into
 * the thread's rows (4: x, dy, dx, dz) and stored back: the arithmetic of
 * backward_block (or of backward_blocks), one pass after another. */
static void F(backward_row)(const lnf_bwd *b, const REAL *w, const REAL *mean, const REAL *rstd,
                            ptrdiff_t r, REAL *g, lnf_scratch *sc)
{
    const lnf_backward_args *a = b->a;
    const lnf_row_ops *ops = b->kn->ops;
    ptrdiff_t D = a->D;
    REAL *buf = sc->rows;
    double s[3];
    REAL k[5];
    REAL m = a->centered ? mean[r] : 0;
    const REAL *xr = lnf_load_row(&a->x, r, D, buf, sizeof(REAL));
    const REAL *dyr = lnf_load_row(&a->dy, r, D, buf + D, sizeof(REAL));
    REAL *dxr = lnf_out_row(&a->dx, r, buf + 2 * D, sizeof(REAL));
    F(row_grad_sums)(b, ops, xr, dyr, w, m, s);
    if (!F(row_grad_scalars)(s, D, a->centered, m, rstd[r], k, &a->dy, r)) {
        F(backward_exact)(b, w, mean, rstd, r, g, sc);
        return;
    }
    ops->grad_map(xr, dyr, a->has_dz ? lnf_load_row(&a->dz, r, D, buf + 3 * D, sizeof(REAL)) : NULL,
                  dxr, k, g, a->centered ? g + D : NULL, w, D, 0);
    if (dxr == buf + 2 * D)
        lnf_store_row(&a->dx, r, D, dxr, sizeof(REAL));
}

/* Rows r0..r1-1 of a chunk as backward_block does them, by column blocks:
 * thread t of the nt that share the chunk (nt > 1: all the threads of the
 * region, which all call this) takes blocks [t nb / nt, (t + 1) nb / nt)
 * of every row.  One sweep of each block maps row r and sums row r + 1
 * into sums[3 ((r + 1) % 2 * nb + block)]; with nt > 1 a barrier after
 * each row publishes them, and every thread adds up a row's blocks in
 * block order.  g (float32 runs) and dw are shared: each thread adds into
 * its own columns only.  The rare rows that backward_exact redoes are done
 * whole by thread 0 between two barriers (every thread sees the same sums,
 * so all take that branch), with thread 0's scratch sc[0], whose float64
 * terms each thread folds into its own columns after the chunk's last row.
 * sc: the scratch of the nt threads. */
static void F(backward_blocks)(const lnf_bwd *bw, const REAL *w, const REAL *mean,
                               const REAL *rstd, ptrdiff_t r0, ptrdiff_t r1, double *dw, REAL *g,
                               double *sums, lnf_scratch *sc, int t, int nt)
{
    const lnf_backward_args *a = bw->a;
    const lnf_row_ops *ops = bw->kx->ops;
    ptrdiff_t D = a->D, cbk = bw->col_block, nb = lnf_div_up(D, cbk);
    ptrdiff_t b0 = lnf_part_start(t, nt, nb), b1 = lnf_part_start(t + 1, nt, nb);
    ptrdiff_t c0 = b0 < nb ? b0 * cbk : D, c1 = b1 < nb ? b1 * cbk : D;
    ptrdiff_t isz = lnf_native(&a->x) ? (ptrdiff_t)sizeof(REAL) : 2;   /* bytes per stored value */
    int stream = bw->stream ? (LNF_STREAMED | LNF_STREAM_NOFENCE) : 0;
    int c = a->centered;
    double s[3];
    REAL k[5];
    for (ptrdiff_t j = c0; j < c1; j++) {   /* (double: g is dw; float: runs set dw) */
        g[j] = 0;
        if (c)
            g[D + j] = 0;
        if (!REAL_F64 && r0 >= r1) {        /* (an empty chunk adds no run) */
            dw[j] = 0;
            if (c)
                dw[D + j] = 0;
        }
    }
    if (r0 >= r1)
        return;
    const char *xn = lnf_row(&a->x, r0), *dyn = lnf_row(&a->dy, r0);
    for (ptrdiff_t b = b0; b < b1; b++) {
        ptrdiff_t cb = b * cbk;
        ops->grad_sums(xn + cb * isz, dyn + cb * isz, w + cb, c ? mean[r0] : 0, sums + 3 * b,
                       LNF_MIN(cbk, D - cb), NULL, NULL);
    }
    if (nt > 1)
        lnf_barrier();
    for (ptrdiff_t r = r0; r < r1; r++) {
        ptrdiff_t slot = (r - r0) % 2 * nb;
        s[0] = sums[3 * slot];
        s[1] = sums[3 * slot + 1];
        s[2] = sums[3 * slot + 2];
        for (ptrdiff_t b = 1; b < nb; b++) {
            s[0] += sums[3 * (slot + b)];
            s[1] += sums[3 * (slot + b) + 1];
            s[2] += sums[3 * (slot + b) + 2];
        }
        int nxt = r + 1 < r1;
        xn = lnf_row_or_null(&a->x, r + 1, r1, 1);
        dyn = lnf_row_or_null(&a->dy, r + 1, r1, 1);
        REAL mn = c && nxt ? mean[r + 1] : 0;
        slot = (r + 1 - r0) % 2 * nb;
        if (!F(row_grad_scalars)(s, D, c, c ? mean[r] : 0, rstd[r], k, &a->dy, r)) {
            if (nt > 1)
                lnf_barrier();      /* (every thread is done with the last run) */
            if (t == 0)
                F(backward_exact)(bw, w, mean, rstd, r, g, sc);
            for (ptrdiff_t b = b0; b < b1 && nxt; b++) {
                ptrdiff_t cb = b * cbk;
                ops->grad_sums(xn + cb * isz, dyn + cb * isz, w + cb, mn, sums + 3 * (slot + b),
                               LNF_MIN(cbk, D - cb), NULL, NULL);
            }
        } else {
            const char *xr = lnf_row(&a->x, r), *dyr = lnf_row(&a->dy, r);
            const char *dzr = lnf_row_or_null(&a->dz, r, r1, a->has_dz);
            char *dxr = lnf_row(&a->dx, r);
            for (ptrdiff_t b = b0; b < b1; b++) {
                ptrdiff_t cb = b * cbk, n = LNF_MIN(cbk, D - cb);
                const void *dzb = dzr != NULL ? dzr + cb * isz : NULL;
                REAL *db = c ? g + D + cb : NULL;
                if (!nxt) {
                    ops->grad_map(xr + cb * isz, dyr + cb * isz, dzb, dxr + cb * isz, k, g + cb,
                                  db, w + cb, n, stream);
                    continue;
                }
                const char *xf = NULL, *dyf = NULL;   /* (to prefetch: this thread's next block) */
                if (b + 1 < b1) {
                    xf = xn + (cb + n) * isz;
                    dyf = dyn + (cb + n) * isz;
                } else if (r + 2 < r1) {
                    xf = lnf_row(&a->x, r + 2) + c0 * isz;
                    dyf = lnf_row(&a->dy, r + 2) + c0 * isz;
                }
                ops->grad_map_sums(xr + cb * isz, dyr + cb * isz, dzb, dxr + cb * isz, k, g + cb,
                                   db, w + cb, xn + cb * isz, dyn + cb * isz, mn,
                                   sums + 3 * (slot + b), n, xf, dyf, stream);
            }
            if (stream)
                lnf_stream_fence();
        }
        if (nt > 1)
            lnf_barrier();          /* (the sums of row r + 1 are all in) */
        F(end_of_run)(bw, g, dw, r - r0, r1 - r0, c0, c1);
    }
    if (!REAL_F64 && !bw->one_run)
        fold_grads(sc, dw, D, c0, c1, c);
}

/* Rows r0..r1-1 of a chunk far apart whose neighbours are adjacent, by
 * tiles of LNF_TILE rows from r0; a run of b->run adjacent rows ends in a
 * shorter tile, which runs on copies (lnf_tile_gather), so a chunk's tiles
 * depend on the shape alone.  Where dx is not in x's layout every tile
 * runs on copies, its dx stored to its own rows (lnf_tile_scatter_to).
 * The map reads x and dy from the copies the sums kept (xs, dys).  Each
 * tile adds its dweight/dbias terms into per-lane runs (tileops.h; the
 * first tile of a run stores them), which are added across their lanes
 * into the partial rows dw after every LNF_RUN_ROWS tiles and after the
 * chunk's last (tile_fold).  Rows that row_grad_ok turns down are zeroed
 * in xs and dys (and k: they then add nothing) and redone by
 * backward_exact (its float64 terms go into dw itself, or for float32
 * arithmetic into sc->grads). */
static void F(backward_tiles)(const lnf_bwd *b, const REAL *w, const REAL *mean,
                              const REAL *rstd, ptrdiff_t r0, ptrdiff_t r1, double *dw,
                              lnf_scratch *sc)
{
    enum { T = LNF_TILE };
    const lnf_backward_args *a = b->a;
    const lnf_row_ops *ops = b->kx->ops;
    ptrdiff_t D = a->D, n, isz = lnf_itemsize(a->x.dtype), tb = T * isz * D;
    int c = a->centered, dz = a->has_dz;
    char *stage = (char *)((REAL *)sc->rows + BACKWARD_SCRATCH * D);  /* x, dy, dz, dx copied */
    REAL *xs = (REAL *)(void *)(stage + 4 * tb), *dys = xs + T * D;
    REAL *lanes = dys + T * D;          /* the runs: dweight's, dbias's */
    REAL *carries = lanes + 2 * T * D;  /* x's and dy's (tv_load_carry) */
    ptrdiff_t tiles = 0, width = (c ? 2 : 1) * D;
    lnf_tile_carry mode = LNF_TILE_PLAIN;
    const int ahead = lnf_tile_runs_ahead();
    for (ptrdiff_t r = r0; r < r1; r += n) {
        double s[3 * T];
        REAL m[T] = {0}, rs[T] = {0}, k[5 * T];     /* (lanes past n: 0, as their sums) */
        int hard[T] = {0}, zero[T], any = 0, looked = 0;
        ptrdiff_t inner = a->x.inner;
        const char *px = lnf_row(&a->x, r), *pdy = lnf_row(&a->dy, r);
        const char *pdz = dz ? lnf_row(&a->dz, r) : NULL;
        char *pdx = lnf_row(&a->dx, r);
        n = LNF_MIN(LNF_MIN((ptrdiff_t)T, b->run - r % b->run), r1 - r);
        int copy = n < T || !b->dx_like;
        if (copy) {
            lnf_tile_gather(px, inner, stage, n, isz, D);
            lnf_tile_gather(pdy, inner, stage + tb, n, isz, D);
            if (dz)
                lnf_tile_gather(pdz, inner, stage + 2 * tb, n, isz, D);
            px = stage, pdy = stage + tb, pdz = dz ? stage + 2 * tb : NULL;
            pdx = stage + 3 * tb;
            inner = T * isz;
        }
        for (ptrdiff_t j = 0; j < n; j++) {
            m[j] = c ? mean[r + j] : 0;
            rs[j] = rstd[r + j];
        }
        if (!copy && ahead) {
            ptrdiff_t o = r % b->run;
            lnf_tile_prefetch_runs(px, inner, isz, D, o, b->run);
            lnf_tile_prefetch_runs(pdy, inner, isz, D, o, b->run);
            if (dz)
                lnf_tile_prefetch_runs(pdz, inner, isz, D, o, b->run);
            if (!b->stream)     /* (dx's lines too, where it is not streamed) */
                lnf_tile_prefetch_runs(pdx, inner, isz, D, o, b->run);
        }
        mode = lnf_tile_carry_mode(mode, !copy && inner % 64 == 0, r, r1, b->run);
        ops->tile_grad_sums(px, pdy, inner, w, m, s, D, xs, dys, carries, mode);
        F(tile_grad_k)(s, (double)D, c, m, rs, k);
        for (ptrdiff_t j = 0; j < n; j++) {
            int ok = F(row_grad_ok)(s[j], s[T + j], s[2 * T + j], (double)D, rs[j]);
            if (ok == LNF_GRAD_ZERO && !looked) {
                F(tile_zero_lanes)(dys, D, zero);
                looked = 1;
            }
            hard[j] = ok == LNF_GRAD_ZERO ? !zero[j] : !ok;
            any |= hard[j];
            if (hard[j]) {
                for (int q = 0; q < 5; q++)
                    k[q * T + j] = 0;
                lnf_tile_clear((char *)xs, j, sizeof(REAL), D);
                lnf_tile_clear((char *)dys, j, sizeof(REAL), D);
            }
        }
        ops->tile_grad_map(xs, dys, pdz, pdx, inner, k, lanes, c ? lanes + D * T : NULL, w, D,
                           b->stream && !copy, tiles % LNF_RUN_ROWS == 0);
        if (++tiles % LNF_RUN_ROWS == 0 || r + n == r1)
            ops->tile_fold(lanes, dw, width);
        if (copy)
            lnf_tile_scatter_to(pdx, &a->dx, b->dx_like, r, n, isz, D);
        if (any && b->stream)           /* (the streamed lines before the rare rows) */
            lnf_stream_fence();
        for (ptrdiff_t j = 0; j < n && any; j++)
            if (hard[j])
                F(backward_exact)(b, w, mean, rstd, r + j, (REAL *)(void *)dw, sc);
    }
    if (b->stream)
        lnf_stream_fence();
}

/* Rows r0..r1-1, their dweight/dbias terms summed into the float64 partial
 * rows dw[0:2D] (dw[0:D] for RMSNorm) in row order: directly when REAL is
 * double (g is dw), else through the float32 runs g[0:2D], which are zero
 * before and after (zeroed once per thread, zeroed by each run added), and
 * then the float64 terms of its rare rows (fold_grads).  sums: the
 * thread's block sums (backward_blocks). */
static void F(backward_chunk)(const lnf_bwd *b, const REAL *w, const REAL *mean,
                              const REAL *rstd, ptrdiff_t r0, ptrdiff_t r1, double *dw, REAL *g,
                              double *sums, lnf_scratch *sc)
{
    const lnf_backward_args *a = b->a;
    if (b->shared) {
        F(backward_blocks)(b, w, mean, rstd, r0, r1, dw, g, sums, sc, 0, 1);
        return;
    }
    if (REAL_F64 || r0 >= r1 || b->run)     /* (an empty chunk adds no run) */
        memset(dw, 0, 2 * (size_t)a->D * sizeof(double));
    if (b->run) {
        F(backward_tiles)(b, w, mean, rstd, r0, r1, dw, sc);
    } else if (b->direct) {
        F(backward_block)(b, w, mean, rstd, r0, r1, dw, g, sc);
    } else {
        for (ptrdiff_t r = r0; r < r1; r++) {
            F(backward_row)(b, w, mean, rstd, r, g, sc);
            F(end_of_run)(b, g, dw, r - r0, r1 - r0, 0, a->D);
        }
    }
    if (!REAL_F64 && !b->one_run)
        fold_grads(sc, dw, a->D, 0, a->D, a->centered);
}

/* Where thread t sums a run of a chunk's dweight/dbias terms: float32 rows
 * of its own, one partial stride (4 D floats) apart although they fill
 * half of it (runs of two threads closer together were slower,
 * docs/performance.md), or the chunk's float64 partial rows dw
 * themselves. */
static inline REAL *F(run_rows)(const lnf_reduction *p, double *dw, int t)
{
    if (REAL_F64)
        return (REAL *)(void *)dw;
    return (REAL *)p->runs + 2 * p->stride * t;
}

/* The reduction plan p carried out: the chunks' partial rows summed (each
 * chunk on one thread, or blocked rows on all), then added in chunk order
 * into the output.  sc: each thread's scratch. */
static void F(backward_rows)(const lnf_bwd *b, const lnf_reduction *p, lnf_scratch *sc)
{
    const lnf_backward_args *a = b->a;
    const REAL *mean = a->mean, *rstd = a->rstd;
    ptrdiff_t M = a->M, D = a->D, stride = p->stride, nchunks = p->nchunks;
    ptrdiff_t width = a->centered ? 2 * D : D;      /* (RMSNorm: no dbias) */
    ptrdiff_t nblocks = (width + LNF_SUM_BLOCK - 1) / LNF_SUM_BLOCK;
    ptrdiff_t nb = lnf_div_up(D, b->col_block);
    if (b->nthreads == 1) {     /* (no OpenMP region, as in forward_rows) */
        const REAL *w = lnf_param(&a->weight, sc->params, D);
        if (!REAL_F64)
            memset(F(run_rows)(p, NULL, 0), 0, 2 * (size_t)D * sizeof(float));
        for (ptrdiff_t c = 0; c < nchunks; c++)
            F(backward_chunk)(b, w, mean, rstd, chunk_row(b, c, nchunks),
                              chunk_row(b, c + 1, nchunks), chunk_part(p, c),
                              F(run_rows)(p, chunk_part(p, c), 0), p->sums, sc);
    } else if (b->shared && b->nthreads <= nb) {
#pragma omp parallel num_threads(b->nthreads)
        {
            lnf_fpenv env = lnf_fpenv_enter();
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const REAL *w = lnf_param(&a->weight, sc[t].params, D);
            /* (every thread takes every chunk: the barriers are in there) */
            for (ptrdiff_t c = 0; c < nchunks; c++)
                F(backward_blocks)(b, w, mean, rstd, lnf_part_start(c, nchunks, M),
                                   lnf_part_start(c + 1, nchunks, M), chunk_part(p, c),
                                   F(run_rows)(p, chunk_part(p, c), 0), p->sums, sc, t, nt);
            lnf_fpenv_leave(env);
        }
    } else {
#pragma omp parallel num_threads(b->nthreads)
        {
            lnf_fpenv env = lnf_fpenv_enter();
            int t = omp_get_thread_num();
            const REAL *w = lnf_param(&a->weight, sc[t].params, D);
            if (!REAL_F64)
                memset(F(run_rows)(p, NULL, t), 0, 2 * (size_t)D * sizeof(float));
#pragma omp for schedule(static)
            for (ptrdiff_t c = 0; c < nchunks; c++)
                F(backward_chunk)(b, w, mean, rstd, chunk_row(b, c, nchunks),
                                  chunk_row(b, c + 1, nchunks), chunk_part(p, c),
                                  F(run_rows)(p, chunk_part(p, c), t),
                                  b->shared ? p->sums + 6 * nb * t : NULL, sc + t);
            lnf_fpenv_leave(env);
        }
    }
    if (!REAL_F64 && b->one_run) {      /* (one thread: nchunks is 1) */
        const float *g = (const float *)(void *)F(run_rows)(p, NULL, 0);
        if (sc->grads == NULL) {
            round_run(g, width, a->dwdb, a->dwdb_dtype);
        } else {    /* (the run, then the float64 terms of the rare rows) */
            for (ptrdiff_t k = 0; k < width; k++)
                sc->grads[k] = g[k] + sc->grads[k];
            sum_partials(sc->grads, 1, width, 0, width, a->dwdb, a->dwdb_dtype);
        }
        return;
    }
    double *part = p->part;
    if (part == a->dwdb)        /* (one float64 chunk, summed in place) */
        return;
    if (b->nthreads == 1 || nblocks * nchunks <= LNF_SUM_PARALLEL_MIN) {
        sum_partials(part, nchunks, stride, 0, width, a->dwdb, a->dwdb_dtype);
        return;
    }
#pragma omp parallel num_threads(b->nthreads)
    {
        lnf_fpenv env = lnf_fpenv_enter();
#pragma omp for schedule(static)
        for (ptrdiff_t k = 0; k < nblocks; k++)
            sum_partials(part, nchunks, stride, k * LNF_SUM_BLOCK,
                         LNF_MIN((k + 1) * LNF_SUM_BLOCK, width), a->dwdb, a->dwdb_dtype);
        lnf_fpenv_leave(env);
    }
}

#undef F
