/* What the forward and backward drivers share: the dtypes' sizes and the
 * template settings of forward_rows.h and backward_rows.h, which forward.c
 * and backward.c include once for float32 arithmetic (REAL float) and once
 * for float64 (REAL double). */
#ifndef LNFAST_CPU_DRIVER_H
#define LNFAST_CPU_DRIVER_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "array.h"
#include "fpenv.h"
#include "kernels.h"
#include "scratch.h"
#include "threads.h"

#define LNF_MIN(a, b) ((a) < (b) ? (a) : (b))
#define LNF_MAX(a, b) ((a) > (b) ? (a) : (b))

/* The first of M items in part i of n (0 <= i <= n, 0 < n < 2**31):
 * floor(i M / n), without the product i M, which could overflow. */
static inline ptrdiff_t lnf_part_start(ptrdiff_t i, ptrdiff_t n, ptrdiff_t M)
{
    return i * (M / n) + (ptrdiff_t)((int64_t)i * (M % n) / n);
}

/* Whether p is aligned to `size` bytes. */
static inline int lnf_aligned(const void *p, ptrdiff_t size)
{
    return (uintptr_t)p % (uintptr_t)size == 0;
}

/* Whether a C caller's array of rows fits the call: a known dtype, data,
 * aligned elements, `M` rows, and a dtype the compute type can read
 * (float64 arithmetic: float64 only; float32: float32 or 16-bit). */
static inline int lnf_rows_ok(const lnf_array *a, ptrdiff_t M, int f64)
{
    if (a->dtype < 0 || a->dtype >= LNF_NDTYPES || a->base == NULL || a->nd < 0
        || a->nd > LNF_MAX_LEAD || (f64 ? a->dtype != LNF_FLOAT64 : a->dtype == LNF_FLOAT64)
        || !lnf_axes_fit(a->nd, a->shape, a->stride))      /* (the product below fits) */
        return 0;
    ptrdiff_t n = 1, size = lnf_itemsize(a->dtype);
    for (int k = 0; k < a->nd; k++) {
        if (a->stride[k] % size != 0)       /* (every row aligned, as the first) */
            return 0;
        n *= a->shape[k];
    }
    return n == M && lnf_aligned(a->base, size) && a->inner % size == 0;
}

/* Whether a weight or bias vector fits: one row; contiguous in the compute
 * type, or 16-bit (any stride) for float32 arithmetic. */
static inline int lnf_vector_ok(const lnf_array *v, int f64)
{
    if (!lnf_rows_ok(v, 1, f64))
        return 0;
    return lnf_native(v) ? v->inner == lnf_itemsize(v->dtype) : !f64;
}

/* Whether a is described and all of arrays[0..n) (NULL: absent) are rows of
 * a's dtype with adjacent elements: the direct (pipelined) path. */
static inline int lnf_all_direct(const lnf_array *const *arrays, int n)
{
    const lnf_array *x = arrays[0];
    for (int i = 0; i < n; i++)
        if (arrays[i] != NULL
            && (arrays[i]->dtype != x->dtype || arrays[i]->inner != lnf_itemsize(x->dtype)))
            return 0;
    return 1;
}

/* Whether m has x's tile layout: x's dtype and element stride, and the
 * same last leading axis of adjacent rows. */
static inline int lnf_tile_like(const lnf_array *m, const lnf_array *x)
{
    return m->dtype == x->dtype && m->inner == x->inner && m->nd >= 1 && x->nd >= 1
           && m->stride[m->nd - 1] == lnf_itemsize(x->dtype)
           && m->shape[m->nd - 1] == x->shape[x->nd - 1];
}

/* Rows far apart whose neighbours are adjacent, taken by tiles
 * (tileops.h): when x = arrays[0] is strided and it and the other inputs
 * arrays[1..nin) (NULL: absent) have x's tile layout (lnf_tile_like), the
 * P > 1 adjacent rows of its last leading axis; else 0.  The outputs
 * arrays[nin..n) need only x's dtype (tiles store in it; C callers may mix
 * dtypes): outputs of any layout are written from copies
 * (lnf_tile_scatter_to), so that their layout never changes the bits.
 * Rows of more than LNF_TILE_MAX_D elements are gathered instead. */
static inline ptrdiff_t lnf_tile_run(const lnf_array *const *arrays, int nin, int n, ptrdiff_t D)
{
    const lnf_array *x = arrays[0];
    if (x->nd < 1 || x->inner == lnf_itemsize(x->dtype) || D > LNF_TILE_MAX_D)
        return 0;
    for (int i = 0; i < n; i++) {
        const lnf_array *m = arrays[i];
        if (m != NULL && (i < nin ? !lnf_tile_like(m, x) : m->dtype != x->dtype))
            return 0;
    }
    ptrdiff_t P = x->shape[x->nd - 1];
    return P > 1 ? P : 0;
}

/* Row r moved back to the first row of its tile: tiles start at each run's
 * first row and every LNF_TILE rows after (run 0: rows one by one).  The
 * drivers begin each thread's and chunk's rows there, so that none cuts a
 * tile short and a full tile starts where lnf_tile_streamed looked. */
static inline ptrdiff_t lnf_tile_start(ptrdiff_t r, ptrdiff_t run)
{
    return run ? r - r % run % LNF_TILE : r;
}

/* Whether the tile at row r of a thread's rows r..r1-1 and the next are
 * full tiles of the same run. */
static inline int lnf_tile_next_full(ptrdiff_t r, ptrdiff_t r1, ptrdiff_t run)
{
    return r + 2 * LNF_TILE <= r1 && r % run + 2 * LNF_TILE <= run;
}

/* The next group of LNF_TILE_GROUP tiles of a run, fetched into the L2 a
 * column's stretch at a time: the tile at row offset `o` of its run (of
 * `run` adjacent rows) fetches, for its share of the columns (the j-th
 * of LNF_TILE_GROUP, j its place in its group), the next group's rows of
 * each column of the tile at p (columns `inner` bytes apart, rows isz
 * bytes).  A tile's own column is one line, and its columns lie far
 * apart: fetched only a line at a time (tileops.h), memory sees a line
 * from each of D pages in turn, which a CPU's streams do not follow; a
 * column's stretch of 16 tiles is fetched in order (docs/performance_axes.md).
 * Outputs that are not streamed are fetched alike, for their stores. */
static inline void lnf_tile_prefetch_runs(const char *p, ptrdiff_t inner, ptrdiff_t isz,
                                          ptrdiff_t D, ptrdiff_t o, ptrdiff_t run)
{
    enum { G = LNF_TILE_GROUP };
    ptrdiff_t j = o / LNF_TILE % G, g0 = o - j * LNF_TILE + G * LNF_TILE;
    ptrdiff_t end = LNF_MIN(run, g0 + G * LNF_TILE);
    if (g0 >= end)
        return;
    for (ptrdiff_t i = j * D / G; i < (j + 1) * D / G; i++) {
        const char *c = p + i * inner + (g0 - o) * isz;
        for (ptrdiff_t q = 0; q < (end - g0) * isz; q += 64)
            LNF_PREFETCH_L2(c + q);
    }
}

/* The short tiles at the ends of several runs taken as one copied tile
 * (the forward's tiles): where each run of adjacent rows ends
 * t = run % LNF_TILE rows into a tile, up to LNF_TILE / t such ends
 * (`count` held) share one, lane k t + j holding row first[k] + j, so that
 * a run of 49 rows (a 7x7 image) costs three full tiles and a sixteenth,
 * not four.  Each lane's arithmetic is that of its row alone, so the rows'
 * bits are those of a tile of their own.  (The backward's would be too,
 * but not its dweight/dbias sums, whose order follows the tiles; and its
 * chunks, about an image at 7x7, would hold few ends.) */
typedef struct {
    ptrdiff_t first[LNF_TILE], t;
    int count, most;
} lnf_tails;

static inline void lnf_tails_init(lnf_tails *g, ptrdiff_t run)
{
    g->t = run % LNF_TILE;
    g->count = 0;
    g->most = g->t > 0 ? (int)(LNF_TILE / g->t) : 0;
}

/* Whether the n rows from r, a run's last tile, are an end to hold (ends
 * that fill more than half a tile go alone). */
static inline int lnf_tails_take(const lnf_tails *g, ptrdiff_t r, ptrdiff_t n, ptrdiff_t run)
{
    return g->most >= 2 && n == g->t && r % run + n == run;
}

/* The row of lane j: row r + j of a tile of its own (g NULL), else of the
 * ends held. */
static inline ptrdiff_t lnf_lane_row(const lnf_tails *g, ptrdiff_t r, ptrdiff_t j)
{
    return g == NULL ? r + j : g->first[j / g->t] + j % g->t;
}

/* Where the j-th of the rows of tiles taken together has its values in
 * arrays of 3 LNF_TILE values per tile (tile_sums' sums, tile_map's
 * factors): lane j % LNF_TILE of tile j / LNF_TILE. */
static inline ptrdiff_t lnf_tile_lane(ptrdiff_t j)
{
    return 3 * LNF_TILE * (j / LNF_TILE) + j % LNF_TILE;
}

/* How the sums read the tile at row r of a thread's rows r..r1-1, after
 * a tile read as `last` (tileops.h, tv_load_carry): with a carry where
 * `alike` (its columns all sit alike on their lines, read from the
 * arrays) and the next tile is a full one of the same run and thread, so
 * that the line after each column is read only where it holds a row of
 * the thread's own. */
static inline lnf_tile_carry lnf_tile_carry_mode(lnf_tile_carry last, int alike, ptrdiff_t r,
                                                 ptrdiff_t r1, ptrdiff_t run)
{
    if (!alike || !lnf_tile_next_full(r, r1, run))
        return LNF_TILE_PLAIN;
    return last == LNF_TILE_PLAIN ? LNF_TILE_START : LNF_TILE_CARRIED;
}

/* Tiles of `out` (rows far apart) written with streaming stores: float32
 * and float64 outputs of LNF_STREAM_MIN_BYTES or more, whose columns start
 * on cache lines wherever a full tile starts (lnf_tile_start; lnf_array's
 * last leading axis is the run), so that each column's stores, a vector
 * at a time, fill whole lines. */
static inline int lnf_tile_streamed(const lnf_array *out, ptrdiff_t run, ptrdiff_t M, ptrdiff_t D)
{
    ptrdiff_t isz = lnf_itemsize(out->dtype), line = 64;
    int ok = isz >= 4 && lnf_rows_bytes(M, D, isz) >= LNF_STREAM_MIN_BYTES
             && (uintptr_t)out->base % line == 0
             && out->inner % line == 0 && run * isz % line == 0;
    for (int k = 0; k + 1 < out->nd; k++)
        ok = ok && out->stride[k] % line == 0;
    return ok;
}

/* Tiles shorter than LNF_TILE rows (at the end of a run of adjacent rows),
 * with rows to leave out, or with an output not in x's layout, run on
 * copies: the columns of n rows of isz bytes, `inner` bytes apart, copied
 * into a full tile of LNF_TILE isz bytes per column (the other lanes
 * zero), and back. */
static inline void lnf_tile_gather(const char *src, ptrdiff_t inner, char *dst, ptrdiff_t n,
                                   ptrdiff_t isz, ptrdiff_t D)
{
    size_t full = LNF_TILE * (size_t)isz, part = (size_t)(n * isz);
    for (ptrdiff_t i = 0; i < D; i++) {
        memcpy(dst + i * full, src + i * inner, part);
        memset(dst + i * full + part, 0, full - part);
    }
}

/* The k-th end held (lnf_tails) gathered into its lanes k t.. of a copied
 * tile; the first zeroes the tile's other lanes. */
static inline void lnf_tails_gather(const char *src, ptrdiff_t inner, char *dst, int k,
                                    ptrdiff_t t, ptrdiff_t isz, ptrdiff_t D)
{
    if (k == 0) {
        lnf_tile_gather(src, inner, dst, t, isz, D);
        return;
    }
    size_t full = LNF_TILE * (size_t)isz, part = (size_t)(t * isz);
    for (ptrdiff_t i = 0; i < D; i++)
        memcpy(dst + i * full + k * part, src + i * inner, part);
}

static inline void lnf_tile_scatter(const char *src, char *dst, ptrdiff_t inner, ptrdiff_t n,
                                    ptrdiff_t isz, ptrdiff_t D)
{
    for (ptrdiff_t i = 0; i < D; i++)
        memcpy(dst + i * inner, src + i * LNF_TILE * isz, (size_t)(n * isz));
}

/* A copied tile's n lanes stored to rows r..r+n-1 of out: column by column
 * where out has x's tile layout (`like`), else lane j's D values to out's
 * own row r + j, out->inner bytes apart, since its rows need not be
 * adjacent. */
static inline void lnf_tile_scatter_to(const char *src, const lnf_array *out, int like,
                                       ptrdiff_t r, ptrdiff_t n, ptrdiff_t isz, ptrdiff_t D)
{
    if (like) {
        lnf_tile_scatter(src, lnf_row(out, r), out->inner, n, isz, D);
        return;
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        char *p = lnf_row(out, r + j);
        const char *s = src + j * isz;
        for (ptrdiff_t i = 0; i < D; i++, p += out->inner, s += LNF_TILE * isz) {
            if (isz == 4)       /* (sizes the compiler sees: one move each) */
                memcpy(p, s, 4);
            else if (isz == 2)
                memcpy(p, s, 2);
            else
                memcpy(p, s, 8);
        }
    }
}

/* A copied tile's n lanes stored to their rows: to r..r+n-1 (g NULL), or
 * each end held to its own (lnf_tails). */
static inline void lnf_tile_scatter_lanes(const char *src, const lnf_array *out, int like,
                                          const lnf_tails *g, ptrdiff_t r, ptrdiff_t n,
                                          ptrdiff_t isz, ptrdiff_t D)
{
    if (g == NULL) {
        lnf_tile_scatter_to(src, out, like, r, n, isz, D);
        return;
    }
    for (int k = 0; k < g->count; k++)
        lnf_tile_scatter_to(src + k * g->t * isz, out, like, g->first[k], g->t, isz, D);
}

/* Lane j of a copied tile set to zero. */
static inline void lnf_tile_clear(char *t, ptrdiff_t j, ptrdiff_t isz, ptrdiff_t D)
{
    for (ptrdiff_t i = 0; i < D; i++)
        memset(t + (i * LNF_TILE + j) * isz, 0, (size_t)isz);
}

/* The weight or bias m as the calling thread reads it: m's data, or a
 * 16-bit vector widened into `buf` (float32 arithmetic).  Each thread
 * widens its own copy: a vector widened by one core and read by the other
 * comes over line by line. */
static inline const void *lnf_param(const lnf_array *m, void *buf, ptrdiff_t D)
{
    return lnf_native(m) ? m->base : lnf_load_row(m, 0, D, buf, sizeof(float));
}

#endif
