# cython: language_level=3
"""CPU kernels: LayerNorm and RMSNorm, forward and backward, over the last axis.

One template (the fused type `real`) serves float32 and float64.  Rows are
spread over OpenMP threads with `prange`; all reductions run in float64 in a
fixed order, so results do not depend on the thread count.  The innermost
loops are the C row primitives of rowops.h.

Arrays arrive validated from `lnfast._kernels` (except in forward_common
and backward_common, which recognise the common call themselves): dtypes are
final, weight and bias are vectors of length D (contiguous, or 16-bit of
any stride), mean/rstd/dx outputs are C-contiguous.
Rows of x, dy and out may have any (aligned) strides: a row whose elements are
not adjacent is gathered into a per-thread buffer first.
"""
from cython.parallel cimport parallel, prange
from libc.float cimport DBL_MAX
from libc.math cimport fabs, frexp, ldexp, sqrt
from libc.stdint cimport uint16_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

cimport numpy as cnp
import numpy as np

from lnfast._openmp_helpers cimport (LNFAST_OPENMP, lnf_omp_barrier, omp_get_max_threads,
                                     omp_get_num_threads, omp_get_thread_num)

cnp.import_array()

ctypedef fused real:
    float
    double

cdef enum:
    MAX_LEAD = 32   # leading axes a RowMap can address after collapsing

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


def build_info():
    """The compiler, whether OpenMP is on, and the instruction set the row
    loops run with on this CPU."""
    return {
        "compiler": LNFAST_COMPILER.decode(),
        "openmp": bool(LNFAST_OPENMP),
        "simd": lnf_simd_runtime().decode(),
    }


# ---------------------------------------------------------------------------
# Output buffers come from a cache of large blocks (pool.h), so that repeated
# calls do not pay the kernel's page faults and zeroing for every output.

cdef extern from "pool.h":
    object lnf_pool_capsule()
    void lnf_pool_set_limit(size_t limit)
    void lnf_pool_clear()
    size_t lnf_pool_bytes()
    size_t lnf_pool_limit()
    size_t LNF_POOL_MIN

cdef extern from "numpy/arrayobject.h":
    object PyDataMem_SetHandler(object handler)

cdef object _pool_handler = lnf_pool_capsule()


def empty(shape, dtype):
    """numpy.empty(shape, dtype), drawing large buffers from the cache."""
    old = PyDataMem_SetHandler(_pool_handler)
    try:
        return np.empty(shape, dtype)
    finally:
        PyDataMem_SetHandler(old)


def cache_info():
    """(cached bytes, byte limit, smallest cached block size)."""
    return lnf_pool_bytes(), lnf_pool_limit(), LNF_POOL_MIN


def set_cache_limit(size_t limit):
    """Keep at most `limit` bytes of freed output buffers (0: none)."""
    lnf_pool_set_limit(limit)


def clear_cache():
    """Release the cached output buffers; the limit stays."""
    lnf_pool_clear()


def convert(cnp.ndarray src, cnp.ndarray dst):
    """dst[:] = src between 1-D float32 and float16/bfloat16 arrays with the
    kernels' row conversions (rounding to nearest even).  For tests."""
    cdef RowMap s, d
    cdef Py_ssize_t n = cnp.PyArray_SIZE(src)
    if cnp.PyArray_NDIM(src) != 1 or cnp.PyArray_NDIM(dst) != 1 or cnp.PyArray_SIZE(dst) != n:
        raise ValueError("src and dst must be 1-D arrays of one size")
    rowmap_init(&s, src)
    rowmap_init(&d, dst)
    if s.storage != NATIVE and cnp.PyArray_TYPE(dst) == cnp.NPY_FLOAT32 and d.inner == 4:
        load_row[float](&s, 0, n, <float*>d.base)       # widens into dst
    elif d.storage != NATIVE and cnp.PyArray_TYPE(src) == cnp.NPY_FLOAT32 and s.inner == 4:
        store_row[float](&d, 0, n, <float*>s.base)      # narrows into dst
    else:
        raise TypeError("one of src, dst must be contiguous float32, the other 16-bit")


def round_to_16bit(cnp.ndarray a, bint bfloat16):
    """Contiguous float64 `a` rounded once to float16 or bfloat16 bits
    (uint16, a's shape), as the backward pass rounds 16-bit dweight/dbias.
    For tests."""
    cdef cnp.npy_intp i, n = cnp.PyArray_SIZE(a)
    if cnp.PyArray_TYPE(a) != cnp.NPY_FLOAT64 or not cnp.PyArray_IS_C_CONTIGUOUS(a):
        raise TypeError("a must be a C-contiguous float64 array")
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(cnp.PyArray_NDIM(a), cnp.PyArray_DIMS(a),
                                             cnp.NPY_UINT16, 0)
    cdef const double* v = <const double*>cnp.PyArray_DATA(a)
    cdef uint16_t* o = <uint16_t*>cnp.PyArray_DATA(out)
    for i in range(n):
        o[i] = (lnf_f32_to_bf16(lnf_f64_to_f32_odd(v[i])) if bfloat16
                else lnf_f32_to_f16(lnf_f64_to_f32_odd(v[i])))
    return out


def simd_path(str path):
    """Which code the row sweeps and 16-bit row conversions run: "best"
    (AVX-512 with its BF16 instructions, else AVX-512, else AVX2, with F16C
    for float16, where the CPU has them; on aarch64 its 16-bit conversions),
    "avx512" (no BF16 instructions), "avx2" (no AVX-512) or "portable" (the
    SSE2 or NEON baseline).  Returns the build float32 rows then run:
    "avx512", "avx2" or "baseline".  For tests and benchmarks: every path
    gives the same bits."""
    global lnf_simd_path
    lnf_simd_path = {"best": 0, "avx512": 1, "avx2": 2, "portable": 3}[path]
    return ("baseline", "avx2", "avx512")[lnf_sweep_level(0)]


def omp_max_threads():
    """OpenMP's current default team size (1 without OpenMP)."""
    return omp_get_max_threads()


# ---------------------------------------------------------------------------
# Row addressing: row r of an array with any leading shape and strides.

cdef enum:
    NATIVE = 0      # rows stored in the compute type (float32 or float64)
    F16 = 1         # float16 rows, computed in float32
    BF16 = 2        # bfloat16 rows, computed in float32


# ml_dtypes registers bfloat16 with NumPy at run time: its type number.
import ml_dtypes
cdef int BF16_TYPENUM = np.dtype(ml_dtypes.bfloat16).num


cdef struct RowMap:
    char* base
    Py_ssize_t inner            # byte stride along the normalized axis
    int storage                 # NATIVE, F16 or BF16
    int nd                      # leading axes left after collapsing
    Py_ssize_t shape[MAX_LEAD]
    Py_ssize_t stride[MAX_LEAD]


cdef int rowmap_init(RowMap* m, cnp.ndarray a) except -1:
    """Describe the rows of `a`, merging leading axes that are contiguous with
    each other so that most arrays need one multiply per row."""
    cdef int k, nd = cnp.PyArray_NDIM(a) - 1
    cdef cnp.npy_intp* shape = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp* strides = cnp.PyArray_STRIDES(a)
    m.base = <char*>cnp.PyArray_DATA(a)
    m.inner = strides[nd]
    cdef int t = cnp.PyArray_TYPE(a)
    if t == cnp.NPY_FLOAT16:
        m.storage = F16
    elif t == BF16_TYPENUM:
        m.storage = BF16
    elif t == cnp.NPY_FLOAT32 or t == cnp.NPY_FLOAT64:
        m.storage = NATIVE
    else:
        raise TypeError(f"lnfast kernels take float32, float64, float16 or bfloat16, got {a.dtype}")
    m.nd = 0
    for k in range(nd):                 # outermost first; drop unit axes
        if shape[k] == 1:
            continue
        if m.nd > 0 and m.stride[m.nd - 1] == strides[k] * shape[k]:
            m.shape[m.nd - 1] *= shape[k]
            m.stride[m.nd - 1] = strides[k]
            continue
        if m.nd == MAX_LEAD:
            raise ValueError("array has too many non-contiguous leading axes")
        m.shape[m.nd] = shape[k]
        m.stride[m.nd] = strides[k]
        m.nd += 1
    return 0


cdef inline char* row_ptr(const RowMap* m, Py_ssize_t r) noexcept nogil:
    cdef Py_ssize_t off = 0
    cdef int k
    if m.nd == 1:
        return m.base + r * m.stride[0]
    for k in range(m.nd - 1, -1, -1):
        off += (r % m.shape[k]) * m.stride[k]
        r = r // m.shape[k]
    return m.base + off


cdef extern from "rowops_all.h" nogil:   # (includes halfconv.h)
    const char* lnf_simd_runtime()
    void lnf_widen_f16(const char* src, Py_ssize_t stride, float* dst, Py_ssize_t n)
    void lnf_narrow_f16(const float* src, char* dst, Py_ssize_t stride, Py_ssize_t n)
    void lnf_widen_bf16(const char* src, Py_ssize_t stride, float* dst, Py_ssize_t n)
    void lnf_narrow_bf16(const float* src, char* dst, Py_ssize_t stride, Py_ssize_t n)
    int lnf_simd_path
    int lnf_sweep_level(int f16c)
    uint16_t lnf_f32_to_bf16(float v)
    uint16_t lnf_f32_to_f16(float v)
    float lnf_f64_to_f32_odd(double v)
    void lnf_f64_to_f32_odd_row(const double* src, float* dst, Py_ssize_t n)
    int lnf_has_f16c()
    void lnf_add_run(double* dw, float* g, Py_ssize_t n, int first)
    void lnf_stream_fence()
    int LNF_STREAM_NOFENCE
    # Row sweeps (rowops.h), one per storage type; f16/bf16 rows are
    # uint16_t bits computed in float32.
    void lnf_row_pipe_f32(const float* x, float* y, const float* w, const float* b,
                          float hi, float lo, float rs, const float* xn, const float* rn,
                          float* zn, int centered, double* s, Py_ssize_t n,
                          const float* xf, const float* rf, int stream)
    void lnf_row_pipe_f64(const double* x, double* y, const double* w, const double* b,
                          double hi, double lo, double rs, const double* xn,
                          const double* rn, double* zn, int centered, double* s,
                          Py_ssize_t n, const double* xf, const double* rf, int stream)
    void lnf_row_pipe_f16(const uint16_t* x, uint16_t* y, const float* w, const float* b,
                          float hi, float lo, float rs, const uint16_t* xn, const uint16_t* rn,
                          uint16_t* zn, int centered, double* s, Py_ssize_t n,
                          const uint16_t* xf, const uint16_t* rf, int stream)
    void lnf_row_pipe_bf16(const uint16_t* x, uint16_t* y, const float* w, const float* b,
                           float hi, float lo, float rs, const uint16_t* xn,
                           const uint16_t* rn, uint16_t* zn, int centered, double* s,
                           Py_ssize_t n, const uint16_t* xf, const uint16_t* rf,
                           int stream)
    void lnf_row_grad_pipe_f32(const float* x, const float* dy, const float* dz, float* dx,
                               const float* k, float* dw, float* db, const float* xn,
                               const float* dyn, float mean_n, double* out, const float* w,
                               Py_ssize_t n, const float* xf, const float* dyf, int stream)
    void lnf_row_grad_pipe_f64(const double* x, const double* dy, const double* dz, double* dx,
                               const double* k, double* dw, double* db, const double* xn,
                               const double* dyn, double mean_n, double* out,
                               const double* w, Py_ssize_t n, const double* xf,
                               const double* dyf, int stream)
    void lnf_row_grad_pipe_f16(const uint16_t* x, const uint16_t* dy, const uint16_t* dz,
                               uint16_t* dx, const float* k, float* dw, float* db,
                               const uint16_t* xn, const uint16_t* dyn, float mean_n,
                               double* out, const float* w, Py_ssize_t n,
                               const uint16_t* xf, const uint16_t* dyf, int stream)
    void lnf_row_grad_pipe_bf16(const uint16_t* x, const uint16_t* dy, const uint16_t* dz,
                                uint16_t* dx, const float* k, float* dw, float* db,
                                const uint16_t* xn, const uint16_t* dyn, float mean_n,
                                double* out, const float* w, Py_ssize_t n,
                                const uint16_t* xf, const uint16_t* dyf, int stream)


cdef enum:     # per-thread scratch, in rows of D elements
    FORWARD_SCRATCH = 4                     # rows: x, residual, z, y
    BACKWARD_SCRATCH = 4                    # rows: x, dy, dx, dz
    PARAM_ROWS = 2                          # 16-bit weight, bias widened


cdef struct Scratch:
    # One thread's scratch.  Rows that are strided or of mixed dtypes are
    # gathered into `rows`, allocated for every thread before the call.
    # Direct rows need rows only for their rare rows redone in float64
    # (16-bit data) and float64 dweight/dbias terms only for the rare rows
    # of float32 arithmetic: both are allocated when a row first needs
    # them, so that a long row costs no scratch of its length up front.
    void* rows                  # gathered rows, or rows for the rare rows
    void* params                # 16-bit weight and bias, widened
    double* grads               # float64 dweight/dbias terms of rare rows (2 D)
    bint owned                  # rows allocated on first use (freed after)
    bint failed                 # an allocation failed: MemoryError after


cdef void* rare_rows(Scratch* sc, Py_ssize_t nbytes) noexcept nogil:
    """sc.rows, allocated on first use (nbytes) where the call did not
    allocate it; NULL (and sc.failed) when that fails."""
    if sc.rows == NULL and not sc.failed:
        sc.rows = malloc(nbytes)
        sc.owned = True
        sc.failed = sc.rows == NULL
    return sc.rows


cdef double* rare_grads(Scratch* sc, Py_ssize_t D) noexcept nogil:
    """sc.grads (2 D zeros at first), allocated on first use; NULL (and
    sc.failed) when that fails."""
    if sc.grads == NULL and not sc.failed:
        sc.grads = <double*>calloc(2 * D, sizeof(double))
        sc.failed = sc.grads == NULL
    return sc.grads


cdef inline void fold_grads(Scratch* sc, double* dw, Py_ssize_t D, Py_ssize_t c0,
                            Py_ssize_t c1, bint centered) noexcept nogil:
    """Add the float64 terms of a chunk's rare rows (sc.grads, columns
    c0..c1-1 of dweight and dbias) into its partial rows dw, after its last
    run, and zero them."""
    cdef Py_ssize_t j
    if sc.grads == NULL:
        return
    for j in range(c0, c1):
        dw[j] += sc.grads[j]
        sc.grads[j] = 0.0
        if centered:
            dw[D + j] += sc.grads[D + j]
            sc.grads[D + j] = 0.0


cdef Scratch* scratches_new(int n, Scratch* one) except NULL:
    """Each of n threads' Scratch, zeroed: `one` itself when n is 1 (no
    allocation in a small call), else allocated.  scratches_end frees them."""
    cdef Scratch* sc = one
    if n > 1:
        sc = <Scratch*>calloc(n, sizeof(Scratch))
        if sc == NULL:
            raise MemoryError()
    else:
        memset(one, 0, sizeof(Scratch))
    return sc


cdef int scratches_end(Scratch* sc, int n, Scratch* one) except -1:
    """Free what the rows allocated on first use, and sc itself (unless it
    is `one`); MemoryError where an allocation failed."""
    cdef int t
    cdef bint failed = False
    for t in range(n):
        failed = failed or sc[t].failed
        if sc[t].owned:
            free(sc[t].rows)
        free(sc[t].grads)
    if sc != one:
        free(sc)
    if failed:
        raise MemoryError("lnfast: no memory for the scratch of rows redone in float64")
    return 0


cdef inline const real* load_row(const RowMap* m, Py_ssize_t r, Py_ssize_t D,
                                 real* buf) noexcept nogil:
    """Row r as a contiguous pointer of the compute type: the row itself, or
    a copy in `buf` (gathered from strides, or widened from 16 bits)."""
    cdef const char* p = row_ptr(m, r)
    cdef Py_ssize_t i
    if m.storage == NATIVE:
        if m.inner == sizeof(real):
            return <const real*>p
        for i in range(D):
            buf[i] = (<const real*>(p + i * m.inner))[0]
    elif real is float:
        if m.storage == F16:
            lnf_widen_f16(p, m.inner, buf, D)
        else:
            lnf_widen_bf16(p, m.inner, buf, D)
    return buf


cdef inline void store_row(const RowMap* m, Py_ssize_t r, Py_ssize_t D,
                           const real* src) noexcept nogil:
    """Copy a finished row from scratch to its destination row (strided, or
    16-bit: rounded to nearest even, once)."""
    cdef char* p = row_ptr(m, r)
    cdef Py_ssize_t i
    if m.storage == NATIVE:
        for i in range(D):
            (<real*>(p + i * m.inner))[0] = src[i]
    elif real is float:
        if m.storage == F16:
            lnf_narrow_f16(src, p, m.inner, D)
        else:
            lnf_narrow_bf16(src, p, m.inner, D)


# ---------------------------------------------------------------------------
# Per-row math.  The inner loops are C primitives (rowops.h): float64 sums in
# fixed lanes, vectorized and dispatched at run time, bitwise the same on
# every CPU.  Here they are combined into LayerNorm and RMSNorm rows.

ctypedef const void* crow      # a row in its storage type (see rowops.h)


cdef inline void row_pipe(int storage, crow x, void* y, const real* w, const real* b,
                          real hi, real lo, real rs, crow xn, crow rn, void* zn,
                          double* s, Py_ssize_t D, int centered, crow xf=NULL,
                          crow rf=NULL, bint stream=False) noexcept nogil:
    """rowops.h lnf_row_pipe on rows stored as `storage`: the map of row x
    into y (x NULL: none) and the sums s[0], s[1] of the next row xn (+ rn,
    stored to zn), shifted by s[2]: its first value when centered is 1, hi
    when 2 (xn NULL: none); xf, rf: the rows after xn and rn, to prefetch
    (or NULL); stream: write y with streaming stores (STREAM_ROW_BYTES)."""
    if real is double:
        lnf_row_pipe_f64(<const double*>x, <double*>y, w, b, hi, lo, rs, <const double*>xn,
                         <const double*>rn, <double*>zn, centered, s, D, <const double*>xf,
                         <const double*>rf, stream)
    elif storage == NATIVE:
        lnf_row_pipe_f32(<const float*>x, <float*>y, w, b, hi, lo, rs, <const float*>xn,
                         <const float*>rn, <float*>zn, centered, s, D, <const float*>xf,
                         <const float*>rf, stream)
    elif storage == F16:
        lnf_row_pipe_f16(<const uint16_t*>x, <uint16_t*>y, w, b, hi, lo, rs,
                         <const uint16_t*>xn, <const uint16_t*>rn, <uint16_t*>zn, centered,
                         s, D, <const uint16_t*>xf, <const uint16_t*>rf, stream)
    else:
        lnf_row_pipe_bf16(<const uint16_t*>x, <uint16_t*>y, w, b, hi, lo, rs,
                          <const uint16_t*>xn, <const uint16_t*>rn, <uint16_t*>zn, centered,
                          s, D, <const uint16_t*>xf, <const uint16_t*>rf, stream)


cdef inline void row_grad_pipe(int storage, crow x, crow dy, crow dz, void* dx,
                               const real* k, real* dw, real* db, crow xn, crow dyn,
                               real mean_n, double* s, const real* w, Py_ssize_t D,
                               crow xf=NULL, crow dyf=NULL, int stream=0) noexcept nogil:
    """rowops.h lnf_row_grad_pipe on rows stored as `storage`: the map of
    row x (x NULL: none) and the sums s[0..2] of the next row xn (xn NULL:
    none); xf, dyf: the rows after xn and dyn, to prefetch (or NULL);
    stream: write dx with streaming stores (STREAM_ROW_BYTES), | the
    caller fences them (LNF_STREAM_NOFENCE)."""
    if real is double:
        lnf_row_grad_pipe_f64(<const double*>x, <const double*>dy, <const double*>dz,
                              <double*>dx, k, dw, db, <const double*>xn, <const double*>dyn,
                              mean_n, s, w, D, <const double*>xf, <const double*>dyf, stream)
    elif storage == NATIVE:
        lnf_row_grad_pipe_f32(<const float*>x, <const float*>dy, <const float*>dz,
                              <float*>dx, k, dw, db, <const float*>xn, <const float*>dyn,
                              mean_n, s, w, D, <const float*>xf, <const float*>dyf, stream)
    elif storage == F16:
        lnf_row_grad_pipe_f16(<const uint16_t*>x, <const uint16_t*>dy, <const uint16_t*>dz,
                              <uint16_t*>dx, k, dw, db, <const uint16_t*>xn,
                              <const uint16_t*>dyn, mean_n, s, w, D, <const uint16_t*>xf,
                              <const uint16_t*>dyf, stream)
    else:
        lnf_row_grad_pipe_bf16(<const uint16_t*>x, <const uint16_t*>dy, <const uint16_t*>dz,
                               <uint16_t*>dx, k, dw, db, <const uint16_t*>xn,
                               <const uint16_t*>dyn, mean_n, s, w, D, <const uint16_t*>xf,
                               <const uint16_t*>dyf, stream)


# row_grad_scalars: rows whose terms g * (x - mean) average below these are
# redone in float64 (backward_exact).  Below 2**-126 (float32) or 2**-1022
# (float64) a deviation or a term is subnormal and keeps fewer digits than
# its type; the margin covers |g| up to 2**26 or 2**62.  Random rows never
# come near them.
cdef double TINY_TERMS_F32 = 2.0 ** -100
cdef double TINY_TERMS_F64 = 2.0 ** -960


cdef enum:
    # A row is summed again about its mean when its shift (the first value)
    # lies more than sqrt(RESHIFT) standard deviations from the mean: each
    # square (x - shift)^2 is rounded in the working type, an error that the
    # cancellation in S2/D - (S1/D)^2 magnifies by 1 + (S1/D)^2 / var
    # (65536 ones after one -2**-12: float32 rstd off by 1e-3).  Random
    # rows take the second pass once in 16000 (|z| > 4); float64 rows, whose
    # rstd is not rounded to a coarser type, once in 22 (|z| > 2: worst rstd
    # error 34 -> 9 ulp, docs/api.md).
    RESHIFT = 16
    RESHIFT_F64 = 4


cdef inline void resum_far_shift(int storage, crow row, const real* w, double* s,
                                 Py_ssize_t D, bint centered) noexcept nogil:
    """Sum a LayerNorm row again, about its mean, where the sums s (about
    s[2]) say the shift was far from it (RESHIFT).  (w: unread.)"""
    cdef double m = s[0] / D
    cdef double limit = RESHIFT
    if real is double:
        limit = RESHIFT_F64
    if centered and m * m > limit * (s[1] / D - m * m):
        row_pipe(storage, NULL, NULL, w, w, <real>(s[2] + m), 0, 0, row, NULL, NULL, s, D, 2)


cdef inline bint row_stats(const double* s, Py_ssize_t D, double eps, bint centered,
                           real* k) noexcept nogil:
    """k = {hi, lo, rstd} of a row from its sums s over x - s[2] (RMSNorm:
    over x); False for the rare rows that row_exact must redo.

    LayerNorm sums run over x - x[0]: shifting by a member of the row keeps
    the sums of the size of the row's spread rather than its offset (and the
    differences of nearby values exact), so the cancellation in
    S2/D - (S1/D)^2 costs at most ~D ulps of float64 (typically one) -- not
    the textbook E[x^2] - E[x]^2 in working precision, which returns garbage
    for rows like [40000, 40001, 40002, 40003].  The float64 mean is then
    applied as hi + lo of type `real`: x - hi is exact for x near the mean,
    so float32 rows with a large common offset keep the digits that a
    float32 mean would round away; lo also carries the rounding error of
    the float64 mean's own last addition (TwoSum), which float64 rows with
    a large offset need.  RMSNorm sums x^2 without a shift.
    """
    cdef double mean = s[0] / D if centered else 0.0
    cdef double var = s[1] / D - mean * mean
    cdef double d = mean, t, err
    var = 0.0 if var < 0.0 else var      # clamp rounding below zero; NaN stays
    cdef double rstd = 1.0 / sqrt(var + eps)
    # Squares in the working type: a row whose variance is below its floor
    # may have lost squares to underflow (rows whose sums are exactly zero,
    # constant rows among them, only matter where eps does not swamp that),
    # and one near the type's top may have overflowed; such rows, and
    # float32 rows whose deviations or rstd leave float32's range, are redone
    # (row_exact).  NaN rows are redone too, and stay NaN.
    cdef double floor = 1e-30 if real is float else 1e-290
    if not ((var >= floor or (s[0] == 0.0 and s[1] == 0.0 and eps >= floor))
            and s[1] < 1e300):
        return False
    if real is float and not (D * var < 1e72 and 1e-30 < rstd < 1e30):
        return False
    mean += s[2]
    t = mean - s[2]
    err = (s[2] - (mean - t)) + (d - t)     # mean + err == s[2] + d exactly
    k[0] = <real>mean
    k[1] = <real>((mean - <double>k[0]) + err)
    k[2] = <real>rstd
    return True


cdef inline void row_exact(const real* x, real* y, const real* w, const real* b,
                           Py_ssize_t D, double eps, bint centered, real* k,
                           Py_ssize_t wp, Py_ssize_t bp) noexcept nogil:
    """A row past row_stats' limits, every term in float64: the deviations
    d = x - x[0] (RMSNorm: x) scaled by the power of two sc that brings the
    largest near 1 (or as near as float64 allows), so that no square
    overflows or underflows, and two passes (the mean of d, then the sums
    about it).  Any finite row at the cost of four reads.  k = {mean, 0,
    rstd} as stored.  wp, bp: the lengths of w and b (stand-ins repeat)."""
    cdef double pre = 1.0       # 1/2 where x - x[0] could overflow: x / 2 is exact there
    cdef Py_ssize_t j
    for j in range(D):
        if ldexp(1.0, 1022) < fabs(<double>x[j]) <= DBL_MAX:
            pre = 0.5
    eps = eps * pre * pre
    cdef double shift = (x[0] if centered else 0.0) * pre
    cdef double big = 0.0, sc = 1.0, m = 0.0, s1 = 0.0, s2 = 0.0, d, var, rs, rstd
    cdef Py_ssize_t i
    cdef int e
    for i in range(D):
        d = fabs(<double>x[i] * pre - shift)
        if big < d <= DBL_MAX:
            big = d
    if big > 0.0:
        frexp(big, &e)
        sc = ldexp(1.0, -e if e > -1022 else 1022)   # (2**1024 overflows)
    if centered:
        for i in range(D):
            m += (<double>x[i] * pre - shift) * sc
        m /= D
    for i in range(D):
        d = (<double>x[i] * pre - shift) * sc - m
        s1 += d
        s2 += d * d
    m += s1 / D if centered else 0.0
    var = s2 / D - (s1 / D) * (s1 / D) if centered else s2 / D
    var = 0.0 if var < 0.0 else var
    # rstd = 1 / sqrt(var / sc^2 + eps) and y = (x - mean) rstd = (d sc - m) rs
    # with rs = rstd / sc, from the scaled variance unless eps sc^2 overflows.
    if eps * sc * sc <= DBL_MAX:
        rs = 1.0 / sqrt(var + eps * sc * sc)
        rstd = rs * sc * pre
    else:
        rstd = 1.0 / sqrt(var / sc / sc + eps)
        rs = rstd / sc
        rstd *= pre
    for i in range(D):
        d = ((<double>x[i] * pre - shift) * sc - m) * rs * w[i % wp]
        y[i] = <real>(d + b[i % bp] if centered else d)
    k[0] = <real>((shift + m / sc) / pre)
    k[1] = 0
    k[2] = <real>rstd


cdef inline bint row_grad_scalars(const double* s, Py_ssize_t D, bint centered,
                                  real mean, real rstd, real* k) noexcept nogil:
    """The per-row scalars of the backward map from the row's sums s =
    {sum(x - mean), sum(g), sum(g * (x - mean))}, g = dy * w:
    k = {mean, c, rstd, mean(g), mean(g * xhat)}; False for the rare rows
    that backward_exact must redo: float32 rows whose sums came out infinite
    or NaN, and rows whose terms g * (x - mean) are tiny on average
    (TINY_TERMS_F32/F64), where deviations or dweight terms may be rounded
    to subnormals (a row of values near 1e-40 had float32 dweight off by
    1e-4 relative).  Rows where g sums to zero too (dy zero: padding) lose
    nothing there and are not redone; rows whose deviations are all zero
    (constant rows) are redone unless dy is zero, since a row of a few
    subnormal values can sum to exactly zero as well.

    LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
    RMSNorm (centered=False, mean = 0): dx = rstd * (g - xhat * mean(g * xhat)).
    The stored mean (rounded to `real`) serves as a shift; the residual
    c = mean(x - mean) is recovered in float64, so xhat = (x - mean - c) * rstd
    is as accurate as the forward pass even for large common offsets.
    """
    cdef double c = s[0] / D if centered else 0.0
    k[0] = mean
    k[1] = <real>c
    k[2] = rstd
    k[3] = <real>(s[1] / D) if centered else 0                 # mean(g)
    k[4] = <real>(rstd * (s[2] - c * s[1]) / D)               # mean(g * xhat)
    cdef double tiny = TINY_TERMS_F32 if real is float else TINY_TERMS_F64
    if real is float and not (-1e300 < s[0] + s[1] + s[2] < 1e300):
        return False
    return not (fabs(s[2]) < D * tiny and (s[2] != 0.0 or s[1] != 0.0))


# ---------------------------------------------------------------------------
# Drivers: one loop over rows for every variant.  The variants differ only in
# the per-row arguments (centered or not; a residual added first; an incoming
# gradient dz added last), never in how rows are split, threaded or reduced.

cdef struct Rows:
    RowMap x, res, z, y         # forward: y = norm(x [+ res]), z = x + res
    RowMap dy, dz, dx           # backward: dx = dnorm(dy, x) [+ dz]
    bint has_res, has_dz, centered
    bint one_run                # backward: one chunk of one float32 run (round_run)
    bint direct                 # all rows contiguous, in x's storage type
    bint stream                 # write y or dx with streaming stores
    bint blocked                # backward: rows summed by column blocks of
    Py_ssize_t col_block        # col_block columns (backward_blocks)
    RowMap w, b                 # weight and bias; 16-bit ones are widened per thread
    Py_ssize_t wp, bp           # forward: their lengths, D or CONSTANT_MAX_D (stand-ins)
    Py_ssize_t M, D
    double eps
    int nthreads


cdef inline real* out_row(const RowMap* m, Py_ssize_t r, real* buf) noexcept nogil:
    """Where to compute output row r: in place, or in `buf` for store_row."""
    return <real*>row_ptr(m, r) if m.inner == sizeof(real) and m.storage == NATIVE else buf


cdef inline crow row_or_null(const RowMap* m, Py_ssize_t r, Py_ssize_t end,
                             bint present=True) noexcept nogil:
    return <crow>row_ptr(m, r) if present and r < end else NULL


cdef void forward_exact(const Rows* a, const real* w, const real* b, Py_ssize_t r,
                        real* k, Scratch* sc) noexcept nogil:
    """Row r by row_exact, gathered into the thread's rows (2) where not
    contiguous in the compute type."""
    cdef real* buf = <real*>sc.rows
    if a.direct and a.x.storage != NATIVE:
        buf = <real*>rare_rows(sc, 2 * a.D * sizeof(real))
        if buf == NULL:
            k[0] = k[1] = k[2] = 0
            return
    cdef const real* xr = load_row(&a.z if a.has_res else &a.x, r, a.D, buf)
    cdef real* yr = out_row(&a.y, r, buf + a.D)
    row_exact(xr, yr, w, b, a.D, a.eps, a.centered, k, a.wp, a.bp)
    if yr == buf + a.D:
        store_row(&a.y, r, a.D, yr)


cdef inline void map_row(const Rows* a, int st, crow x, void* y, const real* w,
                         const real* b, const real* k) noexcept nogil:
    """y = the normalized row x (k: hi, lo, rstd), in pieces of
    CONSTANT_MAX_D columns where the weight or bias is a stand-in of that length (the map
    is elementwise: the same bits as in one piece)."""
    cdef Py_ssize_t j = 0, n, isz = sizeof(real) if st == NATIVE else 2
    cdef Py_ssize_t piece = min(a.wp, a.bp)
    cdef double s[3]
    while j < a.D:
        n = min(piece, a.D - j)
        row_pipe(st, <const char*>x + j * isz, <char*>y + j * isz,
                 w + (j if a.wp == a.D else 0),
                 (b + (j if a.bp == a.D else 0)) if a.centered else NULL,
                 k[0], k[1], k[2], NULL, NULL, NULL, s, n, a.centered, NULL, NULL, a.stream)
        j += n


cdef void forward_block(const Rows* a, const real* w, const real* b, real* mean_out,
                        real* rstd_out, Py_ssize_t r0, Py_ssize_t r1,
                        Scratch* sc) noexcept nogil:
    """Rows r0..r1-1 of direct arrays, software-pipelined: one sweep
    normalizes row r and sums row r + 1 (forming z = x + residual of row
    r + 1), so reading the next row overlaps writing this one; the rare
    rows go to forward_exact."""
    cdef Py_ssize_t r, D = a.D
    cdef int st = a.x.storage
    cdef double s[3]
    cdef double sn[3]
    cdef real k[3]
    cdef bint res = a.has_res, ok
    sn[0] = sn[1] = sn[2] = 0.0     # (the last row has no next row to sum)
    row_pipe(st, NULL, NULL, w, b, 0, 0, 0, row_ptr(&a.x, r0), row_or_null(&a.res, r0, r1, res),
             <void*>row_or_null(&a.z, r0, r1, res), s, D, a.centered)
    for r in range(r0, r1):
        resum_far_shift(st, row_ptr(&a.z if res else &a.x, r), w, s, D, a.centered)
        ok = row_stats(s, D, a.eps, a.centered, k)
        if ok and a.wp == D and a.bp == D:
            row_pipe(st, row_ptr(&a.z if res else &a.x, r), row_ptr(&a.y, r), w,
                     b if a.centered else NULL, k[0], k[1], k[2],
                     row_or_null(&a.x, r + 1, r1), row_or_null(&a.res, r + 1, r1, res),
                     <void*>row_or_null(&a.z, r + 1, r1, res), sn, D, a.centered,
                     row_or_null(&a.x, r + 2, r1), row_or_null(&a.res, r + 2, r1, res),
                     a.stream)
        else:
            if ok:      # (a stand-in weight or bias: by pieces)
                map_row(a, st, row_ptr(&a.z if res else &a.x, r), row_ptr(&a.y, r), w, b, k)
            else:
                forward_exact(a, w, b, r, k, sc)
            if r + 1 < r1:
                row_pipe(st, NULL, NULL, w, b, 0, 0, 0, row_ptr(&a.x, r + 1),
                         row_or_null(&a.res, r + 1, r1, res), <void*>row_or_null(&a.z, r + 1, r1, res),
                         sn, D, a.centered)
        if mean_out != NULL:
            mean_out[r] = k[0]
        if rstd_out != NULL:
            rstd_out[r] = k[2]
        s[0], s[1], s[2] = sn[0], sn[1], sn[2]


cdef void forward_row(const Rows* a, const real* w, const real* b, real* mean_out,
                      real* rstd_out, Py_ssize_t r, Scratch* sc) noexcept nogil:
    """Row r of arrays with some rows strided or of another dtype: rows are
    gathered into the thread's rows (4) in the compute type and stored
    back.  The same arithmetic as forward_block, one pass after another."""
    cdef Py_ssize_t D = a.D
    cdef real* buf = <real*>sc.rows
    cdef double s[3]
    cdef real k[3]
    cdef const real* xr = load_row(&a.x, r, D, buf)
    cdef real* zr
    cdef real* yr
    if a.has_res:       # z = x + residual, then normalize z from cache
        zr = out_row(&a.z, r, buf + 2 * D)
        row_pipe(NATIVE, NULL, NULL, w, b, 0, 0, 0, xr, load_row(&a.res, r, D, buf + D), zr,
                 s, D, a.centered)
        xr = zr
        if zr == buf + 2 * D:                   # computed in scratch
            store_row(&a.z, r, D, zr)
            if a.z.storage != NATIVE:           # normalize the z that is returned
                xr = load_row(&a.z, r, D, zr)
                row_pipe(NATIVE, NULL, NULL, w, b, 0, 0, 0, xr, NULL, NULL, s, D, a.centered)
    else:
        row_pipe(NATIVE, NULL, NULL, w, b, 0, 0, 0, xr, NULL, NULL, s, D, a.centered)
    yr = out_row(&a.y, r, buf + 3 * D)
    resum_far_shift(NATIVE, xr, w, s, D, a.centered)
    if row_stats(s, D, a.eps, a.centered, k):
        map_row(a, NATIVE, xr, yr, w, b, k)
    else:
        row_exact(xr, yr, w, b, D, a.eps, a.centered, k, a.wp, a.bp)
    if mean_out != NULL:
        mean_out[r] = k[0]
    if rstd_out != NULL:
        rstd_out[r] = k[2]
    if yr == buf + 3 * D:
        store_row(&a.y, r, D, yr)


cdef inline void forward_range(const Rows* a, const real* w, const real* b,
                               real* mean_out, real* rstd_out, Py_ssize_t r0, Py_ssize_t r1,
                               Scratch* sc) noexcept nogil:
    """Rows r0..r1-1: pipelined for direct arrays, else row by row."""
    cdef Py_ssize_t r
    if a.direct:
        if r0 < r1:
            forward_block(a, w, b, mean_out, rstd_out, r0, r1, sc)
    else:
        for r in range(r0, r1):
            forward_row(a, w, b, mean_out, rstd_out, r, sc)


cdef inline const real* param(const RowMap* m, const real* p, Scratch* sc, Py_ssize_t row,
                              Py_ssize_t D) noexcept nogil:
    """The weight or bias p (described by m) as the calling thread reads it:
    p itself, or a 16-bit p widened into row `row` of its sc.params.  Each
    thread widens its own copy: a vector widened by one core and read by
    the other comes over line by line (8x8192 bfloat16 forward: 1.2x,
    docs/performance.md)."""
    if real is float and m.storage != NATIVE:
        return load_row(m, 0, D, <real*>sc.params + row * D)
    return p


cdef void forward_rows(const Rows* a, const real* w, const real* b,
                       real* mean_out, real* rstd_out, Scratch* sc) noexcept:
    """Each thread takes one contiguous block of rows (rows are independent:
    the split changes no result).  One thread: no OpenMP region at all (a
    region costs a small call about 0.4 us, even on one thread).  sc: each
    thread's scratch."""
    cdef Py_ssize_t t, M = a.M, nt = a.nthreads, D = a.D
    cdef Scratch* mine
    cdef const real* wt = w     # (set before the region: it copies them in)
    cdef const real* bt = b
    if nt == 1:
        with nogil:
            wt = param(&a.w, w, sc, 0, D)
            bt = param(&a.b, b, sc, 1, D)
            forward_range(a, wt, bt, mean_out, rstd_out, 0, M, sc)
        return
    with nogil, parallel(num_threads=nt):
        mine = sc + omp_get_thread_num()
        wt = param(&a.w, w, mine, 0, D)
        bt = param(&a.b, b, mine, 1, D)
        for t in prange(nt, schedule='static'):
            forward_range(a, wt, bt, mean_out, rstd_out, t * M // nt, (t + 1) * M // nt, mine)


cdef enum:
    # float32 dweight/dbias terms are summed in float32 over runs of this
    # many rows of a chunk, each run then added into the chunk's float64
    # partial rows.  Widening every term to float64 in the sweep cost the
    # float32 and 16-bit backward 2-35% (two conversions and twice the bytes
    # loaded and stored per 16 terms); runs of 16 raise float32 dweight's
    # relative error from 6e-8 to 1e-7 (docs/api.md).  Runs of 8 were 3-11%
    # slower, runs of 32 up to 7% faster at D = 65536 only.
    RUN_ROWS = 16


cdef inline void end_of_run(const Rows* a, real* g, double* dw, Py_ssize_t i,
                            Py_ssize_t n, Py_ssize_t c0=0, Py_ssize_t c1=-1) noexcept nogil:
    """After the i-th of a chunk's n rows (from 0): add a full or final run
    of float32 sums g into dw (and zero g), the first run setting dw, in
    columns c0..c1-1 of dweight and dbias (c1 -1: all; backward_blocks
    gives each thread its own).  float64 sums are in dw itself; a call's
    one run stays in g (round_run)."""
    if real is float and not a.one_run and (i % RUN_ROWS == RUN_ROWS - 1 or i == n - 1):
        if c1 < 0:
            c1 = a.D
        lnf_add_run(dw + c0, g + c0, c1 - c0, i < RUN_ROWS)
        if a.centered:
            lnf_add_run(dw + a.D + c0, g + a.D + c0, c1 - c0, i < RUN_ROWS)


cdef void backward_exact(const Rows* a, const real* w, const real* mean, const real* rstd,
                         Py_ssize_t r, real* g, Scratch* sc) noexcept nogil:
    """Row r in float64 throughout, for the rows row_grad_scalars turns down.
    float32 rows whose sums overflow overflow float32 in the map too (x near
    float32's limit, or dy * weight past it), where the true dx and dweight
    terms may be finite.  float64 rows whose deviations from the mean are
    all below 2**-900 are scaled by 2**1000 first, so that no deviation is
    rounded to a subnormal when the mean's residual c is taken off it.  The
    dweight/dbias terms of float32 arithmetic are added in float64 (sc.grads,
    fold_grads), not rounded to float32: a subnormal float32 term keeps few
    digits.  Rows are gathered into the thread's rows (4) where not
    contiguous in the compute type; dx is rounded once (16-bit dx: then to
    16 bits, as the forward's row_exact)."""
    cdef Py_ssize_t i, D = a.D
    cdef double s0 = 0.0, s1 = 0.0, s2 = 0.0
    cdef double m = mean[r] if a.centered else 0.0
    cdef double rs = rstd[r], c, mg, mgx, xh, d, gi, big = 0.0, up = 1.0
    cdef real* buf = <real*>sc.rows
    cdef double* grads = NULL
    if a.direct and a.x.storage != NATIVE:
        buf = <real*>rare_rows(sc, 4 * D * sizeof(real))
        if buf == NULL:
            return
    if real is float:
        grads = rare_grads(sc, D)
        if grads == NULL:
            return
    cdef const real* xr = load_row(&a.x, r, D, buf)
    cdef const real* dyr = load_row(&a.dy, r, D, buf + D)
    cdef real* dxr = out_row(&a.dx, r, buf + 2 * D)
    cdef const real* dzr = load_row(&a.dz, r, D, buf + 3 * D) if a.has_dz else NULL
    if real is double:
        for i in range(D):
            d = fabs(xr[i] - m)
            if big < d <= DBL_MAX:
                big = d
        if big < ldexp(1.0, -900):
            up = ldexp(1.0, 1000)
    for i in range(D):
        d = (xr[i] - m) * up
        gi = <double>dyr[i] * w[i]
        s0 += d
        s1 += gi
        s2 += gi * d
    c = s0 / D if a.centered else 0.0           # (c, mgx: scaled by up)
    mg = s1 / D if a.centered else 0.0
    mgx = rs * (s2 - c * s1) / D
    for i in range(D):
        xh = ((xr[i] - m) * up - c) * rs        # xhat * up
        d = rs * ((<double>dyr[i] * w[i] - mg) - xh * (mgx / up) / up)
        if dzr != NULL:
            d += dzr[i]
        dxr[i] = <real>d
        if real is float:
            grads[i] += dyr[i] * xh
            if a.centered:
                grads[D + i] += dyr[i]
        else:
            g[i] += dyr[i] * xh / up
            if a.centered:
                g[D + i] += dyr[i]
    if buf != NULL and dxr == buf + 2 * D:
        store_row(&a.dx, r, D, dxr)


cdef inline void backward_block(const Rows* a, const real* w, const real* mean,
                                const real* rstd, Py_ssize_t r0, Py_ssize_t r1,
                                double* dw, real* g, Scratch* sc) noexcept nogil:
    """Rows r0..r1-1 of direct arrays, in order, software-pipelined as
    forward_block: one sweep maps row r (dx, and its terms into g[0:D],
    g[D:2D], see RUN_ROWS) and sums row r + 1; the rare rows go to
    backward_exact."""
    cdef Py_ssize_t r, D = a.D
    cdef int st = a.x.storage
    cdef double s[3]
    cdef real k[5]
    cdef bint c = a.centered
    if r0 >= r1:
        return
    row_grad_pipe(st, NULL, NULL, NULL, NULL, NULL, NULL, NULL, row_ptr(&a.x, r0),
                  row_ptr(&a.dy, r0), mean[r0] if c else 0, s, w, D)
    for r in range(r0, r1):
        if not row_grad_scalars(s, D, c, mean[r] if c else 0, rstd[r], k):
            backward_exact(a, w, mean, rstd, r, g, sc)
            if r + 1 < r1:
                row_grad_pipe(st, NULL, NULL, NULL, NULL, NULL, NULL, NULL, row_ptr(&a.x, r + 1),
                              row_ptr(&a.dy, r + 1), mean[r + 1] if c else 0, s, w, D)
            end_of_run(a, g, dw, r - r0, r1 - r0)
            continue
        row_grad_pipe(st, row_ptr(&a.x, r), row_ptr(&a.dy, r),
                      row_or_null(&a.dz, r, r1, a.has_dz), row_ptr(&a.dx, r), k, g,
                      g + D if c else NULL, row_or_null(&a.x, r + 1, r1),
                      row_or_null(&a.dy, r + 1, r1), mean[r + 1] if c and r + 1 < r1 else 0,
                      s, w, D, row_or_null(&a.x, r + 2, r1), row_or_null(&a.dy, r + 2, r1),
                      a.stream)
        end_of_run(a, g, dw, r - r0, r1 - r0)


cdef inline void backward_row(const Rows* a, const real* w, const real* mean,
                              const real* rstd, Py_ssize_t r, real* g,
                              Scratch* sc) noexcept nogil:
    """Row r of arrays with some rows strided or of another dtype, gathered
    into the thread's rows (4: x, dy, dx, dz) and stored back: the
    arithmetic of backward_block, one pass after another."""
    cdef Py_ssize_t D = a.D
    cdef real* buf = <real*>sc.rows
    cdef double s[3]
    cdef real k[5]
    cdef real m = mean[r] if a.centered else 0
    cdef const real* xr = load_row(&a.x, r, D, buf)
    cdef const real* dyr = load_row(&a.dy, r, D, buf + D)
    cdef real* dxr = out_row(&a.dx, r, buf + 2 * D)
    row_grad_pipe(NATIVE, NULL, NULL, NULL, NULL, NULL, NULL, NULL, xr, dyr, m, s, w, D)
    if not row_grad_scalars(s, D, a.centered, m, rstd[r], k):
        backward_exact(a, w, mean, rstd, r, g, sc)
        return
    row_grad_pipe(NATIVE, xr, dyr, load_row(&a.dz, r, D, buf + 3 * D) if a.has_dz else NULL,
                  dxr, k, g, g + D if a.centered else NULL, NULL, NULL, 0, s, w, D)
    if dxr == buf + 2 * D:
        store_row(&a.dx, r, D, dxr)


# Long rows are summed by blocks of COL_BLOCK columns, each block's sums
# added in block order (backward_blocks): where a row's working set in the
# backward sweep (x and dy of the row mapped and of the row summed, the
# weight, the dweight/dbias rows) is BLOCKED_ROW_BYTES or more, it no longer
# fits one core's L2 beside the rest, and then the threads share each row's
# columns, blocks apart, rather than each taking rows of its own: on two
# cores each holds half the set.  The blocks are fixed by D alone, so the
# bits do not depend on which thread sums which block, nor on whether the
# threads share rows at all.  Measured (two threads, side by side): 1.25x
# at 1024x65536 float64 (3.5 MiB), 1.14x float32 (1.75 MiB), 1.44x
# 512x131072 bfloat16, 1.08x 2048x32768 float64 (1.75 MiB); 0.84-0.96x at
# 1.07-1.53 MiB, where the barriers and the blocks' calls cost more.  Blocks
# of 4096 on one thread: 0.98x (a call per block).  Module settings,
# changed only by tests (blocked_settings); a call reads them once.
cdef Py_ssize_t BLOCKED_ROW_BYTES = 7 << 18
cdef Py_ssize_t COL_BLOCK = 4096


def blocked_settings(Py_ssize_t row_bytes, Py_ssize_t col_block):
    """Set BLOCKED_ROW_BYTES and COL_BLOCK (for tests: small rows can then
    take the blocked path); returns the previous pair."""
    global BLOCKED_ROW_BYTES, COL_BLOCK
    if row_bytes < 0 or col_block < 1:
        raise ValueError("row_bytes must be >= 0 and col_block >= 1")
    old = (BLOCKED_ROW_BYTES, COL_BLOCK)
    BLOCKED_ROW_BYTES, COL_BLOCK = row_bytes, col_block
    return old


cdef inline bint blocked_rows(Py_ssize_t D, Py_ssize_t storage_bytes,
                              Py_ssize_t real_bytes) noexcept nogil:
    """Whether direct backward rows of D elements (stored in storage_bytes,
    computed in real_bytes) are summed by column blocks (BLOCKED_ROW_BYTES)."""
    return D * (4 * storage_bytes + 3 * real_bytes) >= BLOCKED_ROW_BYTES


cdef void backward_blocks(const Rows* a, const real* w, const real* mean, const real* rstd,
                          Py_ssize_t r0, Py_ssize_t r1, double* dw, real* g, double* sums,
                          Scratch* sc, int t, int nt) noexcept nogil:
    """Rows r0..r1-1 of a chunk as backward_block does them, by column
    blocks: thread t of the nt that share the chunk (nt > 1: all the
    threads of the region, which all call this) takes blocks
    [t nb / nt, (t + 1) nb / nt) of every row.  One sweep of each block maps
    row r and sums row r + 1 into sums[3 ((r + 1) % 2 * nb + block)]; with
    nt > 1 a barrier after each row publishes them, and every thread adds
    up a row's blocks in block order.  g (float32 runs) and dw are shared:
    each thread adds into its own columns only.  The rare rows that
    backward_exact redoes are done whole by thread 0 between two barriers
    (every thread sees the same sums, so all take that branch), with thread
    0's scratch sc[0], whose float64 terms each thread folds into its own
    columns after the chunk's last row.  sc: the scratch of the nt
    threads."""
    cdef Py_ssize_t D = a.D, cbk = a.col_block, nb = (D + cbk - 1) // cbk
    cdef Py_ssize_t b0 = t * nb // nt, b1 = (t + 1) * nb // nt
    cdef Py_ssize_t c0 = b0 * cbk, c1 = min(b1 * cbk, D)
    cdef Py_ssize_t r, b, j, cb, n, slot
    cdef int st = a.x.storage
    cdef Py_ssize_t isz = sizeof(real) if st == NATIVE else 2      # bytes per stored value
    cdef int stream = (1 | LNF_STREAM_NOFENCE) if a.stream else 0
    cdef bint c = a.centered, nxt
    cdef double s[3]
    cdef real k[5]
    cdef const char* xr
    cdef const char* dyr
    cdef const char* dzr
    cdef char* dxr
    cdef const char* xn
    cdef const char* dyn
    cdef const char* xf
    cdef const char* dyf
    cdef real mn
    for j in range(c0, c1):     # (double: g is dw; float: runs set dw)
        g[j] = 0
        if c:
            g[D + j] = 0
        if real is float and r0 >= r1:      # (an empty chunk adds no run)
            dw[j] = 0
            if c:
                dw[D + j] = 0
    if r0 >= r1:
        return
    xn = <const char*>row_ptr(&a.x, r0)
    dyn = <const char*>row_ptr(&a.dy, r0)
    for b in range(b0, b1):
        cb = b * cbk
        row_grad_pipe(st, NULL, NULL, NULL, NULL, NULL, NULL, NULL, xn + cb * isz,
                      dyn + cb * isz, mean[r0] if c else 0, sums + 3 * b, w + cb,
                      min(cbk, D - cb))
    if nt > 1:
        lnf_omp_barrier()
    for r in range(r0, r1):
        slot = (r - r0) % 2 * nb
        s[0] = sums[3 * slot]
        s[1] = sums[3 * slot + 1]
        s[2] = sums[3 * slot + 2]
        for b in range(1, nb):
            s[0] += sums[3 * (slot + b)]
            s[1] += sums[3 * (slot + b) + 1]
            s[2] += sums[3 * (slot + b) + 2]
        nxt = r + 1 < r1
        xn = <const char*>row_or_null(&a.x, r + 1, r1)
        dyn = <const char*>row_or_null(&a.dy, r + 1, r1)
        mn = mean[r + 1] if c and nxt else 0
        slot = (r + 1 - r0) % 2 * nb
        if not row_grad_scalars(s, D, c, mean[r] if c else 0, rstd[r], k):
            if nt > 1:
                lnf_omp_barrier()   # (every thread is done with the last run)
            if t == 0:
                backward_exact(a, w, mean, rstd, r, g, sc)
            for b in range(b0, b1):
                cb = b * cbk
                if nxt:
                    row_grad_pipe(st, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                  xn + cb * isz, dyn + cb * isz, mn, sums + 3 * (slot + b),
                                  w + cb, min(cbk, D - cb))
        else:
            xr = <const char*>row_ptr(&a.x, r)
            dyr = <const char*>row_ptr(&a.dy, r)
            dzr = <const char*>row_or_null(&a.dz, r, r1, a.has_dz)
            dxr = row_ptr(&a.dx, r)
            for b in range(b0, b1):
                cb = b * cbk
                n = min(cbk, D - cb)
                xf = dyf = NULL     # (to prefetch: this thread's next block)
                if nxt and b + 1 < b1:
                    xf, dyf = xn + (cb + n) * isz, dyn + (cb + n) * isz
                elif r + 2 < r1:
                    xf = <const char*>row_ptr(&a.x, r + 2) + c0 * isz
                    dyf = <const char*>row_ptr(&a.dy, r + 2) + c0 * isz
                row_grad_pipe(st, xr + cb * isz, dyr + cb * isz,
                              dzr + cb * isz if dzr != NULL else NULL, dxr + cb * isz, k,
                              g + cb, g + D + cb if c else NULL,
                              xn + cb * isz if nxt else NULL, dyn + cb * isz if nxt else NULL,
                              mn, sums + 3 * (slot + b), w + cb, n, xf, dyf, stream)
            if stream:
                lnf_stream_fence()
        if nt > 1:
            lnf_omp_barrier()       # (the sums of row r + 1 are all in)
        end_of_run(a, g, dw, r - r0, r1 - r0, c0, c1)
    if real is float and not a.one_run:
        fold_grads(sc, dw, D, c0, c1, c)


cdef inline void backward_chunk(const Rows* a, const real* w, const real* mean,
                                const real* rstd, Py_ssize_t r0, Py_ssize_t r1,
                                double* dw, real* g, double* sums, Scratch* sc) noexcept nogil:
    """Rows r0..r1-1, their dweight/dbias terms summed into the float64
    partial rows dw[0:2D] (dw[0:D] for RMSNorm) in row order: directly when
    real is double (g is dw), else through the float32 runs g[0:2D], which
    are zero before and after (zeroed once per thread, zeroed by each run
    added), and then the float64 terms of its rare rows (fold_grads).
    sums: the thread's block sums (backward_blocks)."""
    cdef Py_ssize_t r
    if a.blocked:
        backward_blocks(a, w, mean, rstd, r0, r1, dw, g, sums, sc, 0, 1)
        return
    if real is double or r0 >= r1:      # (an empty chunk adds no run)
        memset(dw, 0, 2 * a.D * sizeof(double))
    if a.direct:
        backward_block(a, w, mean, rstd, r0, r1, dw, g, sc)
    else:
        for r in range(r0, r1):
            backward_row(a, w, mean, rstd, r, g, sc)
            end_of_run(a, g, dw, r - r0, r1 - r0)
    if real is float and not a.one_run:
        fold_grads(sc, dw, a.D, 0, a.D, a.centered)


cdef enum:
    SUM_BLOCK = 512     # columns of the partials one thread adds up at a time


cdef enum:
    # dweight/dbias output types: float64 as summed, or rounded once
    GRAD_F64, GRAD_F32, GRAD_F16, GRAD_BF16


cdef inline void sum_partials(double* part, Py_ssize_t nchunks, Py_ssize_t width,
                              Py_ssize_t j0, Py_ssize_t j1, void* out,
                              int kind) noexcept nogil:
    """out[j] = the sum of part[c, j] over chunks c = 0, 1, ... in that order
    (formed in part[0, j]), for j0 <= j < j1, rounded once to the output
    type `kind`: chunk-outer, so the inner loops are contiguous."""
    cdef Py_ssize_t c, j, n
    cdef float odd[SUM_BLOCK]
    for c in range(1, nchunks):
        for j in range(j0, j1):
            part[j] += part[c * width + j]
    if kind == GRAD_F64:
        memcpy(<double*>out + j0, part + j0, (j1 - j0) * sizeof(double))
    elif kind == GRAD_F32:
        for j in range(j0, j1):
            (<float*>out)[j] = <float>part[j]
    else:   # (through float32 rounded to odd: rounded once, as round_to_16bit)
        j = j0
        while j < j1:
            n = min(<Py_ssize_t>SUM_BLOCK, j1 - j)
            lnf_f64_to_f32_odd_row(part + j, odd, n)
            if kind == GRAD_F16:
                lnf_narrow_f16(odd, <char*>(<uint16_t*>out + j), 2, n)
            else:
                lnf_narrow_bf16(odd, <char*>(<uint16_t*>out + j), 2, n)
            j += n


cdef inline void round_run(const float* g, Py_ssize_t width, void* out,
                           int kind) noexcept nogil:
    """out = the float32 sums g of a call's only run, rounded once to the
    output type `kind`: the same bits as through the float64 partial rows,
    which hold g exactly (1x8192 float32 backward: 13.4 -> 7.2 us)."""
    cdef Py_ssize_t j
    if kind == GRAD_F64:
        for j in range(width):
            (<double*>out)[j] = g[j]
    elif kind == GRAD_F32:
        memcpy(out, g, width * sizeof(float))
    elif kind == GRAD_F16:
        lnf_narrow_f16(g, <char*>out, 2, width)
    else:
        lnf_narrow_bf16(g, <char*>out, 2, width)


cdef inline Py_ssize_t partial_stride(Py_ssize_t D) noexcept nogil:
    """Doubles from one chunk's partial rows (dweight, then dbias) to the
    next: whole 64-byte lines, so that every chunk starts on a line."""
    return (2 * D + 7) & ~7


cdef inline real* run_rows(real* runs, double* dw, int t, Py_ssize_t D) noexcept nogil:
    """Where thread t sums a run of a chunk's dweight/dbias terms
    (RUN_ROWS): float32 rows of its own, one partial stride (4 D floats)
    apart although they fill half of it: with the runs of two threads 8 KiB
    apart at D = 1024, 8192x1024 float32 backward took 17% longer (two
    threads, side by side), or the chunk's float64 partial rows dw
    themselves."""
    if real is double:
        return dw
    else:
        return runs + 2 * partial_stride(D) * t


cdef void backward_rows(const Rows* a, const real* w, const real* mean,
                        const real* rstd, Py_ssize_t nchunks, double* partials,
                        real* runs, double* sums, void* dwdb, int kind,
                        Scratch* sc) noexcept:
    """Rows are cut into `nchunks` fixed chunks (independent of the thread
    count); each chunk's dweight/dbias partial row is summed in row order and
    the partials are then added in chunk order: bitwise reproducible.
    Blocked rows (backward_blocks) on no more threads than a row has column
    blocks: all threads take every chunk in turn, each its share of the
    columns; otherwise each thread takes chunks of its own.  sums: 6 nb
    doubles of block sums per thread.  sc: each thread's scratch."""
    cdef Py_ssize_t c, k, M = a.M, D = a.D, stride = partial_stride(D)
    cdef Py_ssize_t width = 2 * D if a.centered else D     # (RMSNorm: no dbias)
    cdef Py_ssize_t nblocks = (width + SUM_BLOCK - 1) // SUM_BLOCK
    cdef Py_ssize_t nb = (D + a.col_block - 1) // a.col_block
    cdef const real* wt = w
    cdef real* g
    cdef int t
    if a.nthreads == 1:     # (no OpenMP region, as in forward_rows)
        with nogil:
            wt = param(&a.w, w, sc, 0, D)
            if real is float:
                memset(run_rows(runs, NULL, 0, D), 0, 2 * D * sizeof(float))
            for c in range(nchunks):
                backward_chunk(a, wt, mean, rstd, c * M // nchunks, (c + 1) * M // nchunks,
                               partials + stride * c,
                               run_rows(runs, partials + stride * c, 0, D), sums, sc)
    elif a.blocked and a.nthreads <= nb:
        with nogil, parallel(num_threads=a.nthreads):
            t = omp_get_thread_num()
            wt = param(&a.w, w, sc + t, 0, D)
            for c in range(nchunks):    # (every thread: the barriers are in there)
                backward_blocks(a, wt, mean, rstd, c * M // nchunks, (c + 1) * M // nchunks,
                                partials + stride * c,
                                run_rows(runs, partials + stride * c, 0, D), sums, sc,
                                t, omp_get_num_threads())
    else:
        with nogil, parallel(num_threads=a.nthreads):
            t = omp_get_thread_num()
            wt = param(&a.w, w, sc + t, 0, D)
            if real is float:
                memset(run_rows(runs, NULL, t, D), 0, 2 * D * sizeof(float))
            for c in prange(nchunks, schedule='static'):
                backward_chunk(a, wt, mean, rstd, c * M // nchunks, (c + 1) * M // nchunks,
                               partials + stride * c,
                               run_rows(runs, partials + stride * c, t, D),
                               sums + 6 * nb * t, sc + t)
    if real is float and a.one_run:     # (one thread: nchunks is 1)
        g = run_rows(runs, NULL, 0, D)
        with nogil:
            if sc.grads == NULL:
                round_run(g, width, dwdb, kind)
            else:       # (the run, then the float64 terms of the rare rows)
                for k in range(width):
                    sc.grads[k] = g[k] + sc.grads[k]
                sum_partials(sc.grads, 1, width, 0, width, dwdb, kind)
        return
    if partials == <double*>dwdb:       # (one float64 chunk, summed in place)
        return
    if a.nthreads == 1 or nblocks * nchunks <= 256:     # threads pay only when large
        with nogil:
            sum_partials(partials, nchunks, stride, 0, width, dwdb, kind)
        return
    for k in prange(nblocks, nogil=True, schedule='static', num_threads=a.nthreads):
        sum_partials(partials, nchunks, stride, k * SUM_BLOCK,
                     min((k + 1) * SUM_BLOCK, width), dwdb, kind)


# ---------------------------------------------------------------------------
# Python entry points.  Arguments are checked by the caller (lnfast._kernels).

cdef inline void* data_or_null(cnp.ndarray a):
    return cnp.PyArray_DATA(a) if a is not None else NULL


cdef int rows_init(Rows* a, cnp.ndarray x, double eps, bint centered,
                   int nthreads) except -1:
    a.D = cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1)
    a.wp = a.bp = a.D
    a.M = cnp.PyArray_SIZE(x) // a.D
    a.eps = eps
    a.centered = centered
    a.nthreads = nthreads
    a.has_res = a.has_dz = a.stream = a.one_run = a.blocked = False
    a.col_block = COL_BLOCK
    rowmap_init(&a.x, x)
    return 0


cdef enum:
    # float32 and float64 outputs whose rows are this long or longer (and of
    # STREAM_MIN_BYTES or more in all) are written with streaming stores,
    # which bypass the caches.  A long output row written through the cache
    # evicts from the L2 the rows the sweep still reads (the row it maps,
    # read a second time, and the weight); streamed, those stay.  Measured
    # side by side (performance.md): rows of 64 KiB or more 1.10-1.23x
    # faster backward, 0.94-1.22x forward (1.08-1.22x at D = 65536); rows
    # of 16-32 KiB mixed (0.87-1.12x), of 3-4 KiB 0.63-0.72x
    # (there the output stayed in the L3, streamed it goes to memory);
    # 16-bit outputs 0.90-1.07x even at 64-128 KiB rows.
    STREAM_ROW_BYTES = 1 << 16
    STREAM_MIN_BYTES = 1 << 23


cpdef bint streamed(Py_ssize_t D, Py_ssize_t itemsize, Py_ssize_t nbytes) noexcept:
    """Whether an output of rows of D elements of `itemsize` bytes, `nbytes`
    in all, is written with streaming stores (when its rows are direct)."""
    return itemsize >= 4 and D * itemsize >= STREAM_ROW_BYTES and nbytes >= STREAM_MIN_BYTES


cdef bint params_init(Rows* a, cnp.ndarray w, cnp.ndarray b) except -1:
    """Describe weight w and bias b (b None: none) in a.w and a.b, whose
    storage says which are 16-bit, to be widened by each thread (param);
    return whether the arithmetic is
    float64 (w is float64; 16-bit vectors come only with 16-bit data)."""
    rowmap_init(&a.w, w)
    a.b.storage = NATIVE            # (no bias: nothing to widen)
    if b is not None:
        rowmap_init(&a.b, b)
    return cnp.PyArray_TYPE(w) == cnp.NPY_FLOAT64


cdef cnp.ndarray row_scratch(Rows* a, bint f64, tuple arrays, int rows, Scratch* sc):
    """Set a.direct (every row contiguous in x's dtype: the pipelined path)
    and give each thread's Scratch sc[t], in the compute type (float64 when
    f64, else float32), `rows` rows for gathered rows, then PARAM_ROWS rows
    for 16-bit weight and bias, allocated now, each thread's part on a
    64-byte line; return that memory (None: none).  Direct rows get rows for
    their rare rows only when one needs them (Scratch)."""
    cdef cnp.ndarray x = arrays[0]
    a.direct = True
    for arr in arrays:
        if arr is not None and (
                cnp.PyArray_TYPE(arr) != cnp.PyArray_TYPE(x)
                or cnp.PyArray_STRIDES(arr)[cnp.PyArray_NDIM(arr) - 1] != cnp.PyArray_ITEMSIZE(x)):
            a.direct = False
    cdef int t
    if a.direct:
        rows = 0
    cdef Py_ssize_t size = 8 if f64 else 4
    cdef Py_ssize_t params = PARAM_ROWS if a.w.storage != NATIVE or a.b.storage != NATIVE else 0
    if rows + params == 0:
        return None
    cdef Py_ssize_t stride = ((rows + params) * a.D * size + 63) // 64 * 64
    cdef cnp.npy_intp n = stride * a.nthreads + 64
    cdef cnp.ndarray up_front = cnp.PyArray_EMPTY(1, &n, cnp.NPY_UINT8, 0)
    cdef char* base = <char*>aligned_data(up_front)
    for t in range(a.nthreads):
        if rows:
            sc[t].rows = base + t * stride
        sc[t].params = base + t * stride + rows * a.D * size
    return up_front


cdef inline void* aligned_data(cnp.ndarray a):
    """The data of `a` (None: NULL) from its first 64-byte line boundary."""
    if a is None:
        return NULL
    return <void*>((<uintptr_t>cnp.PyArray_DATA(a) + 63) & ~<uintptr_t>63)


def forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
            cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
            double eps, bint centered, int nthreads):
    """y = norm(x + residual) row by row, z = x + residual when residual is
    not None; mean and rstd stored when not None.  w and b (b unread when
    not centered) are contiguous vectors of the compute type, float64 or
    float32, or with 16-bit data 16-bit vectors of any stride, which each
    thread widens; 16-bit rows are computed in float32."""
    run_forward(x, residual, z, y, w, b, mean, rstd, eps, centered, nthreads)


cdef int run_forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
                     cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
                     double eps, bint centered, int nthreads) except -1:
    cdef Rows a
    rows_init(&a, x, eps, centered, nthreads)
    rowmap_init(&a.y, y)
    if residual is not None:
        a.has_res = True
        rowmap_init(&a.res, residual)
        rowmap_init(&a.z, z)
    if not centered:    # (RMSNorm has no bias: b stands for w, unread)
        b = w
    cdef bint f64 = params_init(&a, w, b if centered else None)
    a.wp = cnp.PyArray_DIM(w, 0)        # (D, or a stand-in's CONSTANT_MAX_D)
    a.bp = cnp.PyArray_DIM(b, 0)
    if not (a.wp == a.D or a.wp == CONSTANT_MAX_D < a.D) or not (
            a.bp == a.D or a.bp == CONSTANT_MAX_D < a.D):
        raise ValueError("weight and bias must have D elements")
    cdef Scratch one
    cdef Scratch* sc = scratches_new(a.nthreads, &one)
    try:
        up_front = row_scratch(&a, f64, (x, residual, z, y), FORWARD_SCRATCH, sc)
        a.stream = a.direct and streamed(a.D, cnp.PyArray_ITEMSIZE(y), cnp.PyArray_NBYTES(y))
        if not f64:
            forward_rows[float](&a, <float*>cnp.PyArray_DATA(w), <float*>cnp.PyArray_DATA(b),
                                <float*>data_or_null(mean), <float*>data_or_null(rstd),
                                sc)
        else:
            forward_rows[double](&a, <double*>cnp.PyArray_DATA(w), <double*>cnp.PyArray_DATA(b),
                                 <double*>data_or_null(mean), <double*>data_or_null(rstd),
                                 sc)
    finally:
        scratches_end(sc, a.nthreads, &one)
    return 0


def backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dz, cnp.ndarray mean,
             cnp.ndarray rstd, cnp.ndarray w, cnp.ndarray dx, cnp.ndarray dwdb,
             Py_ssize_t nchunks, bint centered, int nthreads):
    """dx (plus dz when not None) into `dx`, and [dweight, dbias] into the
    C-contiguous (2, D) array `dwdb`: summed in float64 (float32 terms in
    runs of RUN_ROWS rows first), then rounded once to dwdb's dtype
    (float64, float32, float16 or bfloat16).  mean is ignored
    when not centered.  w as in forward()."""
    run_backward(dy, x, dz, mean, rstd, w, dx, dwdb, nchunks, centered, nthreads)


cdef int run_backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dz, cnp.ndarray mean,
                      cnp.ndarray rstd, cnp.ndarray w, cnp.ndarray dx, cnp.ndarray dwdb,
                      Py_ssize_t nchunks, bint centered, int nthreads) except -1:
    cdef Rows a
    cdef cnp.npy_intp n
    rows_init(&a, x, 0.0, centered, nthreads)
    cdef int t = cnp.PyArray_TYPE(dwdb)
    cdef int kind = (GRAD_F64 if t == cnp.NPY_FLOAT64 else GRAD_F32 if t == cnp.NPY_FLOAT32
                     else GRAD_F16 if t == cnp.NPY_FLOAT16 else GRAD_BF16)
    if (cnp.PyArray_SIZE(dwdb) != 2 * a.D or not cnp.PyArray_IS_C_CONTIGUOUS(dwdb)
            or (kind == GRAD_BF16 and dwdb.dtype.name != "bfloat16")):
        raise TypeError("dwdb must be a C-contiguous (2, D) array of float64, "
                        "float32, float16 or bfloat16")
    if nchunks < 1 or nthreads < 1:
        raise ValueError("nchunks and nthreads must be at least 1")
    if a.M == 0:
        memset(cnp.PyArray_DATA(dwdb), 0, cnp.PyArray_NBYTES(dwdb))
        return 0
    rowmap_init(&a.dy, dy)
    rowmap_init(&a.dx, dx)
    if dz is not None:
        a.has_dz = True
        rowmap_init(&a.dz, dz)
    # The partial rows start on a 64-byte line: the sweep loads and stores
    # them 64 bytes at a time, and NumPy's buffers start 16 bytes into one,
    # where every such access touches two lines (float32 backward 2-12%
    # faster aligned at the shapes that sit in the L3).  One float64 chunk is
    # summed in dwdb itself when that is aligned, or when its few rows would
    # not win back a buffer of their own (1x768: 1.1 us in place, 1.3 with).
    # The float32 runs (RUN_ROWS) take one more partial stride per thread
    # (run_rows), also on lines.  A call of one run (RUN_ROWS rows or fewer
    # in one chunk) rounds it straight to dwdb and needs no partial rows.
    cdef double* part = <double*>cnp.PyArray_DATA(dwdb)
    cdef bint f32 = not params_init(&a, w, None)     # float32 arithmetic
    a.nthreads = min(nthreads, nchunks)
    cdef Py_ssize_t nsums, stride = partial_stride(a.D)
    cdef bint in_place
    cdef cnp.ndarray partials = None
    cdef double* base = NULL
    cdef double* sums
    cdef Scratch one
    cdef Scratch* sc = scratches_new(a.nthreads, &one)
    try:
        up_front = row_scratch(&a, not f32, (x, dy, dz, dx), BACKWARD_SCRATCH, sc)
        a.stream = a.direct and streamed(a.D, cnp.PyArray_ITEMSIZE(dx), cnp.PyArray_NBYTES(dx))
        a.blocked = a.direct and blocked_rows(a.D, cnp.PyArray_ITEMSIZE(x), 4 if f32 else 8)
        nsums = 6 * ((a.D + a.col_block - 1) // a.col_block) * a.nthreads if a.blocked else 0
        a.one_run = f32 and nchunks == 1 and a.M <= RUN_ROWS
        in_place = (nchunks == 1 and kind == GRAD_F64
                    and (<uintptr_t>part % 64 == 0 or a.M < 16))
        if a.one_run:
            part = NULL
        n = ((0 if in_place or a.one_run else stride * nchunks) + (stride * a.nthreads if f32 else 0)
             + nsums)
        if n:
            n += 8
            partials = cnp.PyArray_EMPTY(1, &n, cnp.NPY_FLOAT64, 0)
            base = <double*>aligned_data(partials)
        if not (in_place or a.one_run):
            part = base
            base += stride * nchunks
        sums = base + (stride * a.nthreads if f32 else 0)
        if not centered:    # (RMSNorm sums no dbias: backward_rows)
            memset(<char*>cnp.PyArray_DATA(dwdb) + cnp.PyArray_NBYTES(dwdb) // 2, 0,
                   cnp.PyArray_NBYTES(dwdb) // 2)
        if f32:
            backward_rows[float](&a, <float*>cnp.PyArray_DATA(w), <float*>data_or_null(mean),
                                 <float*>cnp.PyArray_DATA(rstd), nchunks, part, <float*>base,
                                 sums, cnp.PyArray_DATA(dwdb), kind, sc)
        else:
            backward_rows[double](&a, <double*>cnp.PyArray_DATA(w), <double*>data_or_null(mean),
                                  <double*>cnp.PyArray_DATA(rstd), nchunks, part, NULL,
                                  sums, cnp.PyArray_DATA(dwdb), kind, sc)
    finally:
        scratches_end(sc, a.nthreads, &one)
    return 0


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
    if nbytes < LNF_POOL_MIN:
        return cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    old = PyDataMem_SetHandler(_pool_handler)
    try:
        return cnp.PyArray_EMPTY(nd, dims, typenum, 0)
    finally:
        PyDataMem_SetHandler(old)


cdef dict _constants = {}       # (value, D, typenum) -> read-only vector
cdef enum:
    CONSTANT_MAX_D = 1 << 16    # longer stand-ins cost little next to the M x D work
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


def backward_common(threads_for, Py_ssize_t min_parallel, num_chunks, dy, x, mean,
                    rstd, weight, dz, bint centered):
    """lnfast._kernels.backward for the common call: dy and x (and dz) plain
    arrays of one dtype and shape, with at least one row; rstd (and mean,
    when centered) plain arrays of the compute dtype and shape x.shape[:-1];
    weight None or a plain vector of the compute dtype or x's.  Returns (dx,
    dweight, dbias) as backward does, or None when the call is not of this
    kind.  threads_for(n, min_parallel) and num_chunks(M, D): those of
    lnfast._threads and lnfast._kernels."""
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
    nchunks = num_chunks(M, D)
    dx = new_array(nd, dims, t, cnp.PyArray_NBYTES(xa))
    cdef cnp.npy_intp rows_of_grads[2]
    rows_of_grads[0], rows_of_grads[1] = 2, D
    dwdb = cnp.PyArray_EMPTY(2, rows_of_grads,             # in the weight's dtype
                             ct if weight is None else cnp.PyArray_TYPE(<cnp.ndarray>weight), 0)
    run_backward(dy, xa, dz, mean if centered else None, rstd, w, dx, dwdb, nchunks,
                 centered, min(<Py_ssize_t>threads_for(M * D, min_parallel), nchunks))
    return dx, dwdb[0], dwdb[1]


cdef void copy_rows(const char* src, char* dst, Py_ssize_t nbytes,
                    int nthreads) noexcept:
    cdef Py_ssize_t nblocks = (nbytes + (1 << 16) - 1) >> 16, k, lo
    for k in prange(nblocks, nogil=True, schedule='static', num_threads=nthreads,
                    use_threads_if=nthreads > 1):
        lo = k << 16
        memcpy(dst + lo, src + lo, min(nbytes - lo, 1 << 16))


def parallel_copy(cnp.ndarray src, cnp.ndarray dst, int nthreads):
    """dst[...] = src for C-contiguous arrays of equal size, on `nthreads`
    threads: the benchmark's measure of the machine's copy bandwidth."""
    if not (cnp.PyArray_IS_C_CONTIGUOUS(src) and cnp.PyArray_IS_C_CONTIGUOUS(dst)
            and cnp.PyArray_NBYTES(src) == cnp.PyArray_NBYTES(dst)):
        raise ValueError("src and dst must be C-contiguous and of equal size")
    copy_rows(<const char*>cnp.PyArray_DATA(src), <char*>cnp.PyArray_DATA(dst),
              cnp.PyArray_NBYTES(src), nthreads)
