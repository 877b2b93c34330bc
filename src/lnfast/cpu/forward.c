/* The forward driver: y = norm(x [+ residual]) row by row, on OpenMP
 * threads that each take one contiguous block of rows (rows are
 * independent: the split changes no result).  Contiguous rows are
 * software-pipelined (forward_rows.h); rows far apart whose neighbours are
 * adjacent are taken by tiles (tileops.h); others are gathered into
 * scratch in the compute type, normalized and stored back. */
#include "driver.h"

/* A forward call as the rows see it. */
typedef struct lnf_fwd {
    const lnf_forward_args *a;
    const lnf_kernels *kx;      /* x's storage type (direct rows) */
    const lnf_kernels *kn;      /* the compute type (gathered rows) */
    ptrdiff_t wp, bp;           /* the lengths of weight and bias (bp: wp for RMSNorm) */
    ptrdiff_t run;              /* rows far apart: adjacent rows per run (lnf_tile_run), or 0 */
    int y_like, z_like;         /* tiles: y, z (or none) in x's layout (lnf_tile_like) */
    int direct;                 /* all rows contiguous, in x's dtype */
    int stream;                 /* y written with streaming stores */
    int pairs;                  /* tiles: two at once where they can (forward_tiles) */
    int nthreads;
} lnf_fwd;

enum { FORWARD_SCRATCH = 4 };   /* gathered rows per thread: x, residual, z, y */
/* Tiles: the rare rows of two tiles (one without pairs) and y, the values
 * the sums keep (as many rows), then the copies of a short tile (x,
 * residual, z, y: up to 4 LNF_TILE rows of the compute type) and of the
 * ends of runs held (x, residual: lnf_tails); laid out by tile_bufs_of. */
static ptrdiff_t tile_scratch(int pairs)
{
    return (pairs ? 10 : 8) * LNF_TILE + 1;
}
enum { PARAM_ROWS = 2 };        /* 16-bit weight and bias, widened per thread */

/* t w 2**e, with w's own power of two applied with e, last and once
 * (frexp), so that no partial product leaves float64's range where the
 * result does not (row_exact). */
static inline double scaled_product(double t, double w, int e)
{
    int ew;
    double fw = frexp(w, &ew);
    return ldexp(t * fw, ew + e);
}

#define REAL float
#define REAL_F64 0
#define NATIVE LNF_FLOAT32
#include "forward_rows.h"
#undef REAL
#undef REAL_F64
#undef NATIVE

#define REAL double
#define REAL_F64 1
#define NATIVE LNF_FLOAT64
#include "forward_rows.h"
#undef REAL
#undef REAL_F64
#undef NATIVE

int lnf_streamed(ptrdiff_t D, ptrdiff_t itemsize, ptrdiff_t nbytes)
{
    return itemsize >= 4 && D >= 0 && lnf_mul_sat(D, itemsize) >= LNF_STREAM_ROW_BYTES
           && nbytes >= LNF_STREAM_MIN_BYTES;
}

/* A weight or bias length the map accepts: D, or a constant stand-in of
 * the compute type (16-bit vectors are widened whole). */
static int param_length_ok(const lnf_array *v, ptrdiff_t n, ptrdiff_t D)
{
    return n == D || (n == LNF_CONSTANT_MAX_D && LNF_CONSTANT_MAX_D < D && lnf_native(v));
}

int lnf_forward(const lnf_forward_args *a)
{
    if (a == NULL)
        return LNF_EINVAL;
    int f64 = a->weight.dtype == LNF_FLOAT64;
    lnf_fwd f = {a, NULL, NULL, a->weight_len, a->centered ? a->bias_len : a->weight_len,
                 0, 0, 0, 0, 0, 0, 1};
    if (a->D < 1 || a->D > LNF_MAX_D || a->M < 0)
        return LNF_EINVAL;
    if (a->M == 0)
        return LNF_OK;
    if (!lnf_rows_ok(&a->x, a->M, f64) || !lnf_rows_ok(&a->y, a->M, f64)
        || (a->has_residual
            && (!lnf_rows_ok(&a->residual, a->M, f64) || !lnf_rows_ok(&a->z, a->M, f64)))
        || !lnf_vector_ok(&a->weight, f64) || (a->centered && !lnf_vector_ok(&a->bias, f64))
        || !param_length_ok(&a->weight, f.wp, a->D)
        || (a->centered && !param_length_ok(&a->bias, f.bp, a->D))
        || !lnf_aligned(a->mean, f64 ? 8 : 4) || !lnf_aligned(a->rstd, f64 ? 8 : 4))
        return LNF_EINVAL;
    const lnf_array *rows[4] = {&a->x, a->has_residual ? &a->residual : NULL, &a->y,
                                a->has_residual ? &a->z : NULL};
    f.kx = lnf_kernels_for(a->x.dtype);
    f.kn = lnf_kernels_for(f64 ? LNF_FLOAT64 : LNF_FLOAT32);
    /* Direct and gathered rows give the same bits; tiles or rows follow
     * the inputs (x, residual) alone, so that out= never changes a bit. */
    f.direct = lnf_all_direct(rows, 4);
    f.run = f.direct ? 0 : lnf_tile_run(rows, 2, 4, a->D);
    f.y_like = lnf_tile_like(&a->y, &a->x);
    f.z_like = !a->has_residual || lnf_tile_like(&a->z, &a->x);
    f.stream = f.direct ? lnf_streamed(a->D, lnf_itemsize(a->y.dtype),
                                       lnf_rows_bytes(a->M, a->D, lnf_itemsize(a->y.dtype)))
                        : f.run && f.y_like && lnf_tile_streamed(&a->y, f.run, a->M, a->D);
    f.pairs = f.run && a->D <= LNF_TILE_PAIR_MAX_D && f.kx->ops->tile_pairs;
    f.nthreads = (int)LNF_MAX(1, LNF_MIN(LNF_MIN(a->nthreads, LNF_MAX_THREADS), a->M));
    int wide = !lnf_native(&a->weight) || (a->centered && !lnf_native(&a->bias));
    lnf_scratches s;
    if (lnf_scratch_begin(&s, f.nthreads,
                          f.direct ? 0 : f.run ? tile_scratch(f.pairs) : FORWARD_SCRATCH,
                          wide ? PARAM_ROWS : 0,
                          a->D, f64 ? 8 : 4) != LNF_OK)
        return LNF_ENOMEM;
    lnf_fpenv env = lnf_fpenv_enter();
    if (f64)
        forward_rows_f64(&f, a->mean, a->rstd, s.sc);
    else
        forward_rows_f32(&f, a->mean, a->rstd, s.sc);
    lnf_fpenv_leave(env);
    return lnf_scratch_end(&s);
}
