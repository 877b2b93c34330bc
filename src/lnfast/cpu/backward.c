/* The backward driver: dx row by row and the dweight/dbias reduction.
 *
 * Reduction plan (lnf_reduction): rows are cut into nchunks fixed chunks
 * (lnf_num_chunks: the shape alone decides); each chunk sums its rows'
 * dweight/dbias terms into float64 partial rows in row order, and the
 * partial rows are then added in chunk order and rounded once to the
 * output's dtype: bitwise reproducible for any thread count.  float32
 * terms are summed in float32 runs of LNF_RUN_ROWS rows first (each run
 * added into the chunk's partial rows); a call of one run (one chunk of
 * LNF_RUN_ROWS rows or fewer) rounds it straight to the output.  Threads
 * take chunks of their own, or, for long rows (LNF_BLOCKED_ROW_BYTES),
 * every thread takes every chunk, each its share of the columns
 * (backward_blocks; rows gathered for a strided dx are summed by the same
 * blocks, row_grad_sums).  Rows far apart whose neighbours are adjacent are
 * taken by tiles, which add their terms into the partial rows directly
 * (tileops.h; backward_tiles). */
#include <limits.h>
#include <stdlib.h>

#include "driver.h"

/* Backward rows summed by column blocks (lnf_set_blocked, for tests). */
static ptrdiff_t blocked_row_bytes = LNF_BLOCKED_ROW_BYTES;
static ptrdiff_t col_block = LNF_COL_BLOCK;

/* A backward call as the rows see it. */
typedef struct lnf_bwd {
    const lnf_backward_args *a;
    const lnf_kernels *kx;      /* x's storage type (direct rows) */
    const lnf_kernels *kn;      /* the compute type (gathered rows) */
    ptrdiff_t col_block;        /* blocked: columns per block */
    ptrdiff_t run;              /* rows far apart: adjacent rows per run (lnf_tile_run), or 0 */
    int dx_like;                /* tiles: dx in x's layout (lnf_tile_like) */
    int direct;                 /* all rows contiguous, in x's dtype */
    int stream;                 /* dx written with streaming stores */
    int blocked;                /* rows summed by column blocks (row_grad_sums) */
    int shared;                 /* blocked direct rows, each row's blocks shared by the
                                 * threads (backward_blocks) */
    int one_run;                /* one chunk of one float32 run */
    int nthreads;
} lnf_bwd;

/* The reduction plan: where each chunk's partial rows, each thread's
 * float32 runs and the column blocks' sums live. */
typedef struct lnf_reduction {
    ptrdiff_t nchunks;
    ptrdiff_t stride;           /* doubles from one chunk's partial rows to the next */
    double *part;               /* the chunks' partial rows (the output itself when in
                                 * place; NULL for one run, which has none) */
    void *runs;                 /* float32 runs, a partial stride per thread */
    double *sums;               /* blocked: 6 nb doubles of block sums per thread */
    void *buffer;               /* what was allocated for them */
} lnf_reduction;

enum { BACKWARD_SCRATCH = 4 };  /* gathered rows per thread: x, dy, dx, dz */
/* Tiles: after them, a copied short tile (x, dy, dz, dx: 4 LNF_TILE rows),
 * the values the sums keep (x, dy: 2), the lanes' dweight/dbias runs (2)
 * and the sums' carries (x, dy: 2). */
#define TILE_ROWS (10 * LNF_TILE)
enum { PARAM_ROWS = 2 };        /* the 16-bit weight, widened per thread */

/* Doubles from one chunk's partial rows (dweight, then dbias) to the
 * next: whole 64-byte lines, so that every chunk starts on a line. */
static inline ptrdiff_t partial_stride(ptrdiff_t D)
{
    return (2 * D + 7) & ~(ptrdiff_t)7;
}

/* dw[j] += g[j], then g[j] = 0, for j < n: a float32 run of dweight/dbias
 * terms added into float64 partial rows.  A chunk's first run (first != 0)
 * adds to 0.0 instead of reading dw, so its rows need no zeroing.  Element
 * by element: the same bits on every path. */
LNF_CLONES static void add_run(double *__restrict dw, float *__restrict g, ptrdiff_t n, int first)
{
    for (ptrdiff_t j = 0; j < n; j++) {
        dw[j] = (first ? 0.0 : dw[j]) + g[j];
        g[j] = 0.0f;
    }
}

/* Add the float64 terms of a chunk's rare rows (sc->grads, columns c0..c1-1
 * of dweight and dbias) into its partial rows dw, after its last run, and
 * zero them. */
static inline void fold_grads(lnf_scratch *sc, double *dw, ptrdiff_t D, ptrdiff_t c0,
                              ptrdiff_t c1, int centered)
{
    if (sc->grads == NULL)
        return;
    for (ptrdiff_t j = c0; j < c1; j++) {
        dw[j] += sc->grads[j];
        sc->grads[j] = 0.0;
        if (centered) {
            dw[D + j] += sc->grads[D + j];
            sc->grads[D + j] = 0.0;
        }
    }
}

/* out[j] = sums[j] rounded once to `dtype`, for j0 <= j < j1 (16-bit:
 * through float32 rounded to odd). */
static void round_sums(const double *sums, ptrdiff_t j0, ptrdiff_t j1, void *out, int dtype)
{
    if (dtype == LNF_FLOAT64) {
        memcpy((double *)out + j0, sums + j0, (size_t)(j1 - j0) * sizeof(double));
    } else if (dtype == LNF_FLOAT32) {
        for (ptrdiff_t j = j0; j < j1; j++)
            ((float *)out)[j] = (float)sums[j];
    } else {
        float odd[LNF_SUM_BLOCK];
        for (ptrdiff_t j = j0, n; j < j1; j += n) {
            n = LNF_MIN((ptrdiff_t)LNF_SUM_BLOCK, j1 - j);
            lnf_f64_to_f32_odd_row(sums + j, odd, n);
            lnf_kernels_for(dtype)->narrow(odd, (char *)((uint16_t *)out + j), 2, n);
        }
    }
}

int lnf_round_sums(const double *sums, void *out, ptrdiff_t n, int dtype)
{
    if (n < 0 || (n > 0 && (sums == NULL || out == NULL)) || dtype < 0 || dtype >= LNF_NDTYPES
        || !lnf_aligned(sums, 8) || !lnf_aligned(out, lnf_itemsize(dtype)))
        return LNF_EINVAL;
    lnf_fpenv env = lnf_fpenv_enter();
    round_sums(sums, 0, n, out, dtype);
    lnf_fpenv_leave(env);
    return LNF_OK;
}

/* out[j] = the sum of part[c stride + j] over chunks c = 0, 1, ... in that
 * order (formed in part[j]), for j0 <= j < j1, rounded once to `dtype`:
 * chunk-outer, so the inner loops are contiguous. */
static void sum_partials(double *part, ptrdiff_t nchunks, ptrdiff_t stride, ptrdiff_t j0,
                         ptrdiff_t j1, void *out, int dtype)
{
    for (ptrdiff_t c = 1; c < nchunks; c++)
        for (ptrdiff_t j = j0; j < j1; j++)
            part[j] += part[c * stride + j];
    round_sums(part, j0, j1, out, dtype);
}

/* out = the float32 sums g of a call's only run, rounded once to `dtype`:
 * the same bits as through the float64 partial rows, which hold g exactly. */
static void round_run(const float *g, ptrdiff_t width, void *out, int dtype)
{
    if (dtype == LNF_FLOAT64)
        for (ptrdiff_t j = 0; j < width; j++)
            ((double *)out)[j] = g[j];
    else if (dtype == LNF_FLOAT32)
        memcpy(out, g, (size_t)width * sizeof(float));
    else
        lnf_kernels_for(dtype)->narrow(g, (char *)out, 2, width);
}

/* The first row of chunk c: c M / nchunks, for tiles at its tile's start. */
static inline ptrdiff_t chunk_row(const lnf_bwd *b, ptrdiff_t c, ptrdiff_t nchunks)
{
    return lnf_tile_start(lnf_part_start(c, nchunks, b->a->M), b->run);
}

/* Chunk c's partial rows (NULL where there are none). */
static inline double *chunk_part(const lnf_reduction *p, ptrdiff_t c)
{
    return p->part != NULL ? p->part + p->stride * c : NULL;
}

/* Eight bytes of elements of isz bytes, each less its sign bit (in either
 * byte order: each element's sign is the top bit of its half or quarter). */
static inline uint64_t lnf_unsigned_mask(ptrdiff_t isz)
{
    return isz == 8 ? 0x7fffffffffffffffu : isz == 4 ? 0x7fffffff7fffffffu : 0x7fff7fff7fff7fffu;
}

/* Whether the first n (a multiple of 8) bytes at p, elements of the mask's
 * kind (lnf_unsigned_mask), are all zeros of either sign (built for each
 * instruction set: a padding row's dy is read once more by it). */
LNF_CLONES static int lnf_words_zero(const void *p, ptrdiff_t n, uint64_t mask)
{
    uint64_t acc = 0, v;
    for (ptrdiff_t i = 0; i < n; i += 8) {
        memcpy(&v, (const char *)p + i, sizeof v);
        acc |= v & mask;
    }
    return acc == 0;
}

/* Whether row r of m's D elements is all zeros (of either sign): where
 * its elements are adjacent, 8 bytes at a time. */
static inline int lnf_row_zero(const lnf_array *m, ptrdiff_t r, ptrdiff_t D)
{
    const char *p = lnf_row(m, r);
    ptrdiff_t isz = lnf_itemsize(m->dtype), n = m->inner == isz ? D * isz - D * isz % 8 : 0;
    uint64_t mask = lnf_unsigned_mask(isz), v;
    if (!lnf_words_zero(p, n, mask))
        return 0;
    for (ptrdiff_t i = n / isz; i < D; i++) {
        v = 0;
        memcpy(&v, p + i * m->inner, (size_t)isz);
        if (v & mask)                   /* (the first element's bytes) */
            return 0;
    }
    return 1;
}

/* row_grad_ok's answer for a row whose g sums to exactly zero. */
enum { LNF_GRAD_ZERO = 2 };

#define REAL float
#define REAL_F64 0
#include "backward_rows.h"
#undef REAL
#undef REAL_F64

#define REAL double
#define REAL_F64 1
#include "backward_rows.h"
#undef REAL
#undef REAL_F64

ptrdiff_t lnf_num_chunks(ptrdiff_t M, ptrdiff_t D)
{
    ptrdiff_t by_rows = lnf_div_up(LNF_MAX(M, 0), LNF_MIN_ROWS_PER_CHUNK);
    if (by_rows == 1 && M >= LNF_SPLIT_MIN_ROWS && D >= LNF_SPLIT_MIN_ELEMENTS / M)
        by_rows = 2;
    /* (in a division, not a product: a D near PTRDIFF_MAX must not overflow) */
    ptrdiff_t by_bytes = LNF_MAX(1, LNF_PARTIALS_BYTES / 16 / LNF_MAX(D, 1));
    return LNF_MAX(1, LNF_MIN(LNF_MAX_CHUNKS, LNF_MIN(by_rows, by_bytes)));
}

int lnf_set_blocked(ptrdiff_t row_bytes, ptrdiff_t block, ptrdiff_t old[2])
{
    if (row_bytes < 0 || block < 1)
        return LNF_EINVAL;
    if (old != NULL)
        old[0] = blocked_row_bytes, old[1] = col_block;
    blocked_row_bytes = row_bytes;
    col_block = block;
    return LNF_OK;
}

/* Lay out the reduction of a call (b: its settings so far).  The partial
 * rows start on a 64-byte line: the sweep loads and stores them 64 bytes
 * at a time.  One float64 chunk is summed in the output itself when that
 * is aligned, or when its few rows would not win back a buffer of their
 * own. */
static int plan_reduction(lnf_reduction *p, const lnf_bwd *b, ptrdiff_t nchunks, int f32)
{
    const lnf_backward_args *a = b->a;
    ptrdiff_t stride = partial_stride(a->D), nsums = 0;
    int in_place = nchunks == 1 && a->dwdb_dtype == LNF_FLOAT64
                   && ((uintptr_t)a->dwdb % 64 == 0 || a->M < LNF_IN_PLACE_MAX_ROWS);
    /* (counts past what memory holds saturate, and are refused below) */
    if (b->shared)
        nsums = lnf_mul_sat(6 * lnf_div_up(a->D, b->col_block), b->nthreads);
    ptrdiff_t nruns = f32 ? lnf_mul_sat(stride, b->nthreads) : 0;
    ptrdiff_t npart = in_place || b->one_run ? 0 : lnf_mul_sat(stride, nchunks);
    p->nchunks = nchunks;
    p->stride = stride;
    ptrdiff_t most = PTRDIFF_MAX / (ptrdiff_t)sizeof(double) / 4;    /* (the three's bytes fit) */
    if (npart > most || nruns > most || nsums > most)
        return LNF_ENOMEM;
    /* (one value at least: no pointer below is arithmetic on NULL) */
    ptrdiff_t n = LNF_MAX(npart + nruns + nsums, 1);
    if ((p->buffer = lnf_malloc_aligned((size_t)n * sizeof(double))) == NULL)
        return LNF_ENOMEM;
    double *base = p->buffer;
    p->part = b->one_run ? NULL : in_place ? (double *)a->dwdb : base;
    p->runs = base + npart;
    p->sums = base + npart + nruns;
    return LNF_OK;
}

int lnf_backward(const lnf_backward_args *a)
{
    if (a == NULL)
        return LNF_EINVAL;
    int f32 = a->weight.dtype != LNF_FLOAT64;
    if (a->D < 1 || a->D > LNF_MAX_D || a->M < 0 || a->nchunks < 0
        || a->nchunks > LNF_MAX(a->M, LNF_MAX_CHUNKS) || a->nchunks > INT32_MAX
        || a->dwdb == NULL || a->dwdb_dtype < 0 || a->dwdb_dtype >= LNF_NDTYPES
        || !lnf_aligned(a->dwdb, lnf_itemsize(a->dwdb_dtype)))
        return LNF_EINVAL;
    ptrdiff_t half = a->D * lnf_itemsize(a->dwdb_dtype);
    if (a->M == 0) {
        memset(a->dwdb, 0, 2 * (size_t)half);
        return LNF_OK;
    }
    if (!lnf_rows_ok(&a->x, a->M, !f32) || !lnf_rows_ok(&a->dy, a->M, !f32)
        || !lnf_rows_ok(&a->dx, a->M, !f32)
        || (a->has_dz && !lnf_rows_ok(&a->dz, a->M, !f32)) || !lnf_vector_ok(&a->weight, !f32)
        || a->rstd == NULL || !lnf_aligned(a->rstd, f32 ? 4 : 8)
        || (a->centered && (a->mean == NULL || !lnf_aligned(a->mean, f32 ? 4 : 8))))
        return LNF_EINVAL;
    /* dx may be dz, not x or dy: the tiles' rows redone in float64 read x
     * and dy again after the tile's dx is stored. */
    if (a->dx.base == a->x.base || a->dx.base == a->dy.base)
        return LNF_EINVAL;
    ptrdiff_t nchunks = a->nchunks ? a->nchunks : lnf_num_chunks(a->M, a->D);
    const lnf_array *rows[4] = {&a->x, &a->dy, a->has_dz ? &a->dz : NULL, &a->dx};
    lnf_bwd b = {a, lnf_kernels_for(a->x.dtype), lnf_kernels_for(f32 ? LNF_FLOAT32 : LNF_FLOAT64),
                 col_block, 0, 0, 0, 0, 0, 0, 0, 1};
    b.nthreads = (int)LNF_MAX(1, LNF_MIN(LNF_MIN(a->nthreads, LNF_MAX_THREADS), nchunks));
    /* Direct and gathered rows give the same bits; tiles or rows, and
     * blocked sums, follow the inputs (x, dy, dz) alone, so that dx's
     * layout never changes a bit. */
    b.direct = lnf_all_direct(rows, 4);
    b.run = b.direct ? 0 : lnf_tile_run(rows, 3, 4, a->D);
    b.dx_like = lnf_tile_like(&a->dx, &a->x);
    b.stream = b.direct ? lnf_streamed(a->D, lnf_itemsize(a->dx.dtype),
                                       lnf_rows_bytes(a->M, a->D, lnf_itemsize(a->dx.dtype)))
                        : b.run && b.dx_like && lnf_tile_streamed(&a->dx, b.run, a->M, a->D);
    b.blocked = lnf_all_direct(rows, 3)
                && a->D * (4 * lnf_itemsize(a->x.dtype) + 3 * (f32 ? 4 : 8)) >= blocked_row_bytes;
    b.shared = b.blocked && b.direct;
    b.one_run = f32 && !b.run && nchunks == 1 && a->M <= LNF_RUN_ROWS;
    lnf_reduction p;
    lnf_scratches s;
    if (lnf_scratch_begin(&s, b.nthreads,
                          b.direct ? 0
                          : b.run  ? BACKWARD_SCRATCH + TILE_ROWS
                                   : BACKWARD_SCRATCH,
                          lnf_native(&a->weight) ? 0 : PARAM_ROWS, a->D, f32 ? 4 : 8) != LNF_OK)
        return LNF_ENOMEM;
    if (plan_reduction(&p, &b, nchunks, f32) != LNF_OK) {
        lnf_scratch_end(&s);
        return LNF_ENOMEM;
    }
    if (!a->centered)   /* (RMSNorm sums no dbias) */
        memset((char *)a->dwdb + half, 0, (size_t)half);
    lnf_fpenv env = lnf_fpenv_enter();
    if (f32)
        backward_rows_f32(&b, &p, s.sc);
    else
        backward_rows_f64(&b, &p, s.sc);
    lnf_fpenv_leave(env);
    lnf_free_aligned(p.buffer);
    return lnf_scratch_end(&s);
}
