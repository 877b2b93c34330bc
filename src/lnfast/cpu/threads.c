/* The thread facts the Python layer asks for, and the copy floor. */
#include <string.h>

#include "lnfast_cpu.h"
#include "threads.h"

int lnf_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

int lnf_max_threads(void)
{
    return omp_get_max_threads();
}

void lnf_parallel_copy(const void *src, void *dst, ptrdiff_t nbytes, int nthreads)
{
    ptrdiff_t nblocks = (nbytes + (1 << 16) - 1) >> 16;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
    for (ptrdiff_t k = 0; k < nblocks; k++) {
        ptrdiff_t lo = k << 16;
        memcpy((char *)dst + lo, (const char *)src + lo,
               (size_t)(nbytes - lo < (1 << 16) ? nbytes - lo : (1 << 16)));
    }
}
