# OpenMP shim: a build without OpenMP still compiles and runs serially.
# Cython's prange/parallel degrade to plain loops when _OPENMP is undefined;
# these helpers do the same for the few runtime calls we make.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define LNFAST_OPENMP 1
    /* (an orphaned barrier: it binds to the region of the calling thread;
       MSVC spells the pragma operator __pragma) */
    #if defined(_MSC_VER) && !defined(__clang__)
    static inline void lnf_omp_barrier(void) { __pragma(omp barrier) }
    #else
    static inline void lnf_omp_barrier(void) { _Pragma("omp barrier") }
    #endif
    #else
    #define LNFAST_OPENMP 0
    static inline int omp_get_max_threads(void) { return 1; }
    static inline int omp_get_thread_num(void) { return 0; }
    static inline int omp_get_num_threads(void) { return 1; }
    static inline void lnf_omp_barrier(void) { }
    #endif
    """
    bint LNFAST_OPENMP
    int omp_get_max_threads() noexcept nogil
    int omp_get_thread_num() noexcept nogil
    int omp_get_num_threads() noexcept nogil
    void lnf_omp_barrier() noexcept nogil
