/* Each thread's scratch memory. */
#ifndef LNFAST_CPU_SCRATCH_H
#define LNFAST_CPU_SCRATCH_H

#include <stddef.h>

/* One thread's scratch.  Rows that are strided or of mixed dtypes are
 * gathered into `rows`, allocated for every thread before the call
 * (lnf_scratch_begin).  Contiguous rows need rows only for their rare rows
 * redone in float64 (16-bit data), and float64 dweight/dbias terms only for
 * the rare rows of float32 arithmetic: both are allocated when a row first
 * needs them, so that a long row costs no scratch of its length up front. */
typedef struct lnf_scratch {
    void *rows;         /* gathered rows, or rows for the rare rows */
    void *params;       /* 16-bit weight and bias, widened */
    double *grads;      /* float64 dweight/dbias terms of rare rows (2 D) */
    int owned;          /* rows allocated on first use */
    int failed;         /* an allocation failed: LNF_ENOMEM */
} lnf_scratch;

/* All threads' scratch: one thread's in `one` (no allocation in a small
 * call), more allocated; `up_front` holds the rows and params allocated
 * before the call. */
typedef struct lnf_scratches {
    lnf_scratch *sc;
    lnf_scratch one;
    void *up_front;
    int n;
} lnf_scratches;

/* Scratch for n threads: for each, `rows` rows and `params` rows (of D
 * elements of tsize bytes), each thread's on its own 64-byte lines.
 * LNF_ENOMEM on failure (then nothing to end). */
int lnf_scratch_begin(lnf_scratches *s, int n, ptrdiff_t rows, ptrdiff_t params, ptrdiff_t D,
                      size_t tsize);
/* Free it all; LNF_ENOMEM where an allocation on first use failed. */
int lnf_scratch_end(lnf_scratches *s);

/* sc->rows, allocated on first use (nbytes) where the call did not; NULL
 * (and sc->failed) when that fails. */
void *lnf_rare_rows(lnf_scratch *sc, size_t nbytes);
/* sc->grads (2 D zeros at first), allocated on first use; NULL (and
 * sc->failed) when that fails. */
double *lnf_rare_grads(lnf_scratch *sc, ptrdiff_t D);

/* n bytes from a 64-byte line (free with lnf_free_aligned); NULL on failure. */
void *lnf_malloc_aligned(size_t n);
void lnf_free_aligned(void *p);

#endif
