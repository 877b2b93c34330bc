/* The row operations of one storage type and one instruction set: the
 * innermost loops of the CPU kernels.
 *
 * A template: each rows_<type>_<isa>.c unit sets it up and includes it
 * once, which defines the unit's table of row operations,
 * lnf_ops_<LNF_NAME> (kernels.h).  The storage type's header (type_<type>.h)
 * sets LNF_T (float or double, the compute type), LNF_DOUBLE (1 when LNF_T
 * is double), LNF_S (the storage type) and LNF_STORAGE16 (1 for 16-bit
 * storage, with its conversions LNF_TO_F32 and LNF_FROM_F32 for one value);
 * the unit sets LNF_NAME, LNF_ATTR (the functions' target attribute),
 * LNF_VB (the vector width in bytes: 64, 32 or 16) and, for 16-bit
 * storage, LNF_VWIDEN and LNF_VNARROW for one vector's values and
 * optionally LNF_VNARROW2 for two vectors'.
 *
 * Each operation is one sweep over a row's columns (dispatch.c picks the
 * build; the drivers in forward.c and backward.c call them):
 *   sums           the sums of a row (LayerNorm: about a shift)
 *   map            the forward map of a row
 *   map_sums       the map of a row and the sums of the next, in one sweep
 *   grad_sums      the backward sums of a row
 *   grad_map       the backward map of a row (dx, dweight/dbias terms)
 *   grad_map_sums  the backward map of a row and the sums of the next
 * and, for rows far apart whose neighbours are adjacent, the tile
 * operations of tileops.h.
 * The *_sums pairs keep memory busy: the next row streams in while this
 * one is written.  Sums do not depend on whether a map ran alongside.
 *
 * Sums run in LNF_LANES float64 lanes, fed in blocks: lane k first adds up
 * LNF_BLOCK elements k, k + LANES, k + 2 LANES, ... in LNF_T, in order, and
 * the block sum is widened and added to the lane.  One conversion per block
 * instead of one per element keeps float32 rows near memory speed; a block
 * sum of four float32 terms costs about one float32 rounding of a term, far
 * below the output's own rounding.  Each lane adds LNF_SUPER blocks' sums
 * in LNF_T (from 0, in block order) into a group before widening it, the
 * last group possibly shorter: for float32, a quarter of the conversions
 * (the float32 rows' rstd stays within 1.6 ulp).  float64 adds LNF_MID
 * groups (from 0, in order) into a mid level before the lane takes them,
 * the last possibly shorter: three short sums in a row instead of one
 * long running sum, whose roundings can all lean one way.  After the full
 * blocks, single vectors are blocks of one; the n % LANES tail is summed
 * on its own and added last, after the lanes are folded pairwise.  The
 * GCC/clang vector code of every width and the plain C fallback follow
 * exactly this order, so every build and every instruction set gives the
 * same bits.
 */
#if !defined(LNF_NAME) || !defined(LNF_T) || !defined(LNF_S) || !defined(LNF_DOUBLE) \
    || !defined(LNF_STORAGE16) || !defined(LNF_ATTR) || !defined(LNF_VB)
#error "rowops.h: a rows_*.c unit defines LNF_NAME, LNF_T, LNF_S, LNF_DOUBLE, \
LNF_STORAGE16, LNF_ATTR and LNF_VB first"
#endif
#if LNF_STORAGE16 && !(defined(LNF_TO_F32) && defined(LNF_FROM_F32) \
                       && (!LNF_VECTOR || (defined(LNF_VWIDEN) && defined(LNF_VNARROW))))
#error "rowops.h: 16-bit storage needs LNF_TO_F32, LNF_FROM_F32, LNF_VWIDEN and LNF_VNARROW"
#endif
#ifdef LNFAST_ROWOPS_H
#error "rowops.h: one instance per unit"
#endif
#define LNFAST_ROWOPS_H

#include "kernels.h"

#define LNF_CAT_(a, b) a##_##b
#define LNF_CAT(a, b) LNF_CAT_(a, b)
#define LNF_STEP (LNF_LANES * LNF_BLOCK)
#if !LNF_DOUBLE
#define LNF_SUPER LNF_SUPER_F32
#define LNF_MID 1
#else
#define LNF_SUPER LNF_SUPER_F64
#define LNF_MID LNF_MID_F64
#endif

/* Row data (x, y, z, dy, dz, dx) is stored as LNF_S: LNF_GET/LNF_PUT read
 * and write one element in LNF_T.  16-bit rows convert exactly when read
 * and round to nearest even, once, when written. */
#if !LNF_STORAGE16
#define LNF_GET(p, i) ((p)[i])
#define LNF_PUT(p, i, v) ((p)[i] = (v))
#else
#define LNF_GET(p, i) LNF_TO_F32((p)[i])
#define LNF_PUT(p, i, v) ((p)[i] = LNF_FROM_F32(v))
#endif

#if LNF_VECTOR
/* LNF_LANES elements are LNF_NV vectors of LNF_VE elements, loaded and
 * stored without alignment requirements; the float64 lanes are LNF_ND
 * vectors of LNF_VB bytes.  Macros, not functions: vectors may not cross a
 * call in the baseline (SSE2) build. */
typedef LNF_T lnf_vt __attribute__((vector_size(LNF_VB)));
typedef double lnf_vd __attribute__((vector_size(LNF_VB)));
typedef double lnf_vdd __attribute__((vector_size(2 * LNF_VB)));
#define LNF_VT lnf_vt
#define LNF_VD lnf_vd
#define LNF_VDD lnf_vdd
#define LNF_VE ((ptrdiff_t)(LNF_VB / sizeof(LNF_T)))
#define LNF_NV (LNF_LANES / (int)LNF_VE)
#define LNF_ND (LNF_LANES * 8 / LNF_VB)
#define LNF_LOAD(p) ({ LNF_VT v_; memcpy(&v_, (p), sizeof v_); v_; })
#define LNF_STORE(p, v) do { LNF_VT s_ = (v); memcpy((p), &s_, sizeof s_); } while (0)
#define LNF_SPLAT(s) ((LNF_T)(s) - (LNF_VT){0})
/* Vectors of row data, as LNF_GET/LNF_PUT above; LNF_ROUND rounds to the
 * storage type and back (the fused add's z, which the sums must see as
 * stored). */
#if !LNF_STORAGE16
#define LNF_LOADS(p) LNF_LOAD(p)
#define LNF_STORES(p, v) LNF_STORE(p, v)
#define LNF_ROUND(v) (v)
#else
typedef uint16_t lnf_vh __attribute__((vector_size(LNF_VB / 2)));
typedef uint16_t lnf_vh2 __attribute__((vector_size(LNF_VB)));   /* two vectors' */
#define LNF_VH lnf_vh       /* one vector's 16-bit values */
#define LNF_LOADS(p) ({ LNF_VH h_; memcpy(&h_, (p), sizeof h_); LNF_VWIDEN(h_); })
#define LNF_STORES(p, v) do { LNF_VH h_ = LNF_VNARROW(v); memcpy((p), &h_, sizeof h_); } while (0)
#define LNF_ROUND(v) LNF_VWIDEN(LNF_VNARROW(v))
#endif
/* The maps store LNF_MAPW vectors at a time: two where the instance
 * narrows two vectors' values at once (LNF_VNARROW2). */
#ifdef LNF_VNARROW2
#define LNF_MAPW 2
#define LNF_STORESW(p, v)                                                     \
    do {                                                                      \
        lnf_vh2 h2_ = LNF_VNARROW2((v)[0], (v)[1]);                           \
        memcpy((p), &h2_, sizeof h2_);                                        \
    } while (0)
#else
#define LNF_MAPW 1
#define LNF_STORESW(p, v) LNF_STORES(p, (v)[0])
#endif
/* The output stores of the maps: LNF_STORES/LNF_STORESW, or with `nt` set,
 * streaming stores of the same bytes (16-byte pieces), which bypass the
 * caches and need no read for ownership: for long rows, where the output
 * row would push the rows still to be read out of the L2.  float32 and
 * float64 outputs only (LNF_STREAM_ROW_BYTES). */
#if LNF_CAN_STREAM && !LNF_STORAGE16
#define LNF_NTSTORE(p, v)                                                          \
    do {                                                                          \
        LNF_VT v_ = (v);                                                          \
        lnf_vi128 q_[sizeof v_ / 16];                                             \
        memcpy(q_, &v_, sizeof v_);                                               \
        for (size_t k_ = 0; k_ < sizeof v_ / 16; k_++)                            \
            _mm_stream_si128((__m128i *)(void *)(p) + k_, (__m128i)q_[k_]);       \
    } while (0)
#define LNF_OUT(p, v, nt) do { if (nt) LNF_NTSTORE(p, v); else LNF_STORES(p, v); } while (0)
#define LNF_OUTW(p, v, nt) LNF_OUT(p, (v)[0], nt)    /* (LNF_MAPW is 1) */
#else
#define LNF_OUT(p, v, nt) LNF_STORES(p, v)
#define LNF_OUTW(p, v, nt) LNF_STORESW(p, v)
#endif
/* Half k (0 or 1) of an LNF_VDD.  Converting a vector of floats to an
 * LNF_VDD and taking halves compiles to full-width conversions; converting
 * halves of the floats does not (GCC 12). */
#if defined(__clang__) || __GNUC__ >= 12
#if LNF_VB == 64
#define LNF_HALF(v, k) __builtin_shufflevector((v), (v), 8 * (k), 8 * (k) + 1, 8 * (k) + 2, \
                                               8 * (k) + 3, 8 * (k) + 4, 8 * (k) + 5,     \
                                               8 * (k) + 6, 8 * (k) + 7)
#elif LNF_VB == 32
#define LNF_HALF(v, k) __builtin_shufflevector((v), (v), 4 * (k), 4 * (k) + 1, 4 * (k) + 2, \
                                               4 * (k) + 3)
#else
#define LNF_HALF(v, k) __builtin_shufflevector((v), (v), 2 * (k), 2 * (k) + 1)
#endif
#else
#define LNF_HALF(v, k) \
    ({ LNF_VD h_; memcpy(&h_, (const char *)&(v) + (k) * sizeof h_, sizeof h_); h_; })
#endif
/* The float64 lanes acc[0 .. LNF_ND) += s[0 .. LNF_NV), widened. */
#if LNF_DOUBLE
#define LNF_ACC(acc, s)                                                       \
    do {                                                                      \
        for (int u_ = 0; u_ < LNF_NV; u_++)                                   \
            (acc)[u_] += (s)[u_];                                             \
    } while (0)
#else
#define LNF_ACC(acc, s)                                                       \
    do {                                                                      \
        for (int u_ = 0; u_ < LNF_NV; u_++) {                                 \
            LNF_VDD w_ = __builtin_convertvector((s)[u_], LNF_VDD);           \
            (acc)[2 * u_] += LNF_HALF(w_, 0);                                 \
            (acc)[2 * u_ + 1] += LNF_HALF(w_, 1);                             \
        }                                                                     \
    } while (0)
#endif
/* The LNF_LANES values of LNF_T at p += s[0 .. LNF_NV). */
#define LNF_ACC_MEM(p, s)                                                     \
    do {                                                                      \
        for (int u_ = 0; u_ < LNF_NV; u_++)                                   \
            LNF_STORE((p) + u_ * LNF_VE, LNF_LOAD((p) + u_ * LNF_VE) + (s)[u_]); \
    } while (0)
#define LNF_ZERO(acc)                                                         \
    do {                                                                      \
        for (int u_ = 0; u_ < LNF_ND; u_++)                                   \
            (acc)[u_] = (LNF_VD){0};                                          \
    } while (0)
/* Prefetch the lines LNF_PREFETCH_BYTES ahead of the LNF_STEP elements of
 * row p from i, past its end into row pf (NULL: none). */
#define LNF_AHEAD(p, pf, i, n)                                                     \
    do {                                                                           \
        for (ptrdiff_t l_ = 0; l_ < LNF_STEP; l_ += 64 / sizeof(LNF_S)) {          \
            ptrdiff_t t_ = (i) + l_ + (ptrdiff_t)(LNF_PREFETCH_BYTES / sizeof(LNF_S)); \
            if (t_ < (n))                                                          \
                LNF_PREFETCH((p) + t_);                                            \
            else if ((pf) != NULL && t_ - (n) < (n))                               \
                LNF_PREFETCH((pf) + (t_ - (n)));                                   \
        }                                                                          \
    } while (0)
/* Prefetch the output LNF_PREFETCH_BYTES ahead of the LNF_LANES elements of
 * row p from j: a store to a line already in cache needs no read for
 * ownership, which otherwise stalls the sweep (docs/performance.md).
 * Past the row's end this reaches the next row; prefetches
 * never fault. */
#define LNF_PREFETCH_OUT(p, j)                                                     \
    do {                                                                           \
        for (size_t o_ = 0; o_ < LNF_LANES * sizeof(LNF_S); o_ += 64)              \
            LNF_PREFETCH((const char *)((p) + (j)) + LNF_PREFETCH_BYTES + o_);     \
    } while (0)
/* lnf_fold of the lanes acc[0 .. LNF_ND), in registers: the same additions
 * in the same order (lane k + h into lane k, h = 8, 4, 2, 1), whole vectors
 * while h spans them, without the round trip through memory
 * (docs/performance.md). */
_Static_assert(LNF_LANES == 16, "LNF_FOLD spells out lnf_fold for 16 lanes");
#if LNF_VB == 64
#define LNF_FOLD1(v) \
    ((((v)[0] + (v)[4]) + ((v)[2] + (v)[6])) + (((v)[1] + (v)[5]) + ((v)[3] + (v)[7])))
#elif LNF_VB == 32
#define LNF_FOLD1(v) (((v)[0] + (v)[2]) + ((v)[1] + (v)[3]))
#else
#define LNF_FOLD1(v) ((v)[0] + (v)[1])
#endif
/* The steps of h that span whole vectors, into acc[0] (tile_foldv's too). */
#define LNF_FOLD_VECTORS(acc)                                                     \
    do {                                                                          \
        for (int h_ = LNF_ND / 2; h_ > 0; h_ /= 2)                                \
            for (int k_ = 0; k_ < h_; k_++)                                       \
                (acc)[k_] += (acc)[k_ + h_];                                      \
    } while (0)
#define LNF_FOLD(s, acc)                                                          \
    ({                                                                            \
        LNF_FOLD_VECTORS(acc);                                                    \
        LNF_FOLD1((acc)[0]);                                                      \
    })
#else
/* Pairwise fold of the lanes: halves added in place, in a fixed order. */
static inline double lnf_fold(double *s)
{
    for (int h = LNF_LANES / 2; h > 0; h /= 2)
        for (int k = 0; k < h; k++)
            s[k] += s[k + h];
    return s[0];
}
#define LNF_FOLD(s, acc) lnf_fold(s)
#endif

/* --- One element at a time: the plain C loops and every row's tail. --- */

/* y[j] = the forward map of x[j] (b NULL: RMSNorm). */
LNF_ATTR LNF_INLINE void map1(const LNF_S *x, LNF_S *y, const LNF_T *w, const LNF_T *b,
                              LNF_T hi, LNF_T lo, LNF_T rs, ptrdiff_t j)
{
    LNF_PUT(y, j, b != NULL ? ((LNF_GET(x, j) - hi) - lo) * rs * w[j] + b[j]
                            : LNF_GET(x, j) * rs * w[j]);
}

/* Element j of the row to sum: xn[j], or z = xn[j] + rn[j] as stored (rn
 * not NULL: the fused residual add; the sums see z as stored). */
LNF_ATTR LNF_INLINE LNF_T value1(const LNF_S *xn, const LNF_S *rn, ptrdiff_t j)
{
    if (rn == NULL)
        return LNF_GET(xn, j);
    LNF_S z[1];
    LNF_PUT(z, 0, LNF_GET(xn, j) + LNF_GET(rn, j));
    return LNF_GET(z, 0);
}

/* value1, z stored to zn. */
LNF_ATTR LNF_INLINE LNF_T next1(const LNF_S *xn, const LNF_S *rn, LNF_S *zn, ptrdiff_t j)
{
    LNF_T v = value1(xn, rn, j);
    if (rn != NULL)
        LNF_PUT(zn, j, v);
    return v;
}

/* sum / k, by a multiplication where k is LNF_SHIFT_TERMS (a power of two:
 * the same value, without a division per row). */
#define SHIFT_MEAN(sum, k) \
    ((k) == LNF_SHIFT_TERMS ? (sum) * (1.0 / LNF_SHIFT_TERMS) : (sum) / (double)(k))

/* A LayerNorm row's shift: the mean of its first LNF_SHIFT_TERMS values
 * (all of a shorter row's; as next1 reads them), added in float64 in order
 * and rounded to LNF_T; the first value where that mean is not finite.
 * Squares of x - shift are rounded, and the cancellation in
 * S2/D - (S1/D)^2 magnifies that by 1 + (mean - shift)^2 / var: a mean of
 * several values lies nearer the row's mean than one value does (a single
 * value is often 2-4 deviations off), and still near its values, so that
 * differences of close values (a large common offset) stay exact. */
LNF_ATTR LNF_INLINE LNF_T row_shift(const LNF_S *xn, const LNF_S *rn, ptrdiff_t n)
{
    ptrdiff_t k = n < LNF_SHIFT_TERMS ? n : LNF_SHIFT_TERMS;
    double sum = 0.0;
    for (ptrdiff_t j = 0; j < k; j++)
        sum += (double)value1(xn, rn, j);
    double m = SHIFT_MEAN(sum, k);
    return m - m == 0.0 ? (LNF_T)m : value1(xn, rn, 0);
}

/* dx[j] of the backward map (k: its scalars) and its dweight/dbias terms
 * added to dw[j] and db[j] (db NULL: RMSNorm). */
LNF_ATTR LNF_INLINE void grad_map1(const LNF_S *x, const LNF_S *dy, const LNF_S *dz, LNF_S *dx,
                                   const LNF_T *k, LNF_T *dw, LNF_T *db, const LNF_T *w,
                                   ptrdiff_t j)
{
    LNF_T dyj = LNF_GET(dy, j), xh = ((LNF_GET(x, j) - k[0]) - k[1]) * k[2];
    LNF_T dxj = k[2] * ((dyj * w[j] - k[3]) - xh * k[4]), t = dyj * xh;
    LNF_PUT(dx, j, dz != NULL ? dxj + LNF_GET(dz, j) : dxj);
    dw[j] += t;
    if (db != NULL)
        db[j] += dyj;
}

/* The backward sums' terms of element j: d = xn - mean, g = dyn * w, g d. */
LNF_ATTR LNF_INLINE void grad_terms1(const LNF_S *xn, const LNF_S *dyn, const LNF_T *w,
                                     LNF_T mean, ptrdiff_t j, LNF_T t[3])
{
    t[0] = LNF_GET(xn, j) - mean;
    t[1] = LNF_GET(dyn, j) * w[j];
    t[2] = t[1] * t[0];
}

#if LNF_VECTOR
/* --- Vectors: LNF_VE elements, LNF_LANES (LNF_NV vectors), LNF_STEP. --- */

/* One sum's float64 lanes (LNF_ND vectors) and, for float32 arithmetic,
 * the block sums of its open group (LNF_SUPER): the running sums of the
 * step loops. */
typedef struct {
    LNF_VD acc[LNF_ND];
    LNF_VT open[LNF_NV];
} lnf_lanes;

/* float64's upper levels of one sum (LNF_MID > 1): the closed groups of
 * the open mid level, and the closed mid levels.  They stay in memory
 * (levels_close), so that the step loops keep as many vectors in
 * registers as with one level (the backward's three sums spilled
 * otherwise). */
typedef struct {
    LNF_VD mid[LNF_ND], top[LNF_ND];
} lnf_levels;

LNF_ATTR LNF_INLINE void lanes_init(lnf_lanes *l)
{
    LNF_ZERO(l->acc);
    for (int v = 0; v < LNF_NV; v++)
        l->open[v] = (LNF_VT){0};
}

#if LNF_MID > 1
/* A closed group g (float64 lanes) added into the mid level, and the mid
 * level into the top when `close` is 2; the row's first group (`first`)
 * starts both from zero.  (The empty asm says it reads and writes v in
 * memory, so the compiler keeps v there, out of the loops' registers.) */
LNF_ATTR LNF_INLINE void levels_close(lnf_levels *v, const LNF_VD *g, int close, int first)
{
    __asm__("" : "+m"(*v));
    for (int u = 0; u < LNF_ND; u++) {
        if (first)
            v->mid[u] = v->top[u] = (LNF_VD){0};
        v->mid[u] += g[u];
        if (close == 2)
            v->top[u] += v->mid[u], v->mid[u] = (LNF_VD){0};
    }
    __asm__("" : "+m"(*v));
}
#endif

/* A step's block sums p into the lanes: into the open group, which is
 * widened into the lanes when `close` (LNF_SUPER > 1), or widened now.
 * float64's lanes hold its open group themselves, closed into the upper
 * levels v. */
LNF_ATTR LNF_INLINE void lanes_add_step(lnf_lanes *l, lnf_levels *v, const LNF_VT *p, int close,
                                        ptrdiff_t ns)
{
    (void)v, (void)ns;
#if LNF_MID > 1
    LNF_ACC(l->acc, p);
    if (__builtin_expect(close, 0)) {
        levels_close(v, l->acc, close, ns == LNF_SUPER);
        LNF_ZERO(l->acc);
    }
#elif LNF_SUPER > 1
    for (int u = 0; u < LNF_NV; u++)
        l->open[u] += p[u];
    if (close) {
        LNF_ACC(l->acc, l->open);
        for (int u = 0; u < LNF_NV; u++)
            l->open[u] = (LNF_VT){0};
    }
#else
    LNF_ACC(l->acc, p);
#endif
}

/* The open group closed into the lanes after the last step (ns: the full
 * steps).  float64: a row of fewer than LNF_SUPER steps closed no group,
 * and its open group in the lanes is their sum as it stands (0 + (0 +
 * open) exactly); else the last group and mid level close, and the top
 * is the lanes' sum. */
LNF_ATTR LNF_INLINE void lanes_close(lnf_lanes *l, lnf_levels *v, ptrdiff_t ns)
{
    (void)v;
#if LNF_MID > 1
    if (ns >= LNF_SUPER) {
        if (ns % (LNF_SUPER * LNF_MID))     /* (the lanes: 0 where the last step closed) */
            levels_close(v, l->acc, 2, 0);
        memcpy(l->acc, v->top, sizeof l->acc);
    }
#elif LNF_SUPER > 1
    if (ns % LNF_SUPER)
        LNF_ACC(l->acc, l->open);
#endif
}
#endif

/* What closes after step ns (counted from 1): 0 nothing, 1 the open group
 * (LNF_SUPER steps' block sums), 2 the group and the mid level (LNF_MID
 * groups). */
LNF_INLINE int step_closes(ptrdiff_t ns)
{
    return ns % LNF_SUPER ? 0 : ns % (LNF_SUPER * LNF_MID) ? 1 : 2;
}

/* The plain C loops' lanes (lnf_lanes as arrays): the open group widened
 * into mid (LNF_MID > 1) or acc when `close` (step_closes; 2 at a row's
 * last full step), and mid added into acc when it is 2. */
LNF_INLINE void lanes1_close(double *acc, double *mid, LNF_T *open, int close)
{
    if (!close)
        return;
    for (int k = 0; k < LNF_LANES; k++)
        (LNF_MID > 1 ? mid : acc)[k] += open[k], open[k] = 0;
    if (LNF_MID > 1 && close == 2)
        for (int k = 0; k < LNF_LANES; k++)
            acc[k] += mid[k], mid[k] = 0;
}

#if LNF_VECTOR
/* The forward map of the vector of x at j (kv: hi, lo, rs splatted). */
LNF_ATTR LNF_INLINE LNF_VT map_vec(const LNF_S *x, const LNF_T *w, const LNF_T *b,
                                   const LNF_VT *kv, ptrdiff_t j)
{
    LNF_VT xv = LNF_LOADS(x + j), wv = LNF_LOAD(w + j);
    return b != NULL ? ((xv - kv[0]) - kv[1]) * kv[2] * wv + LNF_LOAD(b + j) : xv * kv[2] * wv;
}

/* The map of the LNF_STEP elements of x from i into y; nt (a constant):
 * streaming stores, else stores behind prefetches of y. */
LNF_ATTR LNF_INLINE void map_step(const LNF_S *x, LNF_S *y, const LNF_T *w, const LNF_T *b,
                                  const LNF_VT *kv, ptrdiff_t i, int nt)
{
    for (ptrdiff_t j = i; j < i + LNF_STEP; j += LNF_MAPW * LNF_VE) {
        LNF_VT yv[LNF_MAPW];
        if ((j - i) % LNF_LANES == 0 && !nt)
            LNF_PREFETCH_OUT(y, j);
        for (int v = 0; v < LNF_MAPW; v++)
            yv[v] = map_vec(x, w, b, kv, j + v * LNF_VE);
        LNF_OUTW(y + j, yv, nt);
    }
}

/* The map of the LNF_LANES elements of x from i into y. */
LNF_ATTR LNF_INLINE void map_lanes(const LNF_S *x, LNF_S *y, const LNF_T *w, const LNF_T *b,
                                   const LNF_VT *kv, ptrdiff_t i, int nt)
{
    (void)nt;   /* (16-bit rows: no streaming stores) */
    for (ptrdiff_t j = i; j < i + LNF_LANES; j += LNF_VE)
        LNF_OUT(y + j, map_vec(x, w, b, kv, j), nt);
}

/* The vector at j of the row to sum, less the shift (next1's vector). */
LNF_ATTR LNF_INLINE LNF_VT next_vec(const LNF_S *xn, const LNF_S *rn, LNF_S *zn, LNF_VT sh,
                                    ptrdiff_t j)
{
    LNF_VT v = LNF_LOADS(xn + j);
    if (rn != NULL) {
        v = LNF_ROUND(v + LNF_LOADS(rn + j));
        LNF_STORES(zn + j, v);
    }
    return v - sh;
}

/* The block sums of d and d^2 over a step from i (or, with block 1, over
 * LNF_LANES elements): lane k adds elements k, k + LANES, ... in order. */
LNF_ATTR LNF_INLINE void next_blocks(const LNF_S *xn, const LNF_S *rn, LNF_S *zn, LNF_VT sh,
                                     ptrdiff_t i, int block, LNF_VT *p, LNF_VT *q)
{
    for (int v = 0; v < LNF_NV; v++) {
        LNF_VT d = next_vec(xn, rn, zn, sh, i + v * LNF_VE);
        p[v] = d, q[v] = d * d;
        for (int k = 1; k < block; k++) {
            d = next_vec(xn, rn, zn, sh, i + k * LNF_LANES + v * LNF_VE);
            p[v] += d, q[v] += d * d;
        }
    }
}

/* The backward map of the `wide` LNF_LANES elements from j (kv: its
 * scalars splatted; wide: 1, or LNF_MAPW where dx is 16-bit and narrowed
 * two vectors at once), dx streamed when nt, the dweight/dbias terms added
 * to dw and db (db NULL: RMSNorm). */
LNF_ATTR LNF_INLINE void grad_map_lanes(const LNF_S *x, const LNF_S *dy, const LNF_S *dz,
                                        LNF_S *dx, const LNF_VT *kv, LNF_T *dw, LNF_T *db,
                                        const LNF_T *w, ptrdiff_t j, int nt, const int wide)
{
    (void)nt;   /* (16-bit rows: no streaming stores) */
    LNF_VT t[LNF_MAPW * LNF_NV], dyt[LNF_MAPW * LNF_NV], dxs[LNF_MAPW * LNF_NV];
    for (int v = 0; v < wide * LNF_NV; v++) {
        ptrdiff_t e = j + v * LNF_VE;
        LNF_VT xv = LNF_LOADS(x + e), dyv = LNF_LOADS(dy + e);
        LNF_VT xh = ((xv - kv[0]) - kv[1]) * kv[2];
        LNF_VT dxv = kv[2] * ((dyv * LNF_LOAD(w + e) - kv[3]) - xh * kv[4]);
        if (dz != NULL)
            dxv += LNF_LOADS(dz + e);
        if (wide == 1)
            LNF_OUT(dx + e, dxv, nt);
        dxs[v] = dxv, t[v] = dyv * xh, dyt[v] = dyv;
    }
    if (wide > 1)
        for (int v = 0; v < wide * LNF_NV; v += LNF_MAPW)
            LNF_STORESW(dx + j + v * LNF_VE, dxs + v);
    for (int h = 0; h < wide; h++) {
        LNF_ACC_MEM(dw + j + h * LNF_LANES, t + h * LNF_NV);
        if (db != NULL)
            LNF_ACC_MEM(db + j + h * LNF_LANES, dyt + h * LNF_NV);
    }
}

/* The block sums of the backward terms d, g, g d (grad_terms1) over a step
 * from i (or, with block 1, over LNF_LANES elements) into p[0..2]. */
LNF_ATTR LNF_INLINE void grad_blocks(const LNF_S *xn, const LNF_S *dyn, const LNF_T *w,
                                     LNF_VT m, ptrdiff_t i, int block, LNF_VT p[3][LNF_NV])
{
    for (int v = 0; v < LNF_NV; v++)
        for (int q = 0; q < block; q++) {
            ptrdiff_t e = i + q * LNF_LANES + v * LNF_VE;
            LNF_VT d = LNF_LOADS(xn + e) - m, g = LNF_LOADS(dyn + e) * LNF_LOAD(w + e);
            LNF_VT gd = g * d;
            if (q == 0)
                p[0][v] = d, p[1][v] = g, p[2][v] = gd;
            else
                p[0][v] += d, p[1][v] += g, p[2][v] += gd;
        }
}
#endif

/* The forward sweep over one row's columns, doing up to two things (the
 * named operations below pass NULL for what they leave out):
 *
 * - the map of a row (x != NULL):  y = ((x - hi) - lo) * rs * w + b, or
 *   y = x * rs * w when b is NULL (RMSNorm).  y may be x itself.
 * - the sums of the next row (xn != NULL): v = xn, or v = xn + rn stored to
 *   zn when rn is not NULL (next1), and s[0] = sum(v - shift),
 *   s[1] = sum((v - shift)^2), differences and squares in LNF_T, sums in
 *   float64 lanes fed in blocks; s[2] = shift: 0 when centered is 0
 *   (RMSNorm), row_shift's when 1, `hi` when 2 (a second look at a row, x
 *   NULL and rn NULL).
 *
 * With `stream` set, y is written with streaming stores (LNF_OUT) where it
 * starts on 16 bytes.
 * `levels` (a constant): whether float64's upper levels close (LEVELS).
 * The caller sums a row again about its mean where the shift lay far from
 * it, and redoes in float64 the rare rows whose squares could overflow or
 * underflow LNF_T. */
LNF_ATTR LNF_INLINE void pipe(const LNF_S *x, LNF_S *y, const LNF_T *__restrict w,
                              const LNF_T *__restrict b, LNF_T hi, LNF_T lo, LNF_T rs,
                              const LNF_S *xn, const LNF_S *rn, LNF_S *zn, int centered,
                              double *s, ptrdiff_t n, const LNF_S *xf, const LNF_S *rf,
                              int stream, const int levels)
{
    double t1 = 0.0, t2 = 0.0;
    ptrdiff_t i = 0;
    const int nt = LNF_CAN_STREAM && !LNF_STORAGE16 && stream && x != NULL
                   && (uintptr_t)y % 16 == 0;
    (void)nt;   /* (unused by the plain C loops) */
    LNF_T shift = 0;
    if (xn != NULL && centered)
        shift = centered == 2 ? hi : row_shift(xn, rn, n);
#if LNF_VECTOR
    lnf_lanes l1, l2;
    lnf_levels v1, v2;
    const LNF_VT sh = LNF_SPLAT(shift), kv[3] = {LNF_SPLAT(hi), LNF_SPLAT(lo), LNF_SPLAT(rs)};
    ptrdiff_t ns = 0;    /* full steps */
    lanes_init(&l1);
    lanes_init(&l2);
    for (; i + LNF_STEP <= n; i += LNF_STEP) {
        if (x != NULL) {
            if (__builtin_expect(nt, 0))    /* (two copies: the common one without the test) */
                map_step(x, y, w, b, kv, i, 1);
            else
                map_step(x, y, w, b, kv, i, 0);
        }
        if (xn != NULL) {
            LNF_AHEAD(xn, xf, i, n);
            if (rn != NULL) {
                LNF_AHEAD(rn, rf, i, n);
                for (ptrdiff_t j = i; j < i + LNF_STEP; j += LNF_LANES)
                    LNF_PREFETCH_OUT(zn, j);
            }
            LNF_VT p[LNF_NV], q[LNF_NV];
            next_blocks(xn, rn, zn, sh, i, LNF_BLOCK, p, q);
            int close = levels ? step_closes(++ns) : 0;
            lanes_add_step(&l1, &v1, p, close, ns);
            lanes_add_step(&l2, &v2, q, close, ns);
        }
    }
    if (levels) {
        lanes_close(&l1, &v1, ns);
        lanes_close(&l2, &v2, ns);
    }
    for (; i + LNF_LANES <= n; i += LNF_LANES) {
        if (x != NULL)
            map_lanes(x, y, w, b, kv, i, nt);
        if (xn != NULL) {
            LNF_VT p[LNF_NV], q[LNF_NV];
            next_blocks(xn, rn, zn, sh, i, 1, p, q);
            LNF_ACC(l1.acc, p);
            LNF_ACC(l2.acc, q);
        }
    }
#else
    (void)xf, (void)rf, (void)levels;   /* (no prefetches; every row closes its levels) */
    double s1[LNF_LANES] = {0}, s2[LNF_LANES] = {0};   /* the lanes */
    ptrdiff_t body = n - n % LNF_LANES;
    if (x != NULL)
        for (ptrdiff_t j = 0; j < body; j++)
            map1(x, y, w, b, hi, lo, rs, j);
    if (xn != NULL) {
        LNF_T P[LNF_LANES] = {0}, Q[LNF_LANES] = {0};  /* the open groups */
        double M1[LNF_LANES] = {0}, M2[LNF_LANES] = {0};    /* the mid levels */
        ptrdiff_t ns = 0;
        for (; i + LNF_STEP <= n; i += LNF_STEP) {
            for (int k = 0; k < LNF_LANES; k++) {
                LNF_T d = next1(xn, rn, zn, i + k) - shift, p = d, q = d * d;
                for (int j = 1; j < LNF_BLOCK; j++) {
                    d = next1(xn, rn, zn, i + j * LNF_LANES + k) - shift;
                    p += d, q += d * d;
                }
                P[k] += p, Q[k] += q;
            }
            int close = i + 2 * LNF_STEP > n ? 2 : step_closes(++ns);
            lanes1_close(s1, M1, P, close);
            lanes1_close(s2, M2, Q, close);
        }
        for (; i + LNF_LANES <= n; i += LNF_LANES)
            for (int k = 0; k < LNF_LANES; k++) {
                LNF_T d = next1(xn, rn, zn, i + k) - shift, q = d * d;
                s1[k] += d, s2[k] += q;
            }
    }
    i = body;
#endif
    for (; i < n; i++) {
        if (x != NULL)
            map1(x, y, w, b, hi, lo, rs, i);
        if (xn != NULL) {
            LNF_T d = next1(xn, rn, zn, i) - shift, q = d * d;
            t1 += d, t2 += q;
        }
    }
#if LNF_CAN_STREAM
    if (nt)
        _mm_sfence();   /* streaming stores are weakly ordered */
#endif
    if (xn != NULL) {
        s[0] = LNF_FOLD(s1, l1.acc) + t1;
        s[1] = LNF_FOLD(s2, l2.acc) + t2;
        s[2] = shift;
    }
}

/* The backward sweep over one row's columns, doing up to two things in one
 * sweep, as pipe does for the forward pass:
 *
 * - the map of a row (x != NULL), with its scalars k = {mean, c, rstd, mg,
 *   mgx} (see the driver):
 *     xhat = ((x - mean) - c) * rstd
 *     dx   = rstd * ((dy * w - mg) - xhat * mgx)   (+ dz when dz is not NULL)
 *   and dy * xhat (formed in LNF_T) and dy added to dw and db, rows of
 *   LNF_T (db may be NULL: RMSNorm).  The driver adds float32 dw/db into
 *   float64 rows every few rows (LNF_RUN_ROWS).
 * - the sums of the next row (xn != NULL), every term in LNF_T with
 *   d = xn - mean_n and g = dyn * w: out = {sum(d), sum(g), sum(g * d)} in
 *   float64 lanes fed in blocks.
 * With `stream` & LNF_STREAMED, dx is written with streaming stores, as y
 * above, fenced at the end unless `stream` & LNF_STREAM_NOFENCE (the caller
 * then calls lnf_stream_fence). */
LNF_ATTR LNF_INLINE void grad_pipe(const LNF_S *x, const LNF_S *dy, const LNF_S *dz,
                                   LNF_S *dx, const LNF_T *k, LNF_T *__restrict dw,
                                   LNF_T *__restrict db, const LNF_S *xn, const LNF_S *dyn,
                                   LNF_T mean_n, double *out, const LNF_T *__restrict w,
                                   ptrdiff_t n, const LNF_S *xf, const LNF_S *dyf, int stream,
                                   const int levels)
{
    double tails[3] = {0.0, 0.0, 0.0};
    const int nt = LNF_CAN_STREAM && !LNF_STORAGE16 && (stream & LNF_STREAMED) && x != NULL
                   && (uintptr_t)dx % 16 == 0;
    (void)nt;   /* (unused by the plain C loops) */
    LNF_T kk[5] = {0, 0, 0, 0, 0};
    if (x != NULL)
        for (int u = 0; u < 5; u++)
            kk[u] = k[u];
    ptrdiff_t i = 0;
#if LNF_VECTOR
    lnf_lanes l[3];
    lnf_levels lv[3];
    const LNF_VT m = LNF_SPLAT(mean_n);
    const LNF_VT kv[5] = {LNF_SPLAT(kk[0]), LNF_SPLAT(kk[1]), LNF_SPLAT(kk[2]), LNF_SPLAT(kk[3]),
                          LNF_SPLAT(kk[4])};
    ptrdiff_t ns = 0;    /* full steps */
    for (int u = 0; u < 3; u++)
        lanes_init(&l[u]);
    for (; i + LNF_STEP <= n; i += LNF_STEP) {
        if (x != NULL) {
            if (__builtin_expect(nt, 0)) {
                for (ptrdiff_t j = i; j < i + LNF_STEP; j += LNF_LANES)
                    grad_map_lanes(x, dy, dz, dx, kv, dw, db, w, j, 1, 1);
            } else {
                for (ptrdiff_t j = i; j < i + LNF_STEP; j += LNF_MAPW * LNF_LANES) {
                    for (int h = 0; h < LNF_MAPW; h++)
                        LNF_PREFETCH_OUT(dx, j + h * LNF_LANES);
                    grad_map_lanes(x, dy, dz, dx, kv, dw, db, w, j, 0, LNF_MAPW);
                }
            }
        }
        if (xn != NULL) {
            LNF_AHEAD(xn, xf, i, n);
            LNF_AHEAD(dyn, dyf, i, n);
            LNF_VT p[3][LNF_NV];
            grad_blocks(xn, dyn, w, m, i, LNF_BLOCK, p);
            int close = levels ? step_closes(++ns) : 0;
            for (int u = 0; u < 3; u++)
                lanes_add_step(&l[u], &lv[u], p[u], close, ns);
        }
    }
    if (levels)
        for (int u = 0; u < 3; u++)
            lanes_close(&l[u], &lv[u], ns);
    for (; i + LNF_LANES <= n; i += LNF_LANES) {
        if (x != NULL)
            grad_map_lanes(x, dy, dz, dx, kv, dw, db, w, i, nt, 1);
        if (xn != NULL) {
            LNF_VT p[3][LNF_NV];
            grad_blocks(xn, dyn, w, m, i, 1, p);
            for (int u = 0; u < 3; u++)
                LNF_ACC(l[u].acc, p[u]);
        }
    }
#else
    (void)xf, (void)dyf, (void)levels;  /* (as in pipe) */
    double sl[3][LNF_LANES] = {{0}};    /* the lanes */
    ptrdiff_t body = n - n % LNF_LANES;
    if (x != NULL)
        for (ptrdiff_t j = 0; j < body; j++)
            grad_map1(x, dy, dz, dx, kk, dw, db, w, j);
    if (xn != NULL) {
        LNF_T P[3][LNF_LANES] = {{0}};      /* the open groups */
        double M[3][LNF_LANES] = {{0}};     /* the mid levels */
        ptrdiff_t ns = 0;
        for (; i + LNF_STEP <= n; i += LNF_STEP) {
            for (int c = 0; c < LNF_LANES; c++) {
                LNF_T p[3], t[3];
                for (int j = 0; j < LNF_BLOCK; j++) {
                    grad_terms1(xn, dyn, w, mean_n, i + j * LNF_LANES + c, t);
                    /* the first term starts the block sum, as in the vector code */
                    for (int u = 0; u < 3; u++)
                        p[u] = j ? p[u] + t[u] : t[u];
                }
                for (int u = 0; u < 3; u++)
                    P[u][c] += p[u];
            }
            int close = i + 2 * LNF_STEP > n ? 2 : step_closes(++ns);
            for (int u = 0; u < 3; u++)
                lanes1_close(sl[u], M[u], P[u], close);
        }
        for (; i + LNF_LANES <= n; i += LNF_LANES)
            for (int c = 0; c < LNF_LANES; c++) {
                LNF_T t[3];
                grad_terms1(xn, dyn, w, mean_n, i + c, t);
                for (int u = 0; u < 3; u++)
                    sl[u][c] += t[u];
            }
    }
    i = body;
#endif
    for (; i < n; i++) {
        if (x != NULL)
            grad_map1(x, dy, dz, dx, kk, dw, db, w, i);
        if (xn != NULL) {
            LNF_T t[3];
            grad_terms1(xn, dyn, w, mean_n, i, t);
            for (int u = 0; u < 3; u++)
                tails[u] += t[u];
        }
    }
#if LNF_CAN_STREAM
    if (nt && !(stream & LNF_STREAM_NOFENCE))
        _mm_sfence();
#endif
    if (xn != NULL)
        for (int u = 0; u < 3; u++)
            out[u] = LNF_FOLD(sl[u], l[u].acc) + tails[u];
}

/* The named operations, with the signatures of lnf_row_ops (kernels.h):
 * array arguments in the storage type (x, y, ...) or the compute type (w,
 * b, k, dw, db), scalars as double (exact: they are values of LNF_T). */
#define S_(p) ((const LNF_S *)(p))
#define T_(p) ((const LNF_T *)(p))
/* Whether the sums of a row of n take float64's upper levels (`levels`
 * of pipe and grad_pipe; float32 arithmetic always closes its groups).  A
 * row of fewer than LNF_SUPER + 2 full steps gets the same bits without
 * them, and takes loops that carry none of their code. */
#define LEVELS(n) (LNF_MID == 1 || (n) >= (LNF_SUPER + 2) * LNF_STEP)
LNF_ATTR static void row_sums(const void *x, const void *r, void *z, int centered,
                              double shift, double *s, ptrdiff_t n, const void *xf,
                              const void *rf)
{
    if (LEVELS(n))
        pipe(NULL, NULL, NULL, NULL, (LNF_T)shift, 0, 0, S_(x), S_(r), (LNF_S *)z, centered, s,
             n, S_(xf), S_(rf), 0, 1);
    else
        pipe(NULL, NULL, NULL, NULL, (LNF_T)shift, 0, 0, S_(x), S_(r), (LNF_S *)z, centered, s,
             n, S_(xf), S_(rf), 0, 0);
}

LNF_ATTR static void row_map(const void *x, void *y, const void *w, const void *b,
                             const void *k, ptrdiff_t n, int stream)
{
    pipe(S_(x), (LNF_S *)y, T_(w), T_(b), T_(k)[0], T_(k)[1], T_(k)[2], NULL, NULL, NULL, 0,
         NULL, n, NULL, NULL, stream, 0);
}

LNF_ATTR static void row_map_sums(const void *x, void *y, const void *w, const void *b,
                                  const void *k, const void *xn, const void *rn, void *zn,
                                  int centered, double *s, ptrdiff_t n, const void *xf,
                                  const void *rf, int stream)
{
    if (LEVELS(n))
        pipe(S_(x), (LNF_S *)y, T_(w), T_(b), T_(k)[0], T_(k)[1], T_(k)[2], S_(xn), S_(rn),
             (LNF_S *)zn, centered, s, n, S_(xf), S_(rf), stream, 1);
    else
        pipe(S_(x), (LNF_S *)y, T_(w), T_(b), T_(k)[0], T_(k)[1], T_(k)[2], S_(xn), S_(rn),
             (LNF_S *)zn, centered, s, n, S_(xf), S_(rf), stream, 0);
}

LNF_ATTR static void grad_sums(const void *x, const void *dy, const void *w, double mean,
                               double *s, ptrdiff_t n, const void *xf, const void *dyf)
{
    if (LEVELS(n))
        grad_pipe(NULL, NULL, NULL, NULL, NULL, NULL, NULL, S_(x), S_(dy), (LNF_T)mean, s,
                  T_(w), n, S_(xf), S_(dyf), 0, 1);
    else
        grad_pipe(NULL, NULL, NULL, NULL, NULL, NULL, NULL, S_(x), S_(dy), (LNF_T)mean, s,
                  T_(w), n, S_(xf), S_(dyf), 0, 0);
}

LNF_ATTR static void grad_map(const void *x, const void *dy, const void *dz, void *dx,
                              const void *k, void *dw, void *db, const void *w, ptrdiff_t n,
                              int stream)
{
    grad_pipe(S_(x), S_(dy), S_(dz), (LNF_S *)dx, T_(k), (LNF_T *)dw, (LNF_T *)db, NULL, NULL,
              0, NULL, T_(w), n, NULL, NULL, stream, 0);
}

LNF_ATTR static void grad_map_sums(const void *x, const void *dy, const void *dz, void *dx,
                                   const void *k, void *dw, void *db, const void *w,
                                   const void *xn, const void *dyn, double mean_n, double *s,
                                   ptrdiff_t n, const void *xf, const void *dyf, int stream)
{
    if (LEVELS(n))
        grad_pipe(S_(x), S_(dy), S_(dz), (LNF_S *)dx, T_(k), (LNF_T *)dw, (LNF_T *)db, S_(xn),
                  S_(dyn), (LNF_T)mean_n, s, T_(w), n, S_(xf), S_(dyf), stream, 1);
    else
        grad_pipe(S_(x), S_(dy), S_(dz), (LNF_S *)dx, T_(k), (LNF_T *)dw, (LNF_T *)db, S_(xn),
                  S_(dyn), (LNF_T)mean_n, s, T_(w), n, S_(xf), S_(dyf), stream, 0);
}
#undef S_
#undef T_
#undef LEVELS

#include "tileops.h"

/* The forward's tiles two at once pay where a tile's lanes are one
 * AVX-512 vector of float32 (16-bit rows are widened to it); with
 * narrower vectors, or float64 lanes, the second tile's sums spill
 * (docs/performance_axes.md). */
#define TILE_PAIRS (LNF_VECTOR && LNF_VB == 64 && !LNF_DOUBLE)

const lnf_row_ops LNF_CAT(lnf_ops, LNF_NAME) = {
    row_sums,  row_map,  row_map_sums,   grad_sums,     grad_map, grad_map_sums,
    tile_sums, tile_map, tile_grad_sums, tile_grad_map, tile_fold, TILE_PAIRS,
};
