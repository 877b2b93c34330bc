# cython: language_level=3
"""The CPU kernels' Python face: NumPy arrays described for the C API
(cpu/lnfast_cpu.h), which runs them with the GIL released.

Arrays arrive validated from lnfast._kernels (except in forward_common and
backward_common, which recognise the common call themselves): dtypes are
final, weight and bias are vectors of length D (contiguous, or 16-bit of
any stride), mean/rstd/dwdb are C-contiguous.  Rows of x, dy and out may
have any (aligned) strides.  Also the build's facts and the test hooks.
"""
from libc.float cimport DBL_MAX
from libc.stdint cimport uint16_t

cimport numpy as cnp
import ml_dtypes
import numpy as np

from lnfast._pool import handler as _pool_handler, MIN_BYTES as _POOL_MIN

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
    void lnf_round_to_16bit(const double* src, unsigned short* dst, Py_ssize_t n, int bfloat16)
    void lnf_parallel_copy(const void* src, void* dst, Py_ssize_t nbytes, int nthreads)
    int lnf_openmp()
    int lnf_max_threads()

cdef extern from "cpu/kernels.h" nogil:
    ctypedef struct lnf_kernels:
        void (*widen)(const char* src, Py_ssize_t stride, float* dst, Py_ssize_t n)
        void (*narrow)(const float* src, char* dst, Py_ssize_t stride, Py_ssize_t n)
    const lnf_kernels* lnf_kernels_for(int dtype)

cdef extern from "numpy/arrayobject.h":
    object PyDataMem_SetHandler(object handler)

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


# ---------------------------------------------------------------------------
# The build, and hooks for tests and benchmarks.

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


def round_to_16bit(cnp.ndarray a, bint bfloat16):
    """Contiguous float64 `a` rounded once to float16 or bfloat16 bits
    (uint16, a's shape), as the backward pass rounds 16-bit dweight/dbias.
    For tests."""
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT64 or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise TypeError("a must be a C-contiguous float64 array")
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(a), cnp.PyArray_DIMS(a),
                                             cnp.NPY_UINT16, 0)
    lnf_round_to_16bit(<const double*>cnp.PyArray_DATA(a), <unsigned short*>cnp.PyArray_DATA(out),
                       cnp.PyArray_SIZE(a), bfloat16)
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


cdef int describe(lnf_array* m, cnp.ndarray a) except -1:
    """m = the rows of `a` over its last axis."""
    if lnf_array_init(m, cnp.PyArray_DATA(a), dtype_of(a), cnp.PyArray_NDIM(a),
                      cnp.PyArray_DIMS(a), cnp.PyArray_STRIDES(a)) != LNF_OK:
        raise ValueError("array has too many non-contiguous leading axes")
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
# The kernels.  Arguments are checked by the caller (lnfast._kernels).

def forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
            cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
            double eps, bint centered, int nthreads):
    """y = norm(x + residual) row by row, z = x + residual when residual is
    not None; mean and rstd stored when not None.  w and b (b unread when
    not centered) are contiguous vectors of the compute type, float64 or
    float32, or with 16-bit data 16-bit vectors of any stride; either may be
    a constant stand-in of CONSTANT_MAX_D elements (constant) when D is
    longer.  16-bit rows are computed in float32."""
    run_forward(x, residual, z, y, w, b, mean, rstd, eps, centered, nthreads)


cdef int run_forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
                     cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
                     double eps, bint centered, int nthreads) except -1:
    cdef lnf_forward_args a
    cdef int status
    a.D = cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1)
    a.M = cnp.PyArray_SIZE(x) // a.D if a.D else 0
    describe(&a.x, x)
    describe(&a.y, y)
    a.has_residual = residual is not None
    if a.has_residual:
        describe(&a.residual, residual)
        describe(&a.z, z)
    describe(&a.weight, w)
    a.weight_len = cnp.PyArray_DIM(w, 0)
    a.bias_len = a.weight_len
    if centered:
        describe(&a.bias, b)
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
    describe(&a.x, x)
    describe(&a.dy, dy)
    describe(&a.dx, dx)
    a.has_dz = dz is not None
    if a.has_dz:
        describe(&a.dz, dz)
    describe(&a.weight, w)
    a.mean = data_or_null(mean)
    a.rstd = data_or_null(rstd)
    a.dwdb = cnp.PyArray_DATA(dwdb)
    a.nchunks = nchunks
    a.centered = centered
    a.nthreads = nthreads
    with nogil:
        status = lnf_backward(&a)
    return check(status, "backward")


# ---------------------------------------------------------------------------
# The common call in one step.  In a small call the Python glue (checks,
# dispatch, allocations, the weight vectors: 3-4 us) cost more than the
# rows; here the common case is recognised, allocated for and run without
# it.  Anything else returns None and takes the general path, which checks
# (and words the errors) and runs the same kernels.

cdef inline bint plain(object a, int typenum):
    """`a` is a NumPy ndarray (no subclass) of dtype `typenum` in native
    byte order, aligned and C-contiguous."""
    return (type(a) is cnp.ndarray and cnp.PyArray_TYPE(<cnp.ndarray>a) == typenum
            and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>a)
            and cnp.PyArray_ISALIGNED(<cnp.ndarray>a)
            and cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>a))


cdef inline bint plain_shaped(object a, int typenum, int nd, cnp.npy_intp* dims):
    """`a` is plain and of shape dims[:nd]."""
    return (plain(a, typenum) and cnp.PyArray_NDIM(<cnp.ndarray>a) == nd
            and cnp.PyArray_CompareLists(cnp.PyArray_DIMS(<cnp.ndarray>a), dims, nd))


cdef inline bint plain_vector(object a, int typenum, cnp.npy_intp D):
    """`a` is None (weight or bias not given) or a plain vector of length D."""
    return a is None or plain_shaped(a, typenum, 1, &D)


cdef inline bint plain_param(object p, int t, int ct, cnp.npy_intp D):
    """weight or bias `p` is None or a plain vector of length D, of the
    compute type ct or of the data's type t."""
    return plain_vector(p, ct, D) or plain_vector(p, t, D)


cdef inline int compute_typenum(int t):
    """The compute type of data of type t, or -1 for types not common."""
    if t == cnp.NPY_FLOAT64:
        return cnp.NPY_FLOAT64
    if t == cnp.NPY_FLOAT32 or t == cnp.NPY_FLOAT16 or t == BF16_TYPENUM:
        return cnp.NPY_FLOAT32
    return -1


cdef inline bint common_rows(object x, int* t, int* ct):
    """x is a plain array of a float type with at least one axis and one
    row; sets t to its type and ct to its compute type."""
    if type(x) is not cnp.ndarray:
        return False
    t[0] = cnp.PyArray_TYPE(<cnp.ndarray>x)
    ct[0] = compute_typenum(t[0])
    return (ct[0] >= 0 and cnp.PyArray_NDIM(<cnp.ndarray>x) > 0 and plain(x, t[0])
            and cnp.PyArray_SIZE(<cnp.ndarray>x) > 0)


cdef object new_array(int nd, cnp.npy_intp* dims, int typenum, size_t nbytes):
    """numpy.empty, drawing large buffers from the cache (as `empty`)."""
    if nbytes < _POOL_MIN:
        return cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    old = PyDataMem_SetHandler(_pool_handler)
    try:
        return cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    finally:
        PyDataMem_SetHandler(old)


cdef dict _constants = {}       # (value, D, typenum) -> read-only vector
cdef enum:
    CONSTANT_MAX_D = LNF_CONSTANT_MAX_D
    CONSTANT_MAX_KEPT = 64


def constant(double value, cnp.npy_intp D, int typenum, bint forward=False):
    """Read-only float32 or float64 vector of D copies of `value`: the
    stand-in for weight=None (ones) or bias=None (zeros), kept for reuse.
    For the forward pass, at most CONSTANT_MAX_D copies: its map takes
    longer rows by pieces of that length (map_row), so a long row needs no
    stand-in of its length."""
    if forward and D > CONSTANT_MAX_D:
        D = CONSTANT_MAX_D
    key = (value, D, typenum)
    v = _constants.get(key)
    if v is not None:
        return v
    v = cnp.PyArray_EMPTY(1, &D, typenum, 0)
    v.fill(value)
    v.flags.writeable = False
    if D <= CONSTANT_MAX_D:
        if len(_constants) >= CONSTANT_MAX_KEPT:
            _constants.clear()
        _constants[key] = v
    return v


def drop_constants():
    """Forget the kept stand-in vectors (lnfast.empty_cache)."""
    _constants.clear()


def constants_kept():
    """How many stand-in vectors are kept.  For tests."""
    return len(_constants)


def forward_common(threads_for, x, residual, weight, bias, eps, bint centered,
                   bint stats):
    """lnfast._kernels.forward for the common call: x (and residual, of x's
    dtype and shape) NumPy arrays as `plain` says, with at least one row;
    weight and bias None or such vectors of the compute dtype or x's; eps a
    finite float >= 0; no out.  Returns (y, z, mean, rstd) as forward does, mean
    and rstd only when `stats` (mean only when centered), or None when the
    call is not of this kind.  threads_for: lnfast._threads.threads_for."""
    cdef double e
    cdef int t, ct
    if type(eps) is not float or not common_rows(x, &t, &ct):
        return None
    cdef cnp.ndarray xa = x
    cdef int nd = cnp.PyArray_NDIM(xa)
    cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(xa)
    cdef cnp.npy_intp D = dims[nd - 1], M = cnp.PyArray_SIZE(xa) // D
    e = eps
    if not (e >= 0.0 and e <= DBL_MAX):
        return None
    if residual is not None and not plain_shaped(residual, t, nd, dims):
        return None
    if not (plain_param(weight, t, ct, D) and plain_param(bias, t, ct, D)):
        return None
    w = constant(1.0, D, ct, True) if weight is None else weight
    b = None if not centered else constant(0.0, D, ct, True) if bias is None else bias
    cdef size_t nbytes = cnp.PyArray_NBYTES(xa)
    cdef size_t stat_bytes = M * (8 if ct == cnp.NPY_FLOAT64 else 4)
    y = new_array(nd, dims, t, nbytes)
    z = new_array(nd, dims, t, nbytes) if residual is not None else None
    mean = new_array(nd - 1, dims, ct, stat_bytes) if stats and centered else None
    rstd = new_array(nd - 1, dims, ct, stat_bytes) if stats else None
    run_forward(xa, residual, z, y, w, b, mean, rstd, e, centered,
                min(<cnp.npy_intp>threads_for(M * D), M))
    return y, z, mean, rstd


def backward_common(threads_for, Py_ssize_t min_parallel, dy, x, mean, rstd, weight, dz,
                    bint centered):
    """lnfast._kernels.backward for the common call: dy and x (and dz) plain
    arrays of one dtype and shape, with at least one row; rstd (and mean,
    when centered) plain arrays of the compute dtype and shape x.shape[:-1];
    weight None or a plain vector of the compute dtype or x's.  Returns (dx,
    dweight, dbias) as backward does, or None when the call is not of this
    kind.  threads_for(n, min_parallel): lnfast._threads'."""
    cdef int t, ct
    if not common_rows(x, &t, &ct):
        return None
    cdef cnp.ndarray xa = x
    cdef int nd = cnp.PyArray_NDIM(xa)
    cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(xa)
    cdef cnp.npy_intp D = dims[nd - 1], M = cnp.PyArray_SIZE(xa) // D
    if not (plain_shaped(dy, t, nd, dims) and (dz is None or plain_shaped(dz, t, nd, dims))
            and plain_shaped(rstd, ct, nd - 1, dims)
            and (not centered or plain_shaped(mean, ct, nd - 1, dims))
            and plain_param(weight, t, ct, D)):
        return None
    w = constant(1.0, D, ct) if weight is None else weight
    nchunks = lnf_num_chunks(M, D)
    dx = new_array(nd, dims, t, cnp.PyArray_NBYTES(xa))
    cdef cnp.npy_intp rows_of_grads[2]
    rows_of_grads[0], rows_of_grads[1] = 2, D
    dwdb = cnp.PyArray_EMPTY(2, rows_of_grads,             # in the weight's dtype
                             ct if weight is None else cnp.PyArray_TYPE(<cnp.ndarray>weight), 0)
    run_backward(dy, xa, dz, mean if centered else None, rstd, w, dx, dwdb, nchunks,
                 centered, min(<Py_ssize_t>threads_for(M * D, min_parallel), nchunks))
    return dx, dwdb[0], dwdb[1]
