/* The CPU kernels' constants, in one place.  What each was measured to
 * do is in docs/performance.md ("Tuning constants").
 *
 * None of them changes a result's bits except where said: they decide how
 * rows are cut up, never the order in which a row's terms are added.
 */
#ifndef LNFAST_CPU_CONFIG_H
#define LNFAST_CPU_CONFIG_H

/* --- Row sums (rowops.h); these fix the bits. --- */
/* Independent float64 accumulators per sum. */
#define LNF_LANES 16
/* Terms per lane summed in the element type before widening. */
#define LNF_BLOCK 4
/* Blocks of float32 terms summed in float32 before each widening. */
#define LNF_SUPER_F32 4
/* float64 rows: blocks summed from zero into a group, and groups summed
 * from zero into a mid level, before the lane's running sum takes them:
 * a long row is then no lane's long running sum, whose roundings can all
 * lean one way (docs/api.md, "Numerics"). */
#define LNF_SUPER_F64 16
#define LNF_MID_F64 16
/* How far ahead of its reads a sweep prefetches, running on into the next
 * row (the hardware prefetchers stop at each 4 KiB page). */
#ifndef LNF_PREFETCH_BYTES
#define LNF_PREFETCH_BYTES 2048
#endif

/* --- Rows redone (forward.c, backward.c); these fix the bits. --- */
/* A LayerNorm row's sums run about its shift: the mean of its first
 * LNF_SHIFT_TERMS values (rowops.h, row_shift; a power of two). */
#define LNF_SHIFT_TERMS 8
/* A LayerNorm row is summed again about its mean when its shift lies more
 * than sqrt(LNF_RESHIFT) standard deviations from the mean. */
#define LNF_RESHIFT 1
/* Rows whose variance is below this floor are redone in float64 (squares
 * may have underflowed): float32 arithmetic, float64 arithmetic. */
#define LNF_VAR_FLOOR_F32 1e-30
#define LNF_VAR_FLOOR_F64 1e-290
/* Backward rows whose terms g * (x - mean) average below these are redone
 * in float64: 2**-100 (float32), 2**-960 (float64). */
#define LNF_TINY_TERMS_F32 0x1p-100
#define LNF_TINY_TERMS_F64 0x1p-960
/* float32 dweight/dbias terms are summed in float32 over runs of this many
 * rows of a chunk, each run then added into the chunk's float64 partial
 * rows. */
#define LNF_RUN_ROWS 16

/* --- Tiles of rows far apart (tileops.h). --- */
/* Rows per tile: the lanes of the tile operations.  Fixes the bits (the
 * backward adds a column's dweight/dbias terms across a tile's lanes). */
#define LNF_TILE 16
/* Blocks of float64 terms a tile lane sums from zero into a group, and
 * groups it sums from zero into a mid level, before its running sum takes
 * them (tileops.h). */
#define LNF_TILE_SUPER_F64 8
#define LNF_TILE_MID_F64 16
/* Rows far apart are taken by tiles when they have at most this many
 * elements (a tile is read twice, the second time from cache), else
 * gathered one by one; fixes which of the two computes a row. */
#define LNF_TILE_MAX_D (1 << 14)
/* How many tiles ahead the tiles prefetch their columns (speed only). */
#define LNF_TILE_AHEAD 4
/* Tiles per group of lnf_tile_prefetch_runs (speed only). */
#define LNF_TILE_GROUP 16
/* The forward takes two tiles at once for rows of at most this many
 * elements (speed only: the two copies the sums keep stay in the L2). */
#ifndef LNF_TILE_PAIR_MAX_D
#define LNF_TILE_PAIR_MAX_D 1024
#endif

/* --- The backward's chunk grid (lnf_num_chunks); fixes the bits. --- */
/* At most this many chunks of rows, each summed in row order, of at least
 * this many rows, and at most this many bytes of float64 partial rows. */
#define LNF_MAX_CHUNKS 64
/* The most threads a call uses (more are capped, fewer than 1 mean 1), as
 * lnfast._threads caps them. */
#define LNF_MAX_THREADS 1024
/* The longest row the API takes: beyond any array, and short enough that
 * the drivers' byte counts (a few times D times 8) cannot overflow. */
#define LNF_MAX_D (PTRDIFF_MAX / 64)
#define LNF_MIN_ROWS_PER_CHUNK 64
#define LNF_PARTIALS_BYTES (16 << 20)
/* Fewer rows than two chunks are still cut in two from this many rows and
 * elements, so that two threads can share them. */
#define LNF_SPLIT_MIN_ROWS 32
#define LNF_SPLIT_MIN_ELEMENTS (1 << 17)

/* Backward rows whose working set is this many bytes or more are summed by
 * column blocks of LNF_COL_BLOCK columns, shared by the threads, the
 * blocks' sums added in block order; both depend on D and the dtypes only
 * (lnf_set_blocked changes them, for tests). */
#define LNF_BLOCKED_ROW_BYTES (7 << 18)
#define LNF_COL_BLOCK 4096

/* --- Speed only: none of these changes a bit. --- */
/* float32 and float64 outputs whose rows are this long or longer, and of
 * LNF_STREAM_MIN_BYTES or more in all, are written with streaming stores. */
#define LNF_STREAM_ROW_BYTES (1 << 16)
#define LNF_STREAM_MIN_BYTES (1 << 23)
/* Columns of the partial rows one thread adds up at a time. */
#define LNF_SUM_BLOCK 512
/* Threads add up the partial rows only past this many blocks x chunks. */
#define LNF_SUM_PARALLEL_MIN 256
/* One float64 chunk is summed in the output itself, unaligned, below this
 * many rows. */
#define LNF_IN_PLACE_MAX_ROWS 16
/* Longest constant stand-in vector (weight=None, bias=None) of the
 * forward pass: longer rows are mapped by pieces of this length. */
#define LNF_CONSTANT_MAX_D (1 << 16)

/* --- Addressing. --- */
/* Leading axes a row descriptor holds after merging contiguous ones. */
#define LNF_MAX_LEAD 32

#endif
