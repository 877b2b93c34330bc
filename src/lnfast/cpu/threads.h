/* OpenMP, or its stand-ins in a serial build (no _OPENMP): the same code
 * runs on one thread. */
#ifndef LNFAST_CPU_THREADS_H
#define LNFAST_CPU_THREADS_H

#ifdef _OPENMP
#include <omp.h>
/* (an orphaned barrier: it binds to the region of the calling thread) */
static inline void lnf_barrier(void) { _Pragma("omp barrier") }
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_max_threads(void) { return 1; }
static inline void lnf_barrier(void) {}
#endif

#endif
