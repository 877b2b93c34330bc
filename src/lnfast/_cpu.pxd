# The kernels as lnfast._kernels calls them (_cpu.pyx).
cimport numpy as cnp

cdef int run_forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
                     cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
                     double eps, bint centered, int nthreads) except -1
cdef int run_backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dz, cnp.ndarray mean,
                      cnp.ndarray rstd, cnp.ndarray w, cnp.ndarray dx, cnp.ndarray dwdb,
                      Py_ssize_t nchunks, bint centered, int nthreads) except -1
cdef Py_ssize_t chunks_for(Py_ssize_t M, Py_ssize_t D) noexcept nogil
