# OpenMP shim: a build without OpenMP still compiles and runs serially.
# Cython's prange/parallel degrade to plain loops when _OPENMP is undefined;
# these helpers do the same for the few runtime calls we make.
cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define LNFAST_OPENMP 1
    #else
    #define LNFAST_OPENMP 0
    static inline int omp_get_max_threads(void) { return 1; }
    static inline int omp_get_thread_num(void) { return 0; }
    #endif
    """
    bint LNFAST_OPENMP
    int omp_get_max_threads() noexcept nogil
    int omp_get_thread_num() noexcept nogil
