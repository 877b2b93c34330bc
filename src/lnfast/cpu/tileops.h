/* The tile operations of one storage type and one instruction set, for
 * rows whose elements are far apart but whose neighbouring rows are
 * adjacent (a channels-first (N, C, H, W) array normalized over C: N H W
 * rows of C elements H W apart).  Part of the rowops.h template, which
 * includes this once.
 *
 * A tile is LNF_TILE such rows side by side: element i of row j is at
 * (S *)(p + i inner) + j.  Each operation walks the tile column by column
 * (i), the rows of a column in the lanes of a vector (j), so memory is read
 * in order, a column's LNF_TILE values at a time; each row's arithmetic
 * stays in its own lane, the same on every instruction set (tile_v: a GCC
 * vector of LNF_TILE lanes, or a plain C array of them).  The drivers copy
 * shorter tiles (at the end of a run of adjacent rows) into a full one.
 *
 * Sums follow the rows' scheme (rowops.h) with a row's columns as its
 * terms, in order: LNF_BLOCK terms summed in LNF_T, groups of LNF_SUPER
 * block sums (float64: LNF_TILE_SUPER_F64) added in LNF_T from 0 (the last
 * group possibly shorter), each group widened into the lane's float64 sum
 * (TILE_BLOCKS); float64 first adds LNF_TILE_MID_F64 groups from 0 into a
 * mid level (TILE_MID), the last possibly shorter.  The backward map adds
 * each lane's dweight/dbias terms of a column into that lane's run in LNF_T
 * (a run of LNF_RUN_ROWS tiles, as the rows' float32 runs of LNF_RUN_ROWS
 * rows; the driver adds the runs into the float64 partial rows).
 *   tile_sums       the forward sums (LayerNorm: about the first column, or
 *                   about the shifts given); z = x + residual when given
 *   tile_map        the forward map
 *   tile_grad_sums  the backward sums
 *   tile_grad_map   the backward map: dx, and the dweight/dbias runs
 *   tile_fold       the runs added across their lanes into the partial rows
 */
#ifndef LNFAST_ROWOPS_H
#error "tileops.h: part of rowops.h"
#endif

/* Column i of a tile at p. */
#define TCOL(p, i) ((LNF_S *)(void *)((char *)(p) + (i) * inner))
/* Columns per group, summed from zero and then added into the lane's
 * float64 sum: for float32 arithmetic, widened then; for float64, second
 * and third levels (groups per mid level: TILE_MID), so that a long row is
 * not one running sum per lane (the row kernels' lanes split it). */
#if LNF_DOUBLE
#define TILE_BLOCKS (LNF_BLOCK * LNF_TILE_SUPER_F64)
#define TILE_MID LNF_TILE_MID_F64
#else
#define TILE_BLOCKS (LNF_BLOCK * LNF_SUPER)
#define TILE_MID 1
#endif
/* fetch(line) for each line of column p LNF_TILE_AHEAD tiles ahead.  The
 * inputs' lines go into the L2 (TILE_PREFETCH): the L1 would evict them
 * again before their tile comes where the columns share few sets. */
#define TILE_AHEAD(p, fetch)                                                      \
    do {                                                                          \
        for (ptrdiff_t o_ = 0; o_ < LNF_TILE * (ptrdiff_t)sizeof(LNF_S); o_ += 64) \
            fetch((char *)(p) + LNF_TILE_AHEAD * LNF_TILE * sizeof(LNF_S) + o_);  \
    } while (0)
#define TILE_PREFETCH(p) TILE_AHEAD(p, LNF_PREFETCH_L2)

/* tile_v: LNF_TILE lanes of LNF_T, as TILE_W pieces of tile_e (vectors
 * of the unit's width, or single values in plain C); tile_d: LNF_TILE
 * float64 lanes.  Passed by value to always-inline helpers, which the
 * compiler keeps in registers. */
#if LNF_VECTOR
#define TILE_W LNF_NV
#define TILE_DW LNF_ND
typedef LNF_VT tile_e;
typedef LNF_VD tile_de;
#else
#define TILE_W LNF_TILE
#define TILE_DW LNF_TILE
typedef LNF_T tile_e;
typedef double tile_de;
#endif
typedef struct { tile_e v[TILE_W]; } tile_v;
typedef struct { tile_de v[TILE_DW]; } tile_d;

#define TV_OP(name, type, n, op)                                                \
    LNF_ATTR LNF_INLINE type name(type a, type b)                               \
    {                                                                           \
        for (int u = 0; u < n; u++)                                             \
            a.v[u] = a.v[u] op b.v[u];                                          \
        return a;                                                               \
    }
TV_OP(tv_add, tile_v, TILE_W, +)
TV_OP(tv_sub, tile_v, TILE_W, -)
TV_OP(tv_mul, tile_v, TILE_W, *)
TV_OP(td_add, tile_d, TILE_DW, +)
#undef TV_OP
#define TV_ADD(a, b) tv_add(a, b)
#define TV_SUB(a, b) tv_sub(a, b)
#define TV_MUL(a, b) tv_mul(a, b)
#define TD_ADD(a, b) td_add(a, b)

LNF_ATTR LNF_INLINE tile_v tv_splat(LNF_T s)
{
    tile_v t;
    for (int u = 0; u < TILE_W; u++)
#if LNF_VECTOR
        t.v[u] = LNF_SPLAT(s);
#else
        t.v[u] = s;
#endif
    return t;
}
#define TV_SPLAT(s) tv_splat(s)

/* The lanes in float64 (exactly). */
LNF_ATTR LNF_INLINE tile_d tv_widen(tile_v t)
{
    tile_d d;
#if LNF_VECTOR && !LNF_DOUBLE
    for (int u = 0; u < TILE_W; u++) {
        LNF_VDD w = __builtin_convertvector(t.v[u], LNF_VDD);
        d.v[2 * u] = LNF_HALF(w, 0);
        d.v[2 * u + 1] = LNF_HALF(w, 1);
    }
#else
    for (int u = 0; u < TILE_W; u++)
        d.v[u] = t.v[u];
#endif
    return d;
}
#define TV_WIDEN(v) tv_widen(v)

/* The float64 sums g of the group of columns from g0 into the lanes' sums
 * a: through the mid level m where TILE_MID > 1 (closed into a at every
 * TILE_MID-th group and at the last, which ends at D). */
LNF_ATTR LNF_INLINE void tile_add_group(tile_d *a, tile_d *m, tile_d g, ptrdiff_t g0, ptrdiff_t D)
{
#if TILE_MID > 1
    *m = TD_ADD(*m, g);
    if ((g0 / TILE_BLOCKS) % TILE_MID == TILE_MID - 1 || g0 + TILE_BLOCKS >= D) {
        *a = TD_ADD(*a, *m);
        *m = TV_WIDEN(TV_SPLAT(0));
    }
#else
    (void)m, (void)g0, (void)D;
    *a = TD_ADD(*a, g);
#endif
}

/* LNF_TILE values of LNF_T from memory, and to it: a piece at a time,
 * each through a tile_e of its own (GCC 12 takes a whole two-vector
 * tile_v through the stack and general registers, and a memcpy straight
 * into a member through narrower stack copies that the vector reload
 * cannot forward from). */
LNF_ATTR LNF_INLINE tile_v tv_lanes(const void *p)
{
    tile_v v;
    for (int u = 0; u < TILE_W; u++) {
        tile_e e;
        memcpy(&e, (const char *)p + u * sizeof e, sizeof e);
        v.v[u] = e;
    }
    return v;
}

LNF_ATTR LNF_INLINE void tv_put(void *p, tile_v v)
{
    for (int u = 0; u < TILE_W; u++) {
        tile_e e = v.v[u];
        memcpy((char *)p + u * sizeof e, &e, sizeof e);
    }
}

/* A column of the storage type in lanes (16-bit: widened exactly), and
 * lanes stored to one (16-bit: rounded to nearest even, once). */
LNF_ATTR LNF_INLINE tile_v tv_load(const LNF_S *p)
{
    tile_v t;
    for (int u = 0; u < TILE_W; u++)
#if LNF_VECTOR
        t.v[u] = LNF_LOADS(p + u * LNF_VE);
#else
        t.v[u] = LNF_GET(p, u);
#endif
    return t;
}

LNF_ATTR LNF_INLINE void tv_store(LNF_S *p, tile_v t)
{
#if LNF_VECTOR
    if (TILE_W % LNF_MAPW == 0)         /* (narrowed in pairs where it can) */
        for (int u = 0; u < TILE_W; u += LNF_MAPW)
            LNF_STORESW(p + u * LNF_VE, t.v + u);
    else
        for (int u = 0; u < TILE_W; u++)
            LNF_STORES(p + u * LNF_VE, t.v[u]);
#else
    for (int u = 0; u < TILE_W; u++)
        LNF_PUT(p, u, t.v[u]);
#endif
}

/* An output column: with nt, streaming stores (whole lines, no read for
 * ownership; float32 and float64 only), a vector at a time, since the
 * columns are aligned to the line (lnf_tile_streamed); else its lines
 * LNF_TILE_AHEAD tiles ahead are fetched for writing, since the tiles'
 * many columns outrun the hardware's stream detection. */
#if LNF_CAN_STREAM && LNF_VB == 64
#include <immintrin.h>
#define TILE_NTSTORE(p, v) _mm512_stream_si512((__m512i *)(void *)(p), (__m512i)(v))
#elif LNF_CAN_STREAM && LNF_VB == 32
#include <immintrin.h>
#define TILE_NTSTORE(p, v) _mm256_stream_si256((__m256i *)(void *)(p), (__m256i)(v))
#else
#define TILE_NTSTORE(p, v) LNF_OUT(p, v, 1)
#endif
LNF_ATTR LNF_INLINE void tv_out(LNF_S *p, tile_v t, int nt)
{
#if LNF_VECTOR
    if (nt) {
        for (int u = 0; u < TILE_W; u++)
            TILE_NTSTORE(p + u * LNF_VE, t.v[u]);
        return;
    }
#endif
    (void)nt;
    TILE_AHEAD(p, LNF_PREFETCHW);
    tv_store(p, t);
}

/* A column of the backward sums' x or dy, read with a carry.  Between one
 * tile and the next the sums read a line or two of each of x's and dy's
 * columns: a few hundred lines, which can fall into few of the L1's sets
 * (columns a power of two apart, or nearly), so that the line a column
 * shares with the next tile's (where the columns start off a line, as
 * NumPy's large arrays start 16 bytes into one) is gone when that tile
 * comes.  With a carry each column also reads, aligned, the lines after
 * the one it starts on, up to the one the next tile's column starts on (a
 * tile ahead), and keeps that one in carries[slot] (a line, in a slot of
 * LNF_TILE values) for the next tile, which takes its values from the
 * carry and the lines after it (LNF_TILE_CARRIED); LNF_TILE_START reads
 * the column as usual and keeps the last line.  The caller asks for a
 * carry only where the next tile is a full one of the same run and
 * thread, which holds the rest of that line (lnf_tile_carry_mode); the
 * columns start on whole elements (lnf_rows_ok).  Where vectors are a
 * line wide (AVX-512 float32 and float64); elsewhere the plain load.  The
 * values are those of the plain load: no bit changes. */
#define TILE_CARRY (LNF_VECTOR && !LNF_STORAGE16 && LNF_VB == 64 && LNF_CAN_STREAM)
#if TILE_CARRY
#if LNF_DOUBLE
typedef int64_t tile_i;
#else
typedef int32_t tile_i;
#endif
typedef tile_i tile_ix __attribute__((vector_size(LNF_VB)));
static const tile_i tile_iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#endif
LNF_ATTR LNF_INLINE tile_v tv_load_carry(const LNF_S *p, LNF_T *carries, ptrdiff_t slot,
                                         int mode)
{
#if TILE_CARRY
    size_t off = (uintptr_t)p % 64;
    if (mode != LNF_TILE_PLAIN) {
        LNF_T *carry = carries + slot * LNF_TILE;
        const char *line = (const char *)p - off;
        LNF_VT l[TILE_W + 1];
        for (int u = 1; u <= TILE_W; u++)
            l[u] = *(const LNF_VT *)(const void *)(line + 64 * u);
        tile_v t;
        if (mode == LNF_TILE_CARRIED) {
            tile_ix at;     /* lane j takes element j + off of the two lines */
            memcpy(&at, tile_iota, sizeof at);
            at += (tile_i)(off / sizeof(LNF_S));
            memcpy(&l[0], carry, sizeof l[0]);
            for (int u = 0; u < TILE_W; u++)
#if LNF_DOUBLE
                t.v[u] = (LNF_VT)_mm512_permutex2var_pd((__m512d)l[u], (__m512i)at,
                                                        (__m512d)l[u + 1]);
#else
                t.v[u] = (LNF_VT)_mm512_permutex2var_ps((__m512)l[u], (__m512i)at,
                                                        (__m512)l[u + 1]);
#endif
        } else {
            t = tv_load(p);
        }
        memcpy(carry, &l[TILE_W], sizeof l[0]);
        return t;
    }
#else
    (void)carries, (void)slot, (void)mode;
#endif
    return tv_load(p);
}

/* Column i of the rows to sum: x, or z = x + r as stored (value1). */
LNF_ATTR LNF_INLINE tile_v tile_value(const void *x, const void *r, ptrdiff_t inner, ptrdiff_t i)
{
    tile_v e = tv_load(TCOL(x, i));
    if (r == NULL)
        return e;
    e = TV_ADD(e, tv_load(TCOL(r, i)));
    if (LNF_STORAGE16) {
        LNF_S z[LNF_TILE];
        tv_store(z, e);
        e = tv_load(z);
    }
    return e;
}

/* tile_value, z stored to its column (next1). */
LNF_ATTR LNF_INLINE tile_v tile_in(const void *x, const void *r, void *z, ptrdiff_t inner,
                                   ptrdiff_t i)
{
    if (r == NULL)
        return tv_load(TCOL(x, i));
    TILE_PREFETCH(TCOL(r, i));
    tile_v e = tile_value(x, r, inner, i);
    tv_store(TCOL(z, i), e);
    return e;
}

/* Each lane's row_shift (rowops.h) into sh[0:T): the mean of its row's
 * first LNF_SHIFT_TERMS values, added in float64 in order, or the first
 * value where that mean is not finite.  (Stored, not returned: GCC 12 at
 * -O2 kept only a quarter of an AVX-512 tile_v returned from this
 * out-of-line function into an array element.) */
LNF_ATTR static void tile_shift(const void *x, const void *r, ptrdiff_t inner, ptrdiff_t D,
                                LNF_T *sh)
{
    ptrdiff_t k = D < LNF_SHIFT_TERMS ? D : LNF_SHIFT_TERMS;
    tile_v first = tile_value(x, r, inner, 0);
    tile_d sum = TV_WIDEN(first);
    for (ptrdiff_t i = 1; i < k; i++)
        sum = TD_ADD(sum, TV_WIDEN(tile_value(x, r, inner, i)));
    double m[LNF_TILE];
    LNF_T f[LNF_TILE];
    memcpy(m, &sum, sizeof m);
    memcpy(f, &first, sizeof f);
    for (int j = 0; j < LNF_TILE; j++) {
        double v = SHIFT_MEAN(m[j], k);
        sh[j] = v - v == 0.0 ? (LNF_T)v : f[j];
    }
}

/* d = column i of the rows to sum (tile_in) less the shift, the column
 * kept in `keep` where given. */
LNF_ATTR LNF_INLINE tile_v tile_sums_col(const void *x, const void *r, void *z, ptrdiff_t inner,
                                         ptrdiff_t i, LNF_T *keep, tile_v sh)
{
    TILE_PREFETCH(TCOL(x, i));
    tile_v e = tile_in(x, r, z, inner, i);
    if (keep != NULL)
        tv_put(keep + i * LNF_TILE, e);
    return TV_SUB(e, sh);
}

/* s[0:T) = the lanes' sums of d = x - shift, s[T:2T) of d^2, s[2T:3T) the
 * shifts: shift[0:T) where given, else (centered) tile_shift's, else 0.
 * With r: x + r, stored to z and read as stored.  Where `copy` is
 * given, the values summed (x, or z as stored) are kept there in LNF_T,
 * LNF_TILE per column, for the map to read from the cache: rows far
 * apart may share few cache sets (a power of two apart, all of them).
 * NT adjacent tiles at once (1 or 2), tile k's LNF_TILE rows after tile
 * k - 1's, its shift, s and copy after tile k - 1's (LNF_TILE, 3 LNF_TILE
 * and D LNF_TILE values): each column's lines of the NT tiles are read
 * together, each tile's arithmetic as on its own. */
LNF_ATTR LNF_INLINE void tile_sums_n(const void *x, const void *r, void *z, ptrdiff_t inner,
                                     int centered, const void *shift, double *s, ptrdiff_t D,
                                     void *copy, const int NT)
{
    enum { T = LNF_TILE };
    const ptrdiff_t tb = T * (ptrdiff_t)sizeof(LNF_S);   /* bytes from a tile to the next */
    const char *xk[2], *rk[2];
    char *zk[2];
    LNF_T *keep[2];
    tile_v sh[2];
    tile_d a1[2], a2[2], m1[2], m2[2];
    for (int k = 0; k < NT; k++) {
        xk[k] = (const char *)x + k * tb;
        rk[k] = r != NULL ? (const char *)r + k * tb : NULL;
        zk[k] = r != NULL ? (char *)z + k * tb : NULL;
        keep[k] = copy != NULL ? (LNF_T *)copy + k * D * T : NULL;
        LNF_T lanes[T] = {0};
        if (shift == NULL && centered)
            tile_shift(xk[k], rk[k], inner, D, lanes);
        sh[k] = tv_lanes(shift != NULL ? (const LNF_T *)shift + k * T : lanes);
        a1[k] = a2[k] = m1[k] = m2[k] = TV_WIDEN(TV_SPLAT(0));
    }
    for (ptrdiff_t g0 = 0; g0 < D; g0 += TILE_BLOCKS) {
        ptrdiff_t g1 = g0 + TILE_BLOCKS < D ? g0 + TILE_BLOCKS : D;
        tile_v s1[2], s2[2];
        for (int k = 0; k < NT; k++)
            s1[k] = s2[k] = TV_SPLAT(0);
        for (ptrdiff_t b0 = g0; b0 < g1; b0 += LNF_BLOCK) {
            ptrdiff_t b1 = b0 + LNF_BLOCK < g1 ? b0 + LNF_BLOCK : g1;
            tile_v t1[2], t2[2];
            for (int k = 0; k < NT; k++) {
                t1[k] = tile_sums_col(xk[k], rk[k], zk[k], inner, b0, keep[k], sh[k]);
                t2[k] = TV_MUL(t1[k], t1[k]);
            }
            for (ptrdiff_t i = b0 + 1; i < b1; i++)
                for (int k = 0; k < NT; k++) {
                    tile_v d = tile_sums_col(xk[k], rk[k], zk[k], inner, i, keep[k], sh[k]);
                    t1[k] = TV_ADD(t1[k], d);
                    t2[k] = TV_ADD(t2[k], TV_MUL(d, d));
                }
            for (int k = 0; k < NT; k++) {
                s1[k] = TV_ADD(s1[k], t1[k]);
                s2[k] = TV_ADD(s2[k], t2[k]);
            }
        }
        for (int k = 0; k < NT; k++) {
            tile_add_group(&a1[k], &m1[k], TV_WIDEN(s1[k]), g0, D);
            tile_add_group(&a2[k], &m2[k], TV_WIDEN(s2[k]), g0, D);
        }
    }
    for (int k = 0; k < NT; k++) {
        tile_d shd = TV_WIDEN(sh[k]);
        memcpy(s + 3 * T * k, &a1[k], sizeof a1[k]);
        memcpy(s + 3 * T * k + T, &a2[k], sizeof a2[k]);
        memcpy(s + 3 * T * k + 2 * T, &shd, sizeof shd);
    }
}

LNF_ATTR static void tile_sums(const void *x, const void *r, void *z, ptrdiff_t inner,
                               int centered, const void *shift, double *s, ptrdiff_t D,
                               void *copy, int tiles)
{
    if (tiles == 2)
        tile_sums_n(x, r, z, inner, centered, shift, s, D, copy, 2);
    else
        tile_sums_n(x, r, z, inner, centered, shift, s, D, copy, 1);
}

/* y = the forward map of NT adjacent tiles (map1) of the values xs
 * (tile_sums' copy), k = {hi[T], lo[T], rstd[T]} per tile (after tile
 * k - 1's, as the copies); b NULL: RMSNorm.  stream: y's columns by
 * streaming stores (the caller checks their alignment and fences). */
LNF_ATTR LNF_INLINE void tile_map_n(const void *xs, void *y, ptrdiff_t inner, const void *w,
                                    const void *b, const void *k, ptrdiff_t D, int stream,
                                    const int NT)
{
    enum { T = LNF_TILE };
    const int nt = LNF_CAN_STREAM && !LNF_STORAGE16 && stream;
    const LNF_T *wt = w, *bt = b, *kt = k, *xt = xs;
    tile_v hi[2], lo[2], rs[2];
    for (int q = 0; q < NT; q++) {
        hi[q] = tv_lanes(kt + 3 * T * q);
        lo[q] = tv_lanes(kt + 3 * T * q + T);
        rs[q] = tv_lanes(kt + 3 * T * q + 2 * T);
    }
    for (ptrdiff_t i = 0; i < D; i++)
        for (int q = 0; q < NT; q++) {
            tile_v e = tv_lanes(xt + (q * D + i) * T);
            LNF_S *yc = (LNF_S *)(void *)((char *)TCOL(y, i) + q * T * (ptrdiff_t)sizeof(LNF_S));
            if (bt != NULL)
                tv_out(yc, TV_ADD(TV_MUL(TV_MUL(TV_SUB(TV_SUB(e, hi[q]), lo[q]), rs[q]),
                                         TV_SPLAT(wt[i])),
                                  TV_SPLAT(bt[i])), nt);
            else
                tv_out(yc, TV_MUL(TV_MUL(e, rs[q]), TV_SPLAT(wt[i])), nt);
        }
}

LNF_ATTR static void tile_map(const void *xs, void *y, ptrdiff_t inner, const void *w,
                              const void *b, const void *k, ptrdiff_t D, int stream, int tiles)
{
    if (tiles == 2)
        tile_map_n(xs, y, inner, w, b, k, D, stream, 2);
    else
        tile_map_n(xs, y, inner, w, b, k, D, stream, 1);
}

/* The backward sums' terms of column i: d = x - m, g = dy w, g d; x and dy
 * kept in the copies; read with their carries (tv_load_carry: x's in
 * slots 0 to D, dy's in D to 2 D). */
LNF_ATTR LNF_INLINE void tile_grad_terms(const void *x, const void *dy, ptrdiff_t inner, tile_v m,
                                         const LNF_T *w, ptrdiff_t i, tile_v t[3], LNF_T *xs,
                                         LNF_T *dys, LNF_T *carries, ptrdiff_t D, int mode)
{
    TILE_PREFETCH(TCOL(x, i));
    TILE_PREFETCH(TCOL(dy, i));
    tile_v xi = tv_load_carry(TCOL(x, i), carries, i, mode);
    tile_v dyi = tv_load_carry(TCOL(dy, i), carries, D + i, mode);
    tv_put(xs + i * LNF_TILE, xi);
    tv_put(dys + i * LNF_TILE, dyi);
    t[0] = TV_SUB(xi, m);
    t[1] = TV_MUL(dyi, TV_SPLAT(w[i]));
    t[2] = TV_MUL(t[1], t[0]);
}

/* The backward sums of the tile (grad_terms1): s[0:T) of d = x - mean,
 * s[T:2T) of g = dy w, s[2T:3T) of g d; mean[0:T) per lane (RMSNorm: 0).
 * x and dy are kept in xs and dys in LNF_T, LNF_TILE per column, for the
 * map (tile_sums); read with the carries (2 D LNF_TILE values) as mode
 * says (tile_grad_terms). */
LNF_ATTR static void tile_grad_sums(const void *x, const void *dy, ptrdiff_t inner,
                                    const void *w, const void *mean, double *s, ptrdiff_t D,
                                    void *xs, void *dys, void *carries, int mode)
{
    const LNF_T *wt = w;
    tile_v m = tv_lanes(mean);
    tile_d a[3], mid[3];
    a[0] = a[1] = a[2] = mid[0] = mid[1] = mid[2] = TV_WIDEN(TV_SPLAT(0));
    for (ptrdiff_t g0 = 0; g0 < D; g0 += TILE_BLOCKS) {
        ptrdiff_t g1 = g0 + TILE_BLOCKS < D ? g0 + TILE_BLOCKS : D;
        tile_v s0 = TV_SPLAT(0), s1 = s0, s2 = s0;
        for (ptrdiff_t b0 = g0; b0 < g1; b0 += LNF_BLOCK) {
            ptrdiff_t b1 = b0 + LNF_BLOCK < g1 ? b0 + LNF_BLOCK : g1;
            tile_v t[3], u[3];
            tile_grad_terms(x, dy, inner, m, wt, b0, t, xs, dys, carries, D, mode);
            for (ptrdiff_t i = b0 + 1; i < b1; i++) {
                tile_grad_terms(x, dy, inner, m, wt, i, u, xs, dys, carries, D, mode);
                for (int q = 0; q < 3; q++)
                    t[q] = TV_ADD(t[q], u[q]);
            }
            tile_v t0 = t[0], t1 = t[1], t2 = t[2];
            s0 = TV_ADD(s0, t0);
            s1 = TV_ADD(s1, t1);
            s2 = TV_ADD(s2, t2);
        }
        tile_add_group(&a[0], &mid[0], TV_WIDEN(s0), g0, D);
        tile_add_group(&a[1], &mid[1], TV_WIDEN(s1), g0, D);
        tile_add_group(&a[2], &mid[2], TV_WIDEN(s2), g0, D);
    }
    memcpy(s, a, sizeof a);
}

/* Column i of the backward map (grad_map1) of a tile kept in xs, dys: dx
 * (+ dz when given) to its column `inner` bytes apart, the lanes' dweight
 * terms dy xhat added into the runs rw, their dy into rb (NULL: RMSNorm),
 * or stored there where `first`; q = {mean, c, rstd, mean(g), mean(g
 * xhat)}. */
LNF_ATTR LNF_INLINE void tile_grad_col(const LNF_T *xs, const LNF_T *dys, const void *dz,
                                       void *dx, ptrdiff_t inner, const tile_v *q, LNF_T *rw,
                                       LNF_T *rb, const LNF_T *w, ptrdiff_t i, int nt, int first)
{
    tile_v dyi = tv_lanes(dys + i * LNF_TILE);
    tile_v xh = TV_MUL(TV_SUB(TV_SUB(tv_lanes(xs + i * LNF_TILE), q[0]), q[1]), q[2]);
    tile_v dxi = TV_MUL(q[2], TV_SUB(TV_SUB(TV_MUL(dyi, TV_SPLAT(w[i])), q[3]), TV_MUL(xh, q[4])));
    if (dz != NULL)
        dxi = TV_ADD(dxi, tv_load(TCOL(dz, i)));
    tv_out(TCOL(dx, i), dxi, nt);
    tile_v gw = TV_MUL(dyi, xh);
    tv_put(rw + i * LNF_TILE, first ? gw : TV_ADD(tv_lanes(rw + i * LNF_TILE), gw));
    if (rb != NULL)
        tv_put(rb + i * LNF_TILE, first ? dyi : TV_ADD(tv_lanes(rb + i * LNF_TILE), dyi));
}

LNF_ATTR LNF_INLINE void tile_grad_cols(const void *xs, const void *dys, const void *dz,
                                        void *dx, ptrdiff_t inner, const tile_v *q, void *gw,
                                        void *gb, const void *w, ptrdiff_t D, int nt, int first)
{
    if (dz == NULL && gb != NULL)       /* (the common cases, with no tests per column) */
        for (ptrdiff_t i = 0; i < D; i++)
            tile_grad_col(xs, dys, NULL, dx, inner, q, gw, gb, w, i, nt, first);
    else if (dz == NULL)
        for (ptrdiff_t i = 0; i < D; i++)
            tile_grad_col(xs, dys, NULL, dx, inner, q, gw, NULL, w, i, nt, first);
    else
        for (ptrdiff_t i = 0; i < D; i++)
            tile_grad_col(xs, dys, dz, dx, inner, q, gw, gb, w, i, nt, first);
}

/* The backward map of a tile from xs and dys (tile_grad_sums' copies; k:
 * the five q of tile_grad_col, LNF_TILE values each), dx and dz `inner`
 * bytes apart; gw, gb: the dweight/dbias runs, which the first tile of a
 * run (`first`) stores rather than adds to (0 + t is t: the sign of a zero
 * term never reaches the float64 sums, which start at +0).  stream: dx by
 * streaming stores. */
LNF_ATTR static void tile_grad_map(const void *xs, const void *dys, const void *dz, void *dx,
                                   ptrdiff_t inner, const void *k, void *gw, void *gb,
                                   const void *w, ptrdiff_t D, int stream, int first)
{
    const int nt = LNF_CAN_STREAM && !LNF_STORAGE16 && stream;
    tile_v q[5];
    for (int j = 0; j < 5; j++)
        q[j] = tv_lanes((const LNF_T *)k + j * LNF_TILE);
    if (first)
        tile_grad_cols(xs, dys, dz, dx, inner, q, gw, gb, w, D, nt, 1);
    else
        tile_grad_cols(xs, dys, dz, dx, inner, q, gw, gb, w, D, nt, 0);
}
/* As many runs folded at once as a vector holds float64 values
 * (TILE_FOLDN: 8 for AVX-512, 4 for AVX2), each run's additions those of
 * LNF_FOLD in its own lane, the runs side by side, so that no addition
 * waits on the one before: a = LNF_FOLD_VECTORS's vector, then for 64-byte
 * vectors a_k + a_k+4, then those k and k + 2, then the last two; for
 * 32-byte ones a_k + a_k+2, then the two. */
#if LNF_VECTOR && (LNF_VB == 64 || LNF_VB == 32) && (defined(__clang__) || __GNUC__ >= 12)
#define TILE_FOLDN (LNF_VB / 8)
#else
#define TILE_FOLDN 0
#endif
#if TILE_FOLDN
#define TILE_SHUF(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
LNF_ATTR LNF_INLINE void tile_foldv(const LNF_T *r, double *dw)
{
    LNF_VD a[TILE_FOLDN], s, o;
    for (int q = 0; q < TILE_FOLDN; q++) {
        tile_d d = TV_WIDEN(tv_lanes(r + q * LNF_TILE));
        LNF_FOLD_VECTORS(d.v);
        a[q] = d.v[0];
    }
#if LNF_VB == 64
    LNF_VD w[4], z[2];
    for (int q = 0; q < 4; q++)         /* [b_q, b_q+4], b_k = a_k + a_k+4 */
        w[q] = TILE_SHUF(a[q], a[q + 4], 0, 1, 2, 3, 8, 9, 10, 11)
               + TILE_SHUF(a[q], a[q + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int q = 0; q < 2; q++)         /* [c_q, c_q+4, c_q+2, c_q+6], c_k = b_k + b_k+2 */
        z[q] = TILE_SHUF(w[q], w[q + 2], 0, 1, 4, 5, 8, 9, 12, 13)
               + TILE_SHUF(w[q], w[q + 2], 2, 3, 6, 7, 10, 11, 14, 15);
    s = TILE_SHUF(z[0], z[1], 0, 8, 2, 10, 4, 12, 6, 14)
        + TILE_SHUF(z[0], z[1], 1, 9, 3, 11, 5, 13, 7, 15);
    s = TILE_SHUF(s, s, 0, 1, 4, 5, 2, 3, 6, 7);
#else
    LNF_VD w[2];
    for (int q = 0; q < 2; q++)         /* [b_q, b_q+2], b_k = a_k + a_k+2 */
        w[q] = TILE_SHUF(a[q], a[q + 2], 0, 1, 4, 5) + TILE_SHUF(a[q], a[q + 2], 2, 3, 6, 7);
    s = TILE_SHUF(w[0], w[1], 0, 4, 2, 6) + TILE_SHUF(w[0], w[1], 1, 5, 3, 7);
#endif
    memcpy(&o, dw, sizeof o);
    o += s;
    memcpy(dw, &o, sizeof o);
}
#undef TILE_SHUF
#endif

/* dw[i] += the sum of run i's LNF_TILE lanes in float64, halves added
 * into halves (lnf_fold's order, LNF_FOLD), for i < width. */
LNF_ATTR static void tile_fold(void *runs, double *dw, ptrdiff_t width)
{
    const LNF_T *r = runs;
    ptrdiff_t i = 0;
#if TILE_FOLDN
    for (; i + TILE_FOLDN <= width; i += TILE_FOLDN)
        tile_foldv(r + i * LNF_TILE, dw + i);
#endif
    for (; i < width; i++) {
        tile_d d = TV_WIDEN(tv_lanes(r + i * LNF_TILE));
        dw[i] += LNF_FOLD(d.v, d.v);
    }
}
#undef TCOL
#undef TILE_BLOCKS
#undef TILE_MID
#undef TILE_PREFETCH
#undef TILE_AHEAD
#undef TILE_NTSTORE
#undef TILE_CARRY
#undef TILE_FOLDN
#undef TV_ADD
#undef TV_SUB
#undef TV_MUL
#undef TD_ADD
#undef TV_SPLAT
#undef TV_WIDEN
#undef TILE_W
#undef TILE_DW
