/* The kernel table: the row operations of each storage type, one build of
 * them per instruction set (rows_<type>_<isa>.c, from the template
 * rowops.h), and the one chosen for this CPU (dispatch.c).
 *
 * Adding an instruction set: a rows_<type>_<isa>.c unit per storage type,
 * its tables declared here, and its test in lnf_select (dispatch.c).
 * Adding a storage type: its enum value (lnfast_cpu.h), a unit per
 * instruction set, its declarations here and its row in lnf_select.
 */
#ifndef LNFAST_CPU_KERNELS_H
#define LNFAST_CPU_KERNELS_H

#include "simd.h"

/* One sweep over a row's columns each; rowops.h says what they compute.
 * Rows are in the storage type; w, b, k, dw and db in the compute type
 * (float32 for 16-bit rows); k: {hi, lo, rstd} forward, {mean, c, rstd,
 * mean(g), mean(g xhat)} backward.  The rows after the next ones, xf, rf
 * and dyf, are prefetched (NULL: none).  stream: LNF_STREAMED (and
 * LNF_STREAM_NOFENCE, simd.h). */
/* How the backward sums read a tile's columns (tileops.h, tv_load_carry). */
typedef enum { LNF_TILE_PLAIN, LNF_TILE_START, LNF_TILE_CARRIED } lnf_tile_carry;

typedef struct lnf_row_ops {
    void (*sums)(const void *x, const void *r, void *z, int centered, double shift, double *s,
                 ptrdiff_t n, const void *xf, const void *rf);
    void (*map)(const void *x, void *y, const void *w, const void *b, const void *k,
                ptrdiff_t n, int stream);
    void (*map_sums)(const void *x, void *y, const void *w, const void *b, const void *k,
                     const void *xn, const void *rn, void *zn, int centered, double *s,
                     ptrdiff_t n, const void *xf, const void *rf, int stream);
    void (*grad_sums)(const void *x, const void *dy, const void *w, double mean, double *s,
                      ptrdiff_t n, const void *xf, const void *dyf);
    void (*grad_map)(const void *x, const void *dy, const void *dz, void *dx, const void *k,
                     void *dw, void *db, const void *w, ptrdiff_t n, int stream);
    void (*grad_map_sums)(const void *x, const void *dy, const void *dz, void *dx,
                          const void *k, void *dw, void *db, const void *w, const void *xn,
                          const void *dyn, double mean_n, double *s, ptrdiff_t n,
                          const void *xf, const void *dyf, int stream);
    /* Tiles of LNF_TILE rows side by side, elements `inner` bytes apart
     * (tileops.h); per-lane values (shift, k, mean: LNF_TILE each) in the
     * compute type; s: 3 LNF_TILE doubles; the sums keep the values they
     * read (copy; xs, dys) for the maps, LNF_TILE of the compute type per
     * column; gw, gb: the dweight/dbias runs, laid out alike; the backward
     * sums' carries (2 D LNF_TILE of the compute type) and their mode, a
     * lnf_tile_carry.  The forward's take `tiles` (1 or 2) adjacent
     * tiles at once, each tile's per-lane values, s and copy after the
     * previous tile's. */
    void (*tile_sums)(const void *x, const void *r, void *z, ptrdiff_t inner, int centered,
                      const void *shift, double *s, ptrdiff_t D, void *copy, int tiles);
    void (*tile_map)(const void *xs, void *y, ptrdiff_t inner, const void *w, const void *b,
                     const void *k, ptrdiff_t D, int stream, int tiles);
    void (*tile_grad_sums)(const void *x, const void *dy, ptrdiff_t inner, const void *w,
                           const void *mean, double *s, ptrdiff_t D, void *xs, void *dys,
                           void *carries, int mode);
    void (*tile_grad_map)(const void *xs, const void *dys, const void *dz, void *dx,
                          ptrdiff_t inner, const void *k, void *gw, void *gb, const void *w,
                          ptrdiff_t D, int stream, int first);
    void (*tile_fold)(void *runs, double *dw, ptrdiff_t width);
    /* Whether the forward's tile operations gain from two tiles at once
     * (speed only: the bits are those of one at a time). */
    int tile_pairs;
} lnf_row_ops;

/* 16-bit rows of any byte stride to and from float32 (convert.c). */
typedef void (*lnf_widen_fn)(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n);
typedef void (*lnf_narrow_fn)(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n);

/* What a storage type runs: its row operations and, for 16-bit types, its
 * row conversions. */
typedef struct lnf_kernels {
    const lnf_row_ops *ops;
    lnf_widen_fn widen;
    lnf_narrow_fn narrow;
} lnf_kernels;

/* The kernels of storage type `dtype` (enum lnf_dtype) on this CPU, as
 * lnf_select last chose them. */
const lnf_kernels *lnf_kernels_for(int dtype);
/* Whether the tile drivers fetch each column's stretch of the next tiles
 * ahead (lnf_tile_prefetch_runs): on the CPUs where that was measured to
 * pay (docs/performance_axes.md); speed only, the bits are the same. */
int lnf_tile_runs_ahead(void);

/* The builds (rows_*.c). */
#define LNF_DECLARE_OPS(type)                                                  \
    extern const lnf_row_ops lnf_ops_##type##_baseline;                        \
    extern const lnf_row_ops lnf_ops_##type##_avx2;                            \
    extern const lnf_row_ops lnf_ops_##type##_avx512;
LNF_DECLARE_OPS(f32)
LNF_DECLARE_OPS(f64)
LNF_DECLARE_OPS(f16)
LNF_DECLARE_OPS(bf16)
#undef LNF_DECLARE_OPS
extern const lnf_row_ops lnf_ops_bf16_avx512bf16;
extern const lnf_row_ops lnf_ops_f16_neon;
extern const lnf_row_ops lnf_ops_bf16_neon;

/* The row conversions (convert.c): portable, with F16C (x86-64), NEON
 * (aarch64); the fast ones take the portable path for strided rows. */
void lnf_widen_f16_portable(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n);
void lnf_narrow_f16_portable(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n);
void lnf_widen_bf16_portable(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n);
void lnf_narrow_bf16_portable(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n);
void lnf_widen_f16_f16c(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n);
void lnf_narrow_f16_f16c(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n);
void lnf_widen_f16_neon(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n);
void lnf_narrow_f16_neon(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n);
void lnf_widen_bf16_neon(const char *src, ptrdiff_t stride, float *dst, ptrdiff_t n);
void lnf_narrow_bf16_neon(const float *src, char *dst, ptrdiff_t stride, ptrdiff_t n);
/* float64 values to float32 rounded to odd (halfconv.h), n at a time. */
void lnf_f64_to_f32_odd_row(const double *src, float *dst, ptrdiff_t n);
/* F16C and AVX usable here (cpuid and the OS's saved state). */
int lnf_has_f16c(void);

#endif
