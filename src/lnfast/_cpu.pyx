# cython: language_level=3
"""The CPU kernels' Python face: NumPy arrays described for the C API
(cpu/lnfast_cpu.h), which runs them with the GIL released.

Arrays arrive validated and prepared by lnfast._kernels: dtypes are final,
weight and bias are vectors of length D (contiguous, or 16-bit of any
stride), mean/rstd/dwdb are C-contiguous.  Rows of x, dy and out may have
any (aligned) strides.  Also the build's facts and the test hooks.
"""
cimport numpy as cnp
import ml_dtypes
import numpy as np

cnp.import_array()

cdef extern from "cpu/lnfast_cpu.h" nogil:
    enum:
        LNF_FLOAT32, LNF_FLOAT64, LNF_FLOAT16, LNF_BFLOAT16
        LNF_OK, LNF_EINVAL, LNF_ENOMEM
        LNF_MAX_LEAD, LNF_CONSTANT_MAX_D
        LNF_BEST, LNF_NO_BF16, LNF_NO_AVX512, LNF_BASELINE
    ctypedef struct lnf_array:
        char* base
        Py_ssize_t inner
        int dtype
    ctypedef struct lnf_forward_args:
        lnf_array x, residual, z, y, weight, bias
        Py_ssize_t weight_len, bias_len
        void* mean
        void* rstd
        Py_ssize_t M, D
        double eps
        int has_residual, centered, nthreads
    ctypedef struct lnf_backward_args:
        lnf_array x, dy, dz, dx, weight
        const void* mean
        const void* rstd
        void* dwdb
        int dwdb_dtype
        Py_ssize_t M, D, nchunks
        int has_dz, centered, nthreads
    int lnf_array_init(lnf_array* a, void* base, int dtype, int ndim,
                       const cnp.npy_intp* shape, const cnp.npy_intp* strides)
    int lnf_forward(const lnf_forward_args* a)
    int lnf_backward(const lnf_backward_args* a)
    Py_ssize_t lnf_num_chunks(Py_ssize_t M, Py_ssize_t D)
    int lnf_streamed(Py_ssize_t D, Py_ssize_t itemsize, Py_ssize_t nbytes)
    int lnf_select(int limit)
    const char* lnf_simd_name()
    int lnf_set_blocked(Py_ssize_t row_bytes, Py_ssize_t col_block, Py_ssize_t* old)
    int lnf_round_sums(const double* sums, void* out, Py_ssize_t n, int dtype)
    void lnf_parallel_copy(const void* src, void* dst, Py_ssize_t nbytes, int nthreads)
    int lnf_openmp()
    int lnf_max_threads()

cdef extern from "cpu/kernels.h" nogil:
    ctypedef struct lnf_kernels:
        void (*widen)(const char* src, Py_ssize_t stride, float* dst, Py_ssize_t n)
        void (*narrow)(const float* src, char* dst, Py_ssize_t stride, Py_ssize_t n)
    const lnf_kernels* lnf_kernels_for(int dtype)

# Introspection of the build, read by show_config().
cdef extern from *:
    """
    #if defined(__clang__)
    #define LNFAST_COMPILER "clang " __clang_version__
    #elif defined(__GNUC__)
    #define LNFAST_COMPILER "gcc " __VERSION__
    #elif defined(_MSC_VER)
    #define LNFAST_STR2(x) #x
    #define LNFAST_STR(x) LNFAST_STR2(x)
    #define LNFAST_COMPILER "msvc " LNFAST_STR(_MSC_VER)
    #else
    #define LNFAST_COMPILER "unknown"
    #endif
    """
    const char* LNFAST_COMPILER

lnf_select(LNF_BEST)

# The leading axes an lnf_array holds apart (more must merge), for
# lnfast.torch, whose C++ kernels describe tensors with the same rule.
MAX_LEAD = LNF_MAX_LEAD


# ---------------------------------------------------------------------------
# The build, and hooks for tests and benchmarks.

def c_api_addresses():
    """The addresses of lnf_array_init, lnf_forward, lnf_backward and
    lnf_round_sums, for lnfast.jax's XLA FFI handlers (which link
    nothing of their own)."""
    return (<size_t><void*>lnf_array_init, <size_t><void*>lnf_forward,
            <size_t><void*>lnf_backward, <size_t><void*>lnf_round_sums)


def build_info():
    """The compiler, whether OpenMP is on, and the instruction set the row
    loops run with on this CPU."""
    return {
        "compiler": LNFAST_COMPILER.decode(),
        "openmp": bool(lnf_openmp()),
        "simd": lnf_simd_name().decode(),
    }


def omp_max_threads():
    """OpenMP's current default team size (1 without OpenMP)."""
    return lnf_max_threads()


def simd_path(str path):
    """Which code the row operations and 16-bit row conversions run: "best"
    (AVX-512 with its BF16 instructions, else AVX-512, else AVX2, with F16C
    for float16, where the CPU has them; on aarch64 its 16-bit conversions),
    "avx512" (no BF16 instructions), "avx2" (no AVX-512) or "portable" (the
    SSE2 or NEON baseline).  Returns the build float32 rows then run:
    "avx512", "avx2" or "baseline".  For tests and benchmarks: every path
    gives the same bits.  Not while another thread runs a kernel."""
    cdef int limit = {"best": LNF_BEST, "avx512": LNF_NO_BF16, "avx2": LNF_NO_AVX512,
                      "portable": LNF_BASELINE}[path]
    return ("baseline", "avx2", "avx512")[lnf_select(limit)]


def blocked_settings(Py_ssize_t row_bytes, Py_ssize_t col_block):
    """Sum backward rows of row_bytes or more in the sweep by column blocks
    of col_block columns (for tests: small rows can then take that path);
    returns the previous pair."""
    cdef Py_ssize_t old[2]
    if lnf_set_blocked(row_bytes, col_block, old) != LNF_OK:
        raise ValueError("row_bytes must be >= 0 and col_block >= 1")
    return old[0], old[1]


def streamed(Py_ssize_t D, Py_ssize_t itemsize, Py_ssize_t nbytes):
    """Whether an output of rows of D elements of `itemsize` bytes, `nbytes`
    in all, is written with streaming stores (when its rows are direct)."""
    return bool(lnf_streamed(D, itemsize, nbytes))


def num_chunks(Py_ssize_t M, Py_ssize_t D):
    """How many fixed row chunks the backward pass sums dweight/dbias over."""
    return lnf_num_chunks(M, D)


cdef Py_ssize_t chunks_for(Py_ssize_t M, Py_ssize_t D) noexcept nogil:
    return lnf_num_chunks(M, D)


def parallel_copy(cnp.ndarray src, cnp.ndarray dst, int nthreads):
    """dst[...] = src for C-contiguous arrays of equal size, on `nthreads`
    threads: the benchmark's measure of the machine's copy bandwidth."""
    if not (cnp.PyArray_IS_C_CONTIGUOUS(src) and cnp.PyArray_IS_C_CONTIGUOUS(dst)
            and cnp.PyArray_NBYTES(src) == cnp.PyArray_NBYTES(dst)):
        raise ValueError("src and dst must be C-contiguous and of equal size")
    with nogil:
        lnf_parallel_copy(cnp.PyArray_DATA(src), cnp.PyArray_DATA(dst),
                          cnp.PyArray_NBYTES(src), nthreads)


def convert(cnp.ndarray src, cnp.ndarray dst):
    """dst[:] = src between 1-D float32 and float16/bfloat16 arrays with the
    kernels' row conversions (rounding to nearest even).  For tests."""
    cdef Py_ssize_t n = cnp.PyArray_SIZE(src)
    if cnp.PyArray_NDIM(src) != 1 or cnp.PyArray_NDIM(dst) != 1 or cnp.PyArray_SIZE(dst) != n:
        raise ValueError("src and dst must be 1-D arrays of one size")
    cdef int s = dtype_of(src), d = dtype_of(dst)
    cdef Py_ssize_t ss = cnp.PyArray_STRIDES(src)[0], ds = cnp.PyArray_STRIDES(dst)[0]
    if s >= LNF_FLOAT16 and d == LNF_FLOAT32 and ds == 4:
        lnf_kernels_for(s).widen(<const char*>cnp.PyArray_DATA(src), ss,
                                 <float*>cnp.PyArray_DATA(dst), n)
    elif d >= LNF_FLOAT16 and s == LNF_FLOAT32 and ss == 4:
        lnf_kernels_for(d).narrow(<const float*>cnp.PyArray_DATA(src),
                                  <char*>cnp.PyArray_DATA(dst), ds, n)
    else:
        raise TypeError("one of src, dst must be contiguous float32, the other 16-bit")


def round_sums(cnp.ndarray a, dtype):
    """Contiguous float64 sums `a` rounded once to `dtype` (one of the four;
    a's shape), as the backward pass rounds dweight/dbias."""
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT64 or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise TypeError("a must be a C-contiguous float64 array")
    cdef cnp.ndarray out = np.empty_like(a, dtype=dtype)
    if lnf_round_sums(<const double*>cnp.PyArray_DATA(a), cnp.PyArray_DATA(out),
                      cnp.PyArray_SIZE(a), dtype_of(out)) != LNF_OK:
        raise ValueError("a must be aligned")
    return out


# ---------------------------------------------------------------------------
# NumPy arrays as the C API's descriptors.

# ml_dtypes registers bfloat16 with NumPy at run time: its type number.
cdef int BF16_TYPENUM = np.dtype(ml_dtypes.bfloat16).num


cdef inline int dtype_of(cnp.ndarray a) except -1:
    cdef int t = cnp.PyArray_TYPE(a)
    if t == cnp.NPY_FLOAT32:
        return LNF_FLOAT32
    if t == cnp.NPY_FLOAT64:
        return LNF_FLOAT64
    if t == cnp.NPY_FLOAT16:
        return LNF_FLOAT16
    if t == BF16_TYPENUM:
        return LNF_BFLOAT16
    raise TypeError(f"lnfast kernels take float32, float64, float16 or bfloat16, got {a.dtype}")


cdef int describe(lnf_array* m, cnp.ndarray a, str name) except -1:
    """m = the rows of `a` (the argument `name`) over its last axis."""
    if lnf_array_init(m, cnp.PyArray_DATA(a), dtype_of(a), cnp.PyArray_NDIM(a),
                      cnp.PyArray_DIMS(a), cnp.PyArray_STRIDES(a)) != LNF_OK:
        raise ValueError(f"{name} has too many leading axes that do not merge, or strides "
                         f"that reach past what a pointer's offset can hold")
    return 0


cdef inline void* data_or_null(cnp.ndarray a):
    return cnp.PyArray_DATA(a) if a is not None else NULL


cdef int check(int status, str what) except -1:
    if status == LNF_ENOMEM:
        raise MemoryError(f"lnfast: no memory for the {what} pass's scratch")
    if status != LNF_OK:
        raise ValueError(f"lnfast: the {what} kernel's arguments do not fit together")
    return 0


# ---------------------------------------------------------------------------
# The kernels.  Arguments are checked and prepared by lnfast._kernels.

def forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
            cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
            double eps, bint centered, int nthreads):
    """y = norm(x + residual) row by row, z = x + residual when residual is
    not None; mean and rstd stored when not None.  w and b (b unread when
    not centered) are contiguous vectors of the compute type, float64 or
    float32, or with 16-bit data 16-bit vectors of any stride; either may be
    a constant stand-in of LNF_CONSTANT_MAX_D elements when D is longer
    (lnfast._kernels.constant).  16-bit rows are computed in float32."""
    run_forward(x, residual, z, y, w, b, mean, rstd, eps, centered, nthreads)


cdef int run_forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
                     cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
                     double eps, bint centered, int nthreads) except -1:
    cdef lnf_forward_args a
    cdef int status
    a.D = cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1)
    a.M = cnp.PyArray_SIZE(x) // a.D if a.D else 0
    describe(&a.x, x, "x")
    describe(&a.y, y, "out")
    a.has_residual = residual is not None
    if a.has_residual:
        describe(&a.residual, residual, "residual")
        describe(&a.z, z, "z")
    describe(&a.weight, w, "weight")
    a.weight_len = cnp.PyArray_DIM(w, 0)
    a.bias_len = a.weight_len
    if centered:
        describe(&a.bias, b, "bias")
        a.bias_len = cnp.PyArray_DIM(b, 0)
    a.mean = data_or_null(mean)
    a.rstd = data_or_null(rstd)
    a.eps = eps
    a.centered = centered
    a.nthreads = nthreads
    with nogil:
        status = lnf_forward(&a)
    return check(status, "forward")


def backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dz, cnp.ndarray mean,
             cnp.ndarray rstd, cnp.ndarray w, cnp.ndarray dx, cnp.ndarray dwdb,
             Py_ssize_t nchunks, bint centered, int nthreads):
    """dx (plus dz when not None) into `dx`, and [dweight, dbias] into the
    C-contiguous (2, D) array `dwdb`: summed in float64 over `nchunks` row
    chunks (num_chunks), then rounded once to dwdb's dtype (float64,
    float32, float16 or bfloat16).  mean is ignored when not centered.  w
    as in forward()."""
    run_backward(dy, x, dz, mean, rstd, w, dx, dwdb, nchunks, centered, nthreads)


cdef int run_backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dz, cnp.ndarray mean,
                      cnp.ndarray rstd, cnp.ndarray w, cnp.ndarray dx, cnp.ndarray dwdb,
                      Py_ssize_t nchunks, bint centered, int nthreads) except -1:
    cdef lnf_backward_args a
    cdef int status
    a.D = cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1)
    a.M = cnp.PyArray_SIZE(x) // a.D if a.D else 0
    a.dwdb_dtype = dtype_of(dwdb)
    if cnp.PyArray_SIZE(dwdb) != 2 * a.D or not cnp.PyArray_IS_C_CONTIGUOUS(dwdb):
        raise TypeError("dwdb must be a C-contiguous (2, D) array of float64, "
                        "float32, float16 or bfloat16")
    if nchunks < 1 or nthreads < 1:
        raise ValueError("nchunks and nthreads must be at least 1")
    describe(&a.x, x, "x")
    describe(&a.dy, dy, "dy")
    describe(&a.dx, dx, "dx")
    a.has_dz = dz is not None
    if a.has_dz:
        describe(&a.dz, dz, "dz")
    describe(&a.weight, w, "weight")
    a.mean = data_or_null(mean)
    a.rstd = data_or_null(rstd)
    a.dwdb = cnp.PyArray_DATA(dwdb)
    a.nchunks = nchunks
    a.centered = centered
    a.nthreads = nthreads
    with nogil:
        status = lnf_backward(&a)
    return check(status, "backward")
