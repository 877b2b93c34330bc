/* lnfast's CPU kernels: a plain C API, free of Python and NumPy.
 *
 * Arrays are described by lnf_array: any number of leading axes with any
 * byte strides, over the normalized axis (the last), whose elements are
 * `inner` bytes apart.  LayerNorm (centered) and RMSNorm (not centered),
 * forward and backward, run over M rows of D elements on `nthreads`
 * OpenMP threads (fewer than 1: one; at most LNF_MAX_THREADS); results do
 * not depend on the thread count, the instruction set or the build
 * (docs/design.md).
 *
 * The functions return 0, or LNF_EINVAL (arguments that do not fit
 * together; nothing written) or LNF_ENOMEM (no memory for scratch; outputs
 * may be partly written).  They take no locks: call lnf_select once before
 * calls from several threads, and not while another call runs.
 */
#ifndef LNFAST_CPU_H
#define LNFAST_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "config.h"

#ifdef __cplusplus
extern "C" {
#endif

enum lnf_dtype { LNF_FLOAT32, LNF_FLOAT64, LNF_FLOAT16, LNF_BFLOAT16, LNF_NDTYPES };
enum { LNF_OK = 0, LNF_EINVAL = 1, LNF_ENOMEM = 2 };

/* An array of rows: row r (0 <= r < the product of shape[0..nd)) starts at
 * base + sum of index_k * stride[k] for r's index over shape[0..nd),
 * C order; its elements are `inner` bytes apart.  Made by lnf_array_init,
 * which merges leading axes contiguous with each other. */
typedef struct lnf_array {
    char *base;
    ptrdiff_t inner;
    int dtype;
    int nd;
    ptrdiff_t shape[LNF_MAX_LEAD];
    ptrdiff_t stride[LNF_MAX_LEAD];
} lnf_array;

/* Describe an array of `ndim` >= 1 axes whose last is normalized; byte
 * strides (a last axis of one element is taken as contiguous, whatever its
 * stride, as NumPy takes it).  LNF_EINVAL for an unknown dtype, a
 * negative length, NULL shape or strides, more than LNF_MAX_LEAD leading
 * axes that do not merge, or an array past a ptrdiff_t's reach (the
 * product of its nonzero lengths, or the bytes from its first element to
 * its last, over PTRDIFF_MAX). */
int lnf_array_init(lnf_array *a, void *base, int dtype, int ndim, const ptrdiff_t *shape,
                   const ptrdiff_t *strides);

/* y = norm(x [+ residual]) over rows; z = x + residual when has_residual;
 * mean and rstd (M values each, the compute type, contiguous; NULL: not
 * stored).  The compute type is float64 when weight is float64, else
 * float32 (16-bit data).  weight and bias (bias unread unless centered):
 * vectors (ndim 1) of the compute type, contiguous, or 16-bit of any
 * stride; weight_len and bias_len are D, or LNF_CONSTANT_MAX_D < D for a
 * constant vector (ones, zeros), which the map then repeats.  Outputs may
 * be the inputs (y may be x: each row is read before it is written).
 * Rows of float32 arithmetic may mix float32 and 16-bit arrays, of any
 * aligned strides (rows not contiguous in x's dtype are gathered); float64
 * arithmetic takes float64 arrays.  The inputs' layout chooses the kernel
 * (docs/design.md); that of the outputs, given x's dtype, changes no bit.
 * Arguments that do not fit (dtypes, row counts, misaligned data, a
 * strided float32/float64 vector, a 16-bit stand-in) give LNF_EINVAL.
 * Lengths are the caller's word: an lnf_array keeps no row length, so D
 * (and weight_len, bias_len) must be those of the arrays' rows and
 * vectors, and eps non-negative (lnfast's Python layer checks both). */
typedef struct lnf_forward_args {
    lnf_array x, residual, z, y, weight, bias;
    ptrdiff_t weight_len, bias_len;
    void *mean, *rstd;
    ptrdiff_t M, D;
    double eps;
    int has_residual, centered, nthreads;
} lnf_forward_args;

int lnf_forward(const lnf_forward_args *a);

/* dx = the gradient of the rows' norm (plus dz when has_dz), and
 * [dweight, dbias] into dwdb, C-contiguous (2, D) of dwdb_dtype (dbias
 * zero unless centered): summed in float64 over `nchunks` fixed chunks of
 * rows (0: lnf_num_chunks; at most the larger of M and LNF_MAX_CHUNKS, and
 * under 2**31), each in row order, then the chunks in order,
 * rounded once (dwdb_dtype LNF_FLOAT64, whatever the weight's type: the
 * float64 sums themselves, which rounded to the weight's type give that
 * call's bytes; lnfast's Dask backend adds those of its blocks).  mean
 * (unread unless centered) and rstd: M contiguous
 * values of the compute type, as the forward pass stored them.  weight as
 * in lnf_forward (weight_len D); dx's layout, as y's there, changes no
 * bit.  dx may be dz (in place), but must not overlap x or dy
 * (LNF_EINVAL where it is either of them). */
typedef struct lnf_backward_args {
    lnf_array x, dy, dz, dx, weight;
    const void *mean, *rstd;
    void *dwdb;
    int dwdb_dtype;
    ptrdiff_t M, D, nchunks;
    int has_dz, centered, nthreads;
} lnf_backward_args;

int lnf_backward(const lnf_backward_args *a);

/* The backward's chunk grid for M rows of D: a function of the shape only. */
ptrdiff_t lnf_num_chunks(ptrdiff_t M, ptrdiff_t D);

/* Whether an output of rows of D elements of `itemsize` bytes, `nbytes` in
 * all, is written with streaming stores (when its rows are contiguous). */
int lnf_streamed(ptrdiff_t D, ptrdiff_t itemsize, ptrdiff_t nbytes);

/* Choose the row operations for this CPU, below `limit`: LNF_BEST (the
 * best it has), LNF_NO_BF16 (no AVX512-BF16), LNF_NO_AVX512, LNF_BASELINE
 * (SSE2, NEON without its 16-bit conversions: the portable code).  Returns
 * what float32 rows then run: 2 AVX-512, 1 AVX2, 0 the baseline.  Every
 * choice gives the same bits; the first call of lnf_forward or
 * lnf_backward makes the LNF_BEST choice if none was made. */
enum { LNF_BEST, LNF_NO_BF16, LNF_NO_AVX512, LNF_BASELINE };
int lnf_select(int limit);
/* The instruction set float32 rows run with, in words. */
const char *lnf_simd_name(void);

/* Backward rows summed by column blocks: from rows of row_bytes in the
 * backward sweep, blocks of col_block columns (for tests; LNF_EINVAL for
 * row_bytes < 0 or col_block < 1).  The old values go to *old (or NULL). */
int lnf_set_blocked(ptrdiff_t row_bytes, ptrdiff_t col_block, ptrdiff_t old[2]);

/* n float64 sums rounded once to dtype (16-bit: through float32 rounded to
 * odd), as lnf_backward rounds dweight and dbias; LNF_EINVAL for an
 * unknown dtype, n < 0 or misaligned arrays. */
int lnf_round_sums(const double *sums, void *out, ptrdiff_t n, int dtype);

/* dst = src, on nthreads threads (the benchmarks' copy floor). */
void lnf_parallel_copy(const void *src, void *dst, ptrdiff_t nbytes, int nthreads);

/* Whether OpenMP is on, and its default team size (1 without). */
int lnf_openmp(void);
int lnf_max_threads(void);

#ifdef __cplusplus
}
#endif
#endif
