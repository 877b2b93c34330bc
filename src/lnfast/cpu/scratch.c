/* Each thread's scratch memory. */
#include "scratch.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "array.h"
#include "lnfast_cpu.h"

void *lnf_malloc_aligned(size_t n)
{
    char *raw = n <= SIZE_MAX - 64 ? malloc(n + 64) : NULL;
    if (raw == NULL)
        return NULL;
    char *p = (char *)(((uintptr_t)raw + 64) & ~(uintptr_t)63);   /* 1 to 64 bytes in */
    memcpy(p - sizeof raw, &raw, sizeof raw);      /* ... where the start is kept */
    return p;
}

void lnf_free_aligned(void *p)
{
    if (p != NULL) {
        char *raw;
        memcpy(&raw, (char *)p - sizeof raw, sizeof raw);
        free(raw);
    }
}

int lnf_scratch_begin(lnf_scratches *s, int n, ptrdiff_t rows, ptrdiff_t params, ptrdiff_t D,
                      size_t tsize)
{
    s->n = n;
    s->up_front = NULL;
    s->sc = &s->one;
    memset(&s->one, 0, sizeof s->one);
    if (n > 1 && (s->sc = calloc((size_t)n, sizeof *s->sc)) == NULL)
        return LNF_ENOMEM;
    if (rows + params == 0)
        return LNF_OK;
    /* (a thread's bytes, or PTRDIFF_MAX where they pass what memory holds) */
    ptrdiff_t bytes = lnf_rows_bytes(rows + params, D, (ptrdiff_t)tsize);
    size_t stride = ((size_t)bytes + 63) / 64 * 64;
    char *base = bytes <= PTRDIFF_MAX / n - 64 ? lnf_malloc_aligned(stride * (size_t)n) : NULL;
    if (base == NULL) {
        if (s->sc != &s->one)
            free(s->sc);
        return LNF_ENOMEM;
    }
    s->up_front = base;
    for (int t = 0; t < n; t++) {
        if (rows)
            s->sc[t].rows = base + t * stride;
        s->sc[t].params = base + t * stride + (size_t)rows * (size_t)D * tsize;
    }
    return LNF_OK;
}

int lnf_scratch_end(lnf_scratches *s)
{
    int failed = 0;
    for (int t = 0; t < s->n; t++) {
        failed |= s->sc[t].failed;
        if (s->sc[t].owned)
            free(s->sc[t].rows);
        free(s->sc[t].grads);
    }
    if (s->sc != &s->one)
        free(s->sc);
    lnf_free_aligned(s->up_front);
    return failed ? LNF_ENOMEM : LNF_OK;
}

void *lnf_rare_rows(lnf_scratch *sc, size_t nbytes)
{
    if (sc->rows == NULL && !sc->failed) {
        sc->rows = malloc(nbytes);
        sc->owned = 1;
        sc->failed = sc->rows == NULL;
    }
    return sc->rows;
}

double *lnf_rare_grads(lnf_scratch *sc, ptrdiff_t D)
{
    if (sc->grads == NULL && !sc->failed) {
        sc->grads = calloc(2 * (size_t)D, sizeof(double));
        sc->failed = sc->grads == NULL;
    }
    return sc->grads;
}
