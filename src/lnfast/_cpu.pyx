# cython: language_level=3
"""CPU kernels: LayerNorm forward and backward over the last axis.

One template (the fused type `real`) serves float32 and float64.  Rows are
spread over OpenMP threads with `prange`; all reductions run in float64 in a
fixed order, so results do not depend on the thread count.

Arrays arrive validated from `lnfast._layer_norm`: dtypes are final, weight and
bias are contiguous vectors of length D, mean/rstd/dx outputs are C-contiguous.
Rows of x, dy and out may have any (aligned) strides: a row whose elements are
not adjacent is gathered into a per-thread buffer first.
"""
from cython.parallel cimport parallel, prange
from libc.math cimport sqrt
from libc.string cimport memcpy

cimport numpy as cnp

from lnfast._openmp_helpers cimport LNFAST_OPENMP, omp_get_max_threads, omp_get_thread_num

cnp.import_array()

ctypedef fused real:
    float
    double

cdef enum:
    LANES = 8       # independent accumulators: vectorizable, fixed summation order
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
    #if defined(__AVX512F__)
    #define LNFAST_SIMD "AVX-512"
    #elif defined(__AVX2__)
    #define LNFAST_SIMD "AVX2"
    #elif defined(__AVX__)
    #define LNFAST_SIMD "AVX"
    #elif defined(__SSE2__) || defined(_M_X64)
    #define LNFAST_SIMD "SSE2"
    #elif defined(__ARM_NEON) || defined(_M_ARM64)
    #define LNFAST_SIMD "NEON"
    #else
    #define LNFAST_SIMD "none"
    #endif
    """
    const char* LNFAST_COMPILER
    const char* LNFAST_SIMD


def build_info():
    """Compiler, OpenMP and SIMD baseline this module was compiled with."""
    return {
        "compiler": LNFAST_COMPILER.decode(),
        "openmp": bool(LNFAST_OPENMP),
        "simd": LNFAST_SIMD.decode(),
    }


def omp_max_threads():
    """OpenMP's current default team size (1 without OpenMP)."""
    return omp_get_max_threads()


# ---------------------------------------------------------------------------
# Row addressing: row r of an array with any leading shape and strides.

cdef struct RowMap:
    char* base
    Py_ssize_t inner            # byte stride along the normalized axis
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


cdef inline const real* load_row(const RowMap* m, Py_ssize_t r, Py_ssize_t D,
                                 real* buf) noexcept nogil:
    """Row r as a contiguous pointer: the row itself, or a copy in `buf`."""
    cdef const char* p = row_ptr(m, r)
    cdef Py_ssize_t i
    if m.inner == sizeof(real):
        return <const real*>p
    for i in range(D):
        buf[i] = (<const real*>(p + i * m.inner))[0]
    return buf


cdef inline void store_row(const RowMap* m, Py_ssize_t r, Py_ssize_t D,
                           const real* src) noexcept nogil:
    """Copy a finished row from scratch to a strided destination row."""
    cdef char* p = row_ptr(m, r)
    cdef Py_ssize_t i
    for i in range(D):
        (<real*>(p + i * m.inner))[0] = src[i]


# ---------------------------------------------------------------------------
# Per-row math.  Sums use LANES float64 accumulators combined in a fixed
# pairwise order: the compiler can vectorize them without -ffast-math, and
# the result is the same on every CPU and for every thread count.

cdef inline double lane_sum(double* s) noexcept nogil:
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]))


cdef inline void row_stats(const real* x, Py_ssize_t D,
                           double* mean, double* var) noexcept nogil:
    """Mean and biased variance in one pass.

    Sums run in float64 over x - x[0]: shifting by a member of the row keeps
    the sums of the size of the row's spread rather than its offset, so the
    cancellation in S2/D - (S1/D)^2 costs at most ~D ulps of float64 (and
    typically one) -- not the textbook E[x^2] - E[x]^2 in working precision,
    which returns garbage for rows like [40000, 40001, 40002, 40003].
    """
    cdef double shift = x[0]
    cdef double s1[LANES]
    cdef double s2[LANES]
    cdef double d, m, v, t1, t2
    cdef Py_ssize_t i, j, n = D - D % LANES
    for j in range(LANES):
        s1[j] = 0.0
        s2[j] = 0.0
    for i in range(0, n, 8):     # 8 == LANES (Cython needs a literal step)
        for j in range(LANES):
            d = <double>x[i + j] - shift
            s1[j] += d
            s2[j] += d * d
    t1 = 0.0   # the tail has its own sums: indexing the lanes with a
    t2 = 0.0   # variable would keep them in memory, unvectorized
    for i in range(n, D):
        d = <double>x[i] - shift
        t1 += d
        t2 += d * d
    m = (lane_sum(s1) + t1) / D
    v = (lane_sum(s2) + t2) / D - m * m
    mean[0] = shift + m
    var[0] = 0.0 if v < 0.0 else v      # clamp rounding below zero; NaN stays


cdef inline void row_forward(const real* x, real* y, const real* w,
                             const real* b, Py_ssize_t D, double eps,
                             real* mean_out, real* rstd_out) noexcept nogil:
    """y = (x - mean) * rstd * w + b for one row, in the working precision;
    mean and rstd are stored through the pointers unless they are NULL.

    The float64 mean is split into hi + lo of type `real`: x - hi is exact
    for x near the mean, so float32 rows with a large common offset keep the
    digits that a float32 mean would round away.
    """
    cdef double mean, var, rstd
    row_stats(x, D, &mean, &var)
    rstd = 1.0 / sqrt(var + eps)
    cdef real hi = <real>mean
    cdef real lo = <real>(mean - <double>hi)
    cdef real rs = <real>rstd
    cdef Py_ssize_t i
    for i in range(D):
        y[i] = ((x[i] - hi) - lo) * rs * w[i] + b[i]
    if mean_out != NULL:
        mean_out[0] = <real>mean
        rstd_out[0] = rs


cdef inline void row_backward(const real* x, const real* dy, const real* w,
                              real* dx, double* dw, double* db, Py_ssize_t D,
                              real mean, real rstd) noexcept nogil:
    """dx of one row, and its dy * xhat and dy added into dw and db.

    The stored mean (rounded to `real`) serves as a shift; the residual
    c = mean(x - mean) is recovered in float64, so xhat = (x - mean - c) * rstd
    is as accurate as the forward pass even for large common offsets.
    """
    cdef double sd[LANES]
    cdef double sg[LANES]
    cdef double sgd[LANES]
    cdef real d, g, xh, cr, mg, mgx
    cdef double c, SG, td, tg, tgd
    cdef Py_ssize_t i, j, n = D - D % LANES
    for j in range(LANES):
        sd[j] = 0.0
        sg[j] = 0.0
        sgd[j] = 0.0
    for i in range(0, n, 8):     # 8 == LANES
        for j in range(LANES):
            d = x[i + j] - mean
            g = dy[i + j] * w[i + j]
            sd[j] += d
            sg[j] += g
            sgd[j] += <double>g * d
    td = 0.0   # tail sums kept apart, as in row_stats
    tg = 0.0
    tgd = 0.0
    for i in range(n, D):
        d = x[i] - mean
        g = dy[i] * w[i]
        td += d
        tg += g
        tgd += <double>g * d
    c = (lane_sum(sd) + td) / D
    SG = lane_sum(sg) + tg
    cr = <real>c
    mg = <real>(SG / D)                                       # mean(g)
    mgx = <real>(rstd * ((lane_sum(sgd) + tgd) - c * SG) / D)  # mean(g * xhat)
    for i in range(D):
        xh = ((x[i] - mean) - cr) * rstd
        dx[i] = rstd * ((dy[i] * w[i] - mg) - xh * mgx)
        dw[i] += <double>dy[i] * xh
        db[i] += dy[i]


# ---------------------------------------------------------------------------
# Drivers: loops over rows under OpenMP.

cdef void forward_rows(const RowMap* x, const RowMap* y, const real* w,
                       const real* b, real* mean_out, real* rstd_out,
                       Py_ssize_t M, Py_ssize_t D, double eps,
                       real* scratch, int nthreads) noexcept:
    cdef Py_ssize_t r
    cdef const real* xr
    cdef real* yr
    cdef real* buf = NULL
    with nogil, parallel(num_threads=nthreads, use_threads_if=nthreads > 1):
        buf = scratch + 2 * D * omp_get_thread_num() if scratch != NULL else NULL
        for r in prange(M, schedule='static'):
            xr = load_row(x, r, D, buf)
            yr = <real*>row_ptr(y, r) if y.inner == sizeof(real) else buf + D
            row_forward(xr, yr, w, b, D, eps,
                        mean_out + r if mean_out != NULL else NULL,
                        rstd_out + r if mean_out != NULL else NULL)
            if y.inner != sizeof(real):
                store_row(y, r, D, yr)


cdef inline void backward_chunk(const RowMap* x, const RowMap* dy, const RowMap* dx,
                                const real* w, const real* mean, const real* rstd,
                                Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t D,
                                double* dw, real* buf) noexcept nogil:
    """Rows r0..r1-1 in order, their dweight/dbias summed into dw[0:D], dw[D:2D]."""
    cdef Py_ssize_t r
    cdef const real* xr
    cdef const real* dyr
    cdef real* dxr
    for r in range(r0, r1):
        xr = load_row(x, r, D, buf)
        dyr = load_row(dy, r, D, buf + D)
        dxr = <real*>row_ptr(dx, r) if dx.inner == sizeof(real) else buf + 2 * D
        row_backward(xr, dyr, w, dxr, dw, dw + D, D, mean[r], rstd[r])
        if dx.inner != sizeof(real):
            store_row(dx, r, D, dxr)


cdef inline void sum_partials(const double* part, Py_ssize_t nchunks,
                              Py_ssize_t width, Py_ssize_t j,
                              double* out) noexcept nogil:
    """out[j] = sum of part[c, j] over chunks c = 0, 1, ... in that order."""
    cdef double s = 0.0
    cdef Py_ssize_t c
    for c in range(nchunks):
        s += part[c * width + j]
    out[j] = s


cdef void backward_rows(const RowMap* x, const RowMap* dy, const RowMap* dx,
                        const real* w, const real* mean, const real* rstd,
                        Py_ssize_t M, Py_ssize_t D, Py_ssize_t nchunks,
                        double* partials, double* dwdb, real* scratch,
                        int nthreads) noexcept:
    """Rows are cut into `nchunks` fixed chunks (independent of the thread
    count); each chunk's dweight/dbias partial row is summed in row order and
    the partials are then added in chunk order: bitwise reproducible."""
    cdef Py_ssize_t c, j
    cdef real* buf = NULL
    with nogil, parallel(num_threads=nthreads, use_threads_if=nthreads > 1):
        buf = scratch + 3 * D * omp_get_thread_num() if scratch != NULL else NULL
        for c in prange(nchunks, schedule='static'):
            backward_chunk(x, dy, dx, w, mean, rstd, c * M // nchunks,
                           (c + 1) * M // nchunks, D, partials + 2 * D * c, buf)
    for j in prange(2 * D, nogil=True, schedule='static', num_threads=nthreads,
                    use_threads_if=nthreads > 1):
        sum_partials(partials, nchunks, 2 * D, j, dwdb)


# ---------------------------------------------------------------------------
# Python entry points.  Arguments are checked by the caller.

cdef inline bint is_f32(cnp.ndarray a):
    return cnp.PyArray_TYPE(a) == cnp.NPY_FLOAT32


cdef cnp.ndarray row_scratch(RowMap* maps, int nmaps, Py_ssize_t per_thread,
                             int nthreads, cnp.ndarray like):
    """Per-thread row buffers, only when some row is not contiguous."""
    cdef int k
    cdef cnp.npy_intp n = per_thread * nthreads
    for k in range(nmaps):
        if maps[k].inner != cnp.PyArray_ITEMSIZE(like):
            return cnp.PyArray_EMPTY(1, &n, cnp.PyArray_TYPE(like), 0)
    return None


cdef inline void* data_or_null(cnp.ndarray a):
    return cnp.PyArray_DATA(a) if a is not None else NULL


def layer_norm_forward(cnp.ndarray x, cnp.ndarray y, cnp.ndarray w,
                       cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
                       double eps, int nthreads):
    """Normalize the rows of x into y; store mean and rstd when not None."""
    cdef RowMap maps[2]
    cdef Py_ssize_t D = cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1)
    cdef Py_ssize_t M = cnp.PyArray_SIZE(x) // D
    rowmap_init(&maps[0], x)
    rowmap_init(&maps[1], y)
    scratch = row_scratch(maps, 2, 2 * D, nthreads, x)
    if is_f32(x):
        forward_rows[float](&maps[0], &maps[1], <float*>cnp.PyArray_DATA(w),
                            <float*>cnp.PyArray_DATA(b), <float*>data_or_null(mean),
                            <float*>data_or_null(rstd), M, D, eps,
                            <float*>data_or_null(scratch), nthreads)
    else:
        forward_rows[double](&maps[0], &maps[1], <double*>cnp.PyArray_DATA(w),
                             <double*>cnp.PyArray_DATA(b), <double*>data_or_null(mean),
                             <double*>data_or_null(rstd), M, D, eps,
                             <double*>data_or_null(scratch), nthreads)


def layer_norm_backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray mean,
                        cnp.ndarray rstd, cnp.ndarray w, cnp.ndarray dx,
                        Py_ssize_t nchunks, int nthreads):
    """dx into `dx`; returns float64 array [dweight, dbias] of shape (2, D)."""
    cdef RowMap maps[3]
    cdef Py_ssize_t D = cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1)
    cdef Py_ssize_t M = cnp.PyArray_SIZE(x) // D
    cdef cnp.npy_intp shape[2]
    shape[0] = 2
    shape[1] = D
    cdef cnp.ndarray dwdb = cnp.PyArray_ZEROS(2, shape, cnp.NPY_FLOAT64, 0)
    cdef cnp.ndarray partials
    if M == 0:
        return dwdb
    rowmap_init(&maps[0], x)
    rowmap_init(&maps[1], dy)
    rowmap_init(&maps[2], dx)
    shape[0] = 2 * D * nchunks
    partials = cnp.PyArray_ZEROS(1, shape, cnp.NPY_FLOAT64, 0)
    scratch = row_scratch(maps, 3, 3 * D, nthreads, x)
    if is_f32(x):
        backward_rows[float](&maps[0], &maps[1], &maps[2], <float*>cnp.PyArray_DATA(w),
                             <float*>cnp.PyArray_DATA(mean), <float*>cnp.PyArray_DATA(rstd),
                             M, D, nchunks, <double*>cnp.PyArray_DATA(partials),
                             <double*>cnp.PyArray_DATA(dwdb),
                             <float*>data_or_null(scratch), nthreads)
    else:
        backward_rows[double](&maps[0], &maps[1], &maps[2], <double*>cnp.PyArray_DATA(w),
                              <double*>cnp.PyArray_DATA(mean), <double*>cnp.PyArray_DATA(rstd),
                              M, D, nchunks, <double*>cnp.PyArray_DATA(partials),
                              <double*>cnp.PyArray_DATA(dwdb),
                              <double*>data_or_null(scratch), nthreads)
    return dwdb


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
