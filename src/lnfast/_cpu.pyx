# cython: language_level=3
"""CPU kernels: LayerNorm and RMSNorm, forward and backward, over the last axis.

One template (the fused type `real`) serves float32 and float64.  Rows are
spread over OpenMP threads with `prange`; all reductions run in float64 in a
fixed order, so results do not depend on the thread count.  The innermost
loops are the C row primitives of rowops.h.

Arrays arrive validated from `lnfast._layer_norm`: dtypes are final, weight and
bias are contiguous vectors of length D, mean/rstd/dx outputs are C-contiguous.
Rows of x, dy and out may have any (aligned) strides: a row whose elements are
not adjacent is gathered into a per-thread buffer first.
"""
from cython.parallel cimport parallel, prange
from libc.math cimport sqrt
from libc.string cimport memcpy, memset

cimport numpy as cnp
import numpy as np

from lnfast._openmp_helpers cimport LNFAST_OPENMP, omp_get_max_threads, omp_get_thread_num

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


def half_paths(bint portable):
    """Make float16 rows use the portable conversion code (True) or the
    F16C instructions where the CPU has them (False); returns whether F16C
    is available.  For tests."""
    global lnf_force_portable
    lnf_force_portable = portable
    return bool(lnf_has_f16c())


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
    int lnf_force_portable
    int lnf_has_f16c()
    void lnf_row_pipe_f32(const float* x, float* y, const float* w, const float* b,
                          float hi, float lo, float rs, const float* xn, const float* rn,
                          float* zn, float shift, double* s1, double* s2, Py_ssize_t n)
    void lnf_row_pipe_f64(const double* x, double* y, const double* w, const double* b,
                          double hi, double lo, double rs, const double* xn,
                          const double* rn, double* zn, double shift, double* s1,
                          double* s2, Py_ssize_t n)
    void lnf_row_grad_pipe_f32(const float* x, const float* dy, const float* dz, float* dx,
                               const float* k, double* dw, double* db, const float* xn,
                               const float* dyn, float mean_n, double* out, const float* w,
                               Py_ssize_t n)
    void lnf_row_grad_pipe_f64(const double* x, const double* dy, const double* dz, double* dx,
                               const double* k, double* dw, double* db, const double* xn,
                               const double* dyn, double mean_n, double* out,
                               const double* w, Py_ssize_t n)


cdef enum:     # per-thread scratch, in rows of D elements
    FORWARD_SCRATCH = 4                     # rows: x, residual, z, y
    BACKWARD_SCRATCH = 4                    # rows: x, dy, dx, dz


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

cdef inline void row_pipe(const real* x, real* y, const real* w, const real* b,
                          real hi, real lo, real rs, const real* xn, const real* rn,
                          real* zn, double* s, Py_ssize_t D, bint centered) noexcept nogil:
    """rowops.h lnf_row_pipe: the map of row x into y (x NULL: none) and the
    sums s[0], s[1] of the next row xn (+ rn, stored to zn), shifted by its
    first element when centered (xn NULL: none)."""
    cdef real shift = 0
    if xn != NULL and centered:
        shift = xn[0] + rn[0] if rn != NULL else xn[0]
    if real is float:
        lnf_row_pipe_f32(x, y, w, b, hi, lo, rs, xn, rn, zn, shift, s, s + 1, D)
    else:
        lnf_row_pipe_f64(x, y, w, b, hi, lo, rs, xn, rn, zn, shift, s, s + 1, D)


cdef inline bint row_stats(real x0, const double* s, Py_ssize_t D, double eps,
                           bint centered, real* k) noexcept nogil:
    """k = {hi, lo, rstd} of a row from its sums over x - x0 (RMSNorm: over x,
    x0 ignored); False for the rare float32 rows that row_exact must redo.

    LayerNorm sums run over x - x[0]: shifting by a member of the row keeps
    the sums of the size of the row's spread rather than its offset (and the
    differences of nearby values exact), so the cancellation in
    S2/D - (S1/D)^2 costs at most ~D ulps of float64 (typically one) -- not
    the textbook E[x^2] - E[x]^2 in working precision, which returns garbage
    for rows like [40000, 40001, 40002, 40003].  The float64 mean is then
    applied as hi + lo of type `real`: x - hi is exact for x near the mean,
    so float32 rows with a large common offset keep the digits that a
    float32 mean would round away.  RMSNorm sums x^2 without a shift.
    """
    cdef double mean = s[0] / D if centered else 0.0
    cdef double var = s[1] / D - mean * mean
    var = 0.0 if var < 0.0 else var      # clamp rounding below zero; NaN stays
    cdef double rstd = 1.0 / sqrt(var + eps)
    if real is float:
        # float32 squares: a row whose variance is below 1e-30 (other than
        # exactly constant) may have lost squares to underflow, and one near
        # float32's top may have overflowed; such rows, and rows whose
        # deviations or rstd leave float32's range, are done in float64.
        if not ((var >= 1e-30 or (s[0] == 0.0 and s[1] == 0.0)) and D * var < 1e72
                and 1e-30 < rstd < 1e30):
            return False
    if centered:
        mean += x0
    k[0] = <real>mean
    k[1] = <real>(mean - <double>k[0])
    k[2] = <real>rstd
    return True


cdef inline void row_exact(const real* x, real* y, const real* w, const real* b,
                           Py_ssize_t D, double eps, bint centered,
                           real* k) noexcept nogil:
    """A row with every term in float64, sums included: for float32 rows
    past row_stats' limits.  k = {mean, 0, rstd} as stored."""
    cdef double shift = x[0] if centered else 0.0
    cdef double s1 = 0.0, s2 = 0.0, d, mean, var, rstd
    cdef Py_ssize_t i
    for i in range(D):
        d = <double>x[i] - shift
        s1 += d
        s2 += d * d
    mean = s1 / D if centered else 0.0
    var = s2 / D - mean * mean
    var = 0.0 if var < 0.0 else var
    mean += shift
    rstd = 1.0 / sqrt(var + eps)
    for i in range(D):
        y[i] = <real>((<double>x[i] - mean) * rstd * w[i] + (b[i] if centered else 0.0))
    k[0] = <real>mean
    k[1] = 0
    k[2] = <real>rstd


cdef inline void row_finish(const real* x, real* y, const real* w, const real* b,
                            const double* s, Py_ssize_t D, double eps, bint centered,
                            const real* xn, const real* rn, real* zn, double* sn,
                            real* mean_out, real* rstd_out) noexcept nogil:
    """Normalize row x (its sums s) into y while the next row's sums are
    taken (xn, rn, zn, sn as in row_pipe; xn NULL: no next row); store its
    mean and rstd where the pointers are not NULL."""
    cdef real k[3]
    if row_stats(x[0], s, D, eps, centered, k):
        row_pipe(x, y, w, b if centered else NULL, k[0], k[1], k[2], xn, rn, zn, sn, D,
                 centered)
    else:
        row_exact(x, y, w, b, D, eps, centered, k)
        if xn != NULL:
            row_pipe(NULL, NULL, w, b, 0, 0, 0, xn, rn, zn, sn, D, centered)
    if mean_out != NULL:
        mean_out[0] = k[0]
    if rstd_out != NULL:
        rstd_out[0] = k[2]


cdef inline void row_grad_pipe(const real* x, const real* dy, const real* dz, real* dx,
                               const real* k, double* dw, double* db, const real* xn,
                               const real* dyn, real mean_n, double* s, const real* w,
                               Py_ssize_t D) noexcept nogil:
    """rowops.h lnf_row_grad_pipe: the map of row x (x NULL: none) and the
    sums s[0..2] of the next row xn (xn NULL: none)."""
    if real is float:
        lnf_row_grad_pipe_f32(x, dy, dz, dx, k, dw, db, xn, dyn, mean_n, s, w, D)
    else:
        lnf_row_grad_pipe_f64(x, dy, dz, dx, k, dw, db, xn, dyn, mean_n, s, w, D)


cdef inline void row_grad_scalars(const real* x, const real* dy, const real* w,
                                  Py_ssize_t D, bint centered, real mean, real rstd,
                                  double* s, real* k) noexcept nogil:
    """The per-row scalars of the backward map from the row's sums s =
    {sum(x - mean), sum(g), sum(g * (x - mean))}, g = dy * w:
    k = {mean, c, rstd, mean(g), mean(g * xhat)}.

    LayerNorm: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
    RMSNorm (centered=False, mean = 0): dx = rstd * (g - xhat * mean(g * xhat)).
    The stored mean (rounded to `real`) serves as a shift; the residual
    c = mean(x - mean) is recovered in float64, so xhat = (x - mean - c) * rstd
    is as accurate as the forward pass even for large common offsets.
    """
    cdef double d, g
    cdef Py_ssize_t i
    if real is float:
        # Terms past float32's range (the sums come out infinite or NaN):
        # redo the sums with float64 terms.
        if not (-1e300 < s[0] + s[1] + s[2] < 1e300):
            s[0] = s[1] = s[2] = 0.0
            for i in range(D):
                d = <double>x[i] - mean
                g = <double>dy[i] * w[i]
                s[0] += d
                s[1] += g
                s[2] += g * d
    cdef double c = s[0] / D if centered else 0.0
    k[0] = mean
    k[1] = <real>c
    k[2] = rstd
    k[3] = <real>(s[1] / D) if centered else 0                 # mean(g)
    k[4] = <real>(rstd * (s[2] - c * s[1]) / D)               # mean(g * xhat)


# ---------------------------------------------------------------------------
# Drivers: one loop over rows for every variant.  The variants differ only in
# the per-row arguments (centered or not; a residual added first; an incoming
# gradient dz added last), never in how rows are split, threaded or reduced.

cdef struct Rows:
    RowMap x, res, z, y         # forward: y = norm(x [+ res]), z = x + res
    RowMap dy, dz, dx           # backward: dx = dnorm(dy, x) [+ dz]
    bint has_res, has_dz, centered
    Py_ssize_t M, D
    double eps
    int nthreads


cdef inline real* out_row(const RowMap* m, Py_ssize_t r, real* buf) noexcept nogil:
    """Where to compute output row r: in place, or in `buf` for store_row."""
    return <real*>row_ptr(m, r) if m.inner == sizeof(real) and m.storage == NATIVE else buf


cdef void forward_block(const Rows* a, const real* w, const real* b, real* mean_out,
                        real* rstd_out, Py_ssize_t r0, Py_ssize_t r1) noexcept nogil:
    """Rows r0..r1-1 of arrays whose rows are all contiguous rows of the
    compute type (no scratch needed), software-pipelined:
    one sweep normalizes row r and sums row r + 1 (and forms z = x + residual
    of row r + 1), so reading the next row overlaps writing this one."""
    cdef Py_ssize_t r, D = a.D
    cdef double s[2]
    cdef double sn[2]
    cdef const real* xr
    cdef const real* xn
    cdef const real* rn = NULL
    cdef real* zn = NULL
    if a.has_res:
        rn = <const real*>row_ptr(&a.res, r0)
        zn = <real*>row_ptr(&a.z, r0)
    row_pipe(NULL, NULL, w, b, 0, 0, 0, <const real*>row_ptr(&a.x, r0), rn, zn, s, D,
             a.centered)
    for r in range(r0, r1):
        xr = <const real*>row_ptr(&a.z if a.has_res else &a.x, r)
        xn = NULL
        if r + 1 < r1:
            xn = <const real*>row_ptr(&a.x, r + 1)
            if a.has_res:
                rn = <const real*>row_ptr(&a.res, r + 1)
                zn = <real*>row_ptr(&a.z, r + 1)
        row_finish(xr, <real*>row_ptr(&a.y, r), w, b, s, D, a.eps, a.centered,
                   xn, rn, zn, sn, mean_out + r if mean_out != NULL else NULL,
                   rstd_out + r if rstd_out != NULL else NULL)
        s[0] = sn[0]
        s[1] = sn[1]


cdef void forward_row(const Rows* a, const real* w, const real* b, real* mean_out,
                      real* rstd_out, Py_ssize_t r, real* buf) noexcept nogil:
    """Row r of arrays with some rows strided or 16-bit: such rows
    are gathered into `buf` (4 rows) and stored back.  The same arithmetic
    as forward_block, one pass after another."""
    cdef Py_ssize_t D = a.D
    cdef double s[2]
    cdef const real* xr = load_row(&a.x, r, D, buf)
    cdef real* zr
    cdef real* yr
    if a.has_res:       # z = x + residual, then normalize z from cache
        zr = out_row(&a.z, r, buf + 2 * D)
        row_pipe(NULL, NULL, w, b, 0, 0, 0, xr, load_row(&a.res, r, D, buf + D), zr, s, D,
                 a.centered)
        xr = zr
        if zr == buf + 2 * D:                   # computed in scratch
            store_row(&a.z, r, D, zr)
            if a.z.storage != NATIVE:           # normalize the z that is returned
                xr = load_row(&a.z, r, D, zr)
                row_pipe(NULL, NULL, w, b, 0, 0, 0, xr, NULL, NULL, s, D, a.centered)
    else:
        row_pipe(NULL, NULL, w, b, 0, 0, 0, xr, NULL, NULL, s, D, a.centered)
    yr = out_row(&a.y, r, buf + 3 * D)
    row_finish(xr, yr, w, b, s, D, a.eps, a.centered, NULL, NULL, NULL, NULL,
               mean_out + r if mean_out != NULL else NULL,
               rstd_out + r if rstd_out != NULL else NULL)
    if yr == buf + 3 * D:
        store_row(&a.y, r, D, yr)


cdef void forward_rows(const Rows* a, const real* w, const real* b,
                       real* mean_out, real* rstd_out, real* scratch) noexcept:
    """Each thread takes one contiguous block of rows (rows are independent:
    the split does not change any result)."""
    cdef Py_ssize_t r, t, M = a.M, nt = a.nthreads
    cdef real* buf
    if scratch == NULL:                 # every row direct
        for t in prange(nt, nogil=True, schedule='static', num_threads=nt,
                        use_threads_if=nt > 1):
            if t * M // nt < (t + 1) * M // nt:
                forward_block(a, w, b, mean_out, rstd_out, t * M // nt, (t + 1) * M // nt)
        return
    with nogil, parallel(num_threads=nt, use_threads_if=nt > 1):
        buf = scratch + FORWARD_SCRATCH * a.D * omp_get_thread_num()
        for r in prange(M, schedule='static'):
            forward_row(a, w, b, mean_out, rstd_out, r, buf)


cdef inline void backward_block(const Rows* a, const real* w, const real* mean,
                                const real* rstd, Py_ssize_t r0, Py_ssize_t r1,
                                double* dw) noexcept nogil:
    """Rows r0..r1-1 of arrays whose rows are all contiguous rows of the
    compute type, in order, software-pipelined as forward_block: one sweep
    maps row r (dx, and its terms into dw[0:D], dw[D:2D]) and sums row r + 1."""
    cdef Py_ssize_t r, D = a.D
    cdef double s[3]
    cdef real k[5]
    cdef const real* xr
    cdef const real* dyr
    cdef const real* xn
    cdef const real* dyn
    cdef real mn = 0
    row_grad_pipe(NULL, NULL, NULL, NULL, NULL, NULL, NULL, <const real*>row_ptr(&a.x, r0),
                  <const real*>row_ptr(&a.dy, r0), mean[r0] if a.centered else 0, s, w, D)
    for r in range(r0, r1):
        xr = <const real*>row_ptr(&a.x, r)
        dyr = <const real*>row_ptr(&a.dy, r)
        row_grad_scalars(xr, dyr, w, D, a.centered, mean[r] if a.centered else 0,
                         rstd[r], s, k)
        xn = dyn = NULL
        if r + 1 < r1:
            xn = <const real*>row_ptr(&a.x, r + 1)
            dyn = <const real*>row_ptr(&a.dy, r + 1)
            mn = mean[r + 1] if a.centered else 0
        row_grad_pipe(xr, dyr, <const real*>row_ptr(&a.dz, r) if a.has_dz else NULL,
                      <real*>row_ptr(&a.dx, r), k, dw, dw + D if a.centered else NULL,
                      xn, dyn, mn, s, w, D)


cdef inline void backward_row(const Rows* a, const real* w, const real* mean,
                              const real* rstd, Py_ssize_t r, double* dw,
                              real* buf) noexcept nogil:
    """Row r of arrays with some rows strided or 16-bit, gathered into `buf`
    (4 rows: x, dy, dx, dz) and stored back: the arithmetic of
    backward_block, one pass after another."""
    cdef Py_ssize_t D = a.D
    cdef double s[3]
    cdef real k[5]
    cdef real m = mean[r] if a.centered else 0
    cdef const real* xr = load_row(&a.x, r, D, buf)
    cdef const real* dyr = load_row(&a.dy, r, D, buf + D)
    cdef real* dxr = out_row(&a.dx, r, buf + 2 * D)
    row_grad_pipe(NULL, NULL, NULL, NULL, NULL, NULL, NULL, xr, dyr, m, s, w, D)
    row_grad_scalars(xr, dyr, w, D, a.centered, m, rstd[r], s, k)
    row_grad_pipe(xr, dyr, load_row(&a.dz, r, D, buf + 3 * D) if a.has_dz else NULL,
                  dxr, k, dw, dw + D if a.centered else NULL, NULL, NULL, 0, s, w, D)
    if dxr == buf + 2 * D:
        store_row(&a.dx, r, D, dxr)


cdef enum:
    SUM_BLOCK = 512     # columns of the partials one thread adds up at a time


cdef inline void sum_partials(const double* part, Py_ssize_t nchunks,
                              Py_ssize_t width, Py_ssize_t j0, Py_ssize_t j1,
                              double* out) noexcept nogil:
    """out[j] = sum of part[c, j] over chunks c = 0, 1, ... in that order,
    for j0 <= j < j1 (chunk-outer, so the inner loop is contiguous)."""
    cdef Py_ssize_t c, j
    for j in range(j0, j1):
        out[j] = part[j]
    for c in range(1, nchunks):
        for j in range(j0, j1):
            out[j] += part[c * width + j]


cdef void backward_rows(const Rows* a, const real* w, const real* mean,
                        const real* rstd, Py_ssize_t nchunks, double* partials,
                        double* dwdb, real* scratch) noexcept:
    """Rows are cut into `nchunks` fixed chunks (independent of the thread
    count); each chunk's dweight/dbias partial row is summed in row order and
    the partials are then added in chunk order: bitwise reproducible."""
    cdef Py_ssize_t c, k, r, M = a.M, D = a.D
    cdef Py_ssize_t nblocks = (2 * D + SUM_BLOCK - 1) // SUM_BLOCK
    cdef real* buf = NULL
    with nogil, parallel(num_threads=a.nthreads, use_threads_if=a.nthreads > 1):
        buf = scratch + BACKWARD_SCRATCH * D * omp_get_thread_num() if scratch != NULL else NULL
        for c in prange(nchunks, schedule='static'):
            memset(partials + 2 * D * c, 0, 2 * D * sizeof(double))
            if buf == NULL:
                backward_block(a, w, mean, rstd, c * M // nchunks, (c + 1) * M // nchunks,
                               partials + 2 * D * c)
            else:
                for r in range(c * M // nchunks, (c + 1) * M // nchunks):
                    backward_row(a, w, mean, rstd, r, partials + 2 * D * c, buf)
    # Worth threads only when the partials are large.
    for k in prange(nblocks, nogil=True, schedule='static', num_threads=a.nthreads,
                    use_threads_if=a.nthreads > 1 and nblocks * nchunks > 256):
        sum_partials(partials, nchunks, 2 * D, k * SUM_BLOCK,
                     min((k + 1) * SUM_BLOCK, 2 * D), dwdb)


# ---------------------------------------------------------------------------
# Python entry points.  Arguments are checked by the caller (lnfast._kernels).

cdef inline void* data_or_null(cnp.ndarray a):
    return cnp.PyArray_DATA(a) if a is not None else NULL


cdef int rows_init(Rows* a, cnp.ndarray x, double eps, bint centered,
                   int nthreads) except -1:
    a.D = cnp.PyArray_DIM(x, cnp.PyArray_NDIM(x) - 1)
    a.M = cnp.PyArray_SIZE(x) // a.D
    a.eps = eps
    a.centered = centered
    a.nthreads = nthreads
    a.has_res = a.has_dz = False
    rowmap_init(&a.x, x)
    return 0


cdef cnp.ndarray row_scratch(const Rows* a, cnp.ndarray w, tuple arrays, int rows):
    """`rows` rows of per-thread scratch in the compute type (w's), only when
    some row is not a contiguous row of that type."""
    cdef cnp.npy_intp n = rows * a.D * a.nthreads
    for arr in arrays:
        if arr is not None and (
                cnp.PyArray_TYPE(arr) != cnp.PyArray_TYPE(w)
                or cnp.PyArray_STRIDES(arr)[cnp.PyArray_NDIM(arr) - 1] != cnp.PyArray_ITEMSIZE(w)):
            return cnp.PyArray_EMPTY(1, &n, cnp.PyArray_TYPE(w), 0)
    return None


def forward(cnp.ndarray x, cnp.ndarray residual, cnp.ndarray z, cnp.ndarray y,
            cnp.ndarray w, cnp.ndarray b, cnp.ndarray mean, cnp.ndarray rstd,
            double eps, bint centered, int nthreads):
    """y = norm(x + residual) row by row, z = x + residual when residual is
    not None; mean and rstd stored when not None.  The compute type is w's
    (float32 or float64); 16-bit rows are computed in float32."""
    cdef Rows a
    rows_init(&a, x, eps, centered, nthreads)
    rowmap_init(&a.y, y)
    if residual is not None:
        a.has_res = True
        rowmap_init(&a.res, residual)
        rowmap_init(&a.z, z)
    scratch = row_scratch(&a, w, (x, residual, z, y), FORWARD_SCRATCH)
    if cnp.PyArray_TYPE(w) == cnp.NPY_FLOAT32:
        forward_rows[float](&a, <float*>cnp.PyArray_DATA(w), <float*>cnp.PyArray_DATA(b),
                            <float*>data_or_null(mean), <float*>data_or_null(rstd),
                            <float*>data_or_null(scratch))
    else:
        forward_rows[double](&a, <double*>cnp.PyArray_DATA(w), <double*>cnp.PyArray_DATA(b),
                             <double*>data_or_null(mean), <double*>data_or_null(rstd),
                             <double*>data_or_null(scratch))


def backward(cnp.ndarray dy, cnp.ndarray x, cnp.ndarray dz, cnp.ndarray mean,
             cnp.ndarray rstd, cnp.ndarray w, cnp.ndarray dx, Py_ssize_t nchunks,
             bint centered, int nthreads):
    """dx (plus dz when not None) into `dx`; returns the float64 array
    [dweight, dbias] of shape (2, D).  mean is ignored when not centered.
    The compute type is w's, as in forward()."""
    cdef Rows a
    cdef cnp.npy_intp shape[2]
    rows_init(&a, x, 0.0, centered, nthreads)
    shape[0] = 2
    shape[1] = a.D
    cdef cnp.ndarray dwdb = cnp.PyArray_ZEROS(2, shape, cnp.NPY_FLOAT64, 0)
    if a.M == 0:
        return dwdb
    rowmap_init(&a.dy, dy)
    rowmap_init(&a.dx, dx)
    if dz is not None:
        a.has_dz = True
        rowmap_init(&a.dz, dz)
    shape[0] = 2 * a.D * nchunks
    cdef cnp.ndarray partials = cnp.PyArray_EMPTY(1, shape, cnp.NPY_FLOAT64, 0)
    scratch = row_scratch(&a, w, (x, dy, dz, dx), BACKWARD_SCRATCH)
    if cnp.PyArray_TYPE(w) == cnp.NPY_FLOAT32:
        backward_rows[float](&a, <float*>cnp.PyArray_DATA(w), <float*>data_or_null(mean),
                             <float*>cnp.PyArray_DATA(rstd), nchunks,
                             <double*>cnp.PyArray_DATA(partials),
                             <double*>cnp.PyArray_DATA(dwdb), <float*>data_or_null(scratch))
    else:
        backward_rows[double](&a, <double*>cnp.PyArray_DATA(w), <double*>data_or_null(mean),
                              <double*>cnp.PyArray_DATA(rstd), nchunks,
                              <double*>cnp.PyArray_DATA(partials),
                              <double*>cnp.PyArray_DATA(dwdb), <double*>data_or_null(scratch))
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
