// CUDA kernels of lnfast: LayerNorm and RMSNorm, forward and backward, over
// the last axis.  Built at run time by CuPy's RawModule (lnfast/_gpu.py),
// which instantiates the templates below with name_expressions.
//
// The math is the CPU kernels' (docs/derivation.md): float64 row sums over
// data shifted by the row's first element, the float64 mean applied as a
// hi/lo pair, the stored mean used as a shift in the backward pass.  Every
// reduction runs in a fixed order (a fixed tree in the block, blocks added in
// order by a second kernel): no atomics, so results repeat bit for bit.
//
// Rows: row r of an input sits at   i0 * s0 + i1 * s1 + i2 * s2   elements
// from its base, where (i0, i1, i2) unravels r over the leading shape
// (n0, n1, n2); `inner` is the element stride along the row.  Outputs are
// C-contiguous.  VEC > 1 selects 16-byte loads and stores, for rows that are
// contiguous and 16-byte aligned; VEC == 1 is the scalar path.

#ifndef LNF_EMULATE     // tests/gpu/emulate.cpp supplies these types on the CPU
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#endif

namespace lnf {

typedef long long i64;

// Row sums and the partial dweight/dbias rows are float64 for every type.
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ double to_f(double v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

// The arithmetic type of a row element: T itself, float for 16-bit types.
template <typename T> struct Math { typedef T type; };
template <> struct Math<__half> { typedef float type; };
template <> struct Math<__nv_bfloat16> { typedef float type; };

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v)
{
    return __float2bfloat16_rn(v);
}
template <typename T> __device__ __forceinline__ T from_m(typename Math<T>::type v)
{
    return from_f<T>(v);
}
template <> __device__ __forceinline__ double from_m<double>(double v) { return v; }

// CuPy compiles with -ftz=true, whatever the options: float32 arithmetic and
// conversions read and write subnormals as zero.  Values of float32's range
// are met by float and bfloat16 rows only (float16's subnormals are normal
// floats), so their rows that hold a nonzero value below 2^-102 in magnitude
// (TINY: where a value, or a difference of two, can be subnormal) are summed
// and mapped in float64, with these conversions, which keep subnormals
// exactly: the results the CPU gives (docs/gpu.md).
template <typename T> struct Flushed { static const bool value = false; };
template <> struct Flushed<float> { static const bool value = true; };
template <> struct Flushed<__nv_bfloat16> { static const bool value = true; };

__device__ __forceinline__ bool tiny(float v)
{
    return (__float_as_uint(v) & 0x7fffffffu) - 1u < 0x0c7fffffu;   // 0 < |v| < 2^-102
}

// float -> double, subnormals included (an integer scaled by 2^-149).
__device__ __forceinline__ double to_d(float v)
{
    const unsigned u = __float_as_uint(v);
    if (u & 0x7f800000u)
        return (double)v;
    const double m = (double)(int)(u & 0x7fffffu) * 0x1p-149;
    return u >> 31 ? -m : m;
}
__device__ __forceinline__ double to_d(double v) { return v; }
__device__ __forceinline__ double to_d(__half v) { return (double)__half2float(v); }
__device__ __forceinline__ double to_d(__nv_bfloat16 v) { return to_d(__bfloat162float(v)); }

// double -> float rounded to nearest even, subnormal results included.
__device__ __forceinline__ float to_float(double v)
{
    const double a = fabs(v);
    if (!(a < 0x1p-126))                        // normal, infinite or NaN
        return (float)v;
    const unsigned m = (unsigned)rint(a * 0x1p149);     // exact scaling; 0x800000 is 2^-126
    return __uint_as_float((__double_as_longlong(v) < 0 ? 0x80000000u : 0u) | m);
}

__device__ __forceinline__ double quiet_nan()
{
    return __longlong_as_double(0x7ff8000000000000LL);
}

// The mark a row sum gets when its row holds TINY values: a quiet NaN, which
// sends the row to the float64 path as a NaN in the data does.
__device__ __forceinline__ double tiny_mark()
{
    return quiet_nan();
}

// a + b, for the residual and dz: exactly in float64 and rounded once where
// float32 would flush an operand (TINY, in a row of a Flushed type).
template <typename T> __device__ __forceinline__ float add_kept(float a, float b)
{
    if (Flushed<T>::value && (tiny(a) || tiny(b)))
        return to_float(to_d(a) + to_d(b));
    return a + b;
}
template <typename T> __device__ __forceinline__ double add_kept(double a, double b)
{
    return a + b;
}

// A value of the map's type C (F, or double for the float64 paths) from an
// element, and back to the arithmetic type F.
template <typename C> struct Wide;
template <> struct Wide<float> {
    template <typename T> __device__ __forceinline__ static float in(T v) { return to_f(v); }
};
template <> struct Wide<double> {
    template <typename T> __device__ __forceinline__ static double in(T v) { return to_d(v); }
};
template <typename F> __device__ __forceinline__ F fit(float v) { return v; }
template <typename F> __device__ __forceinline__ F fit(double v);
template <> __device__ __forceinline__ float fit<float>(double v) { return to_float(v); }
template <> __device__ __forceinline__ double fit<double>(double v) { return v; }

// Kernel arguments are scalars (what RawKernel passes): an input's rows come
// as ROWS(x) = its base pointer and strides, the leading shape as n1, n2.
// No __restrict__ here: the forward pass re-reads the z rows it writes, and
// x may be y (in place), so these loads must not take the read-only path.
#define ROWS(p) const T *p, i64 p##_s0, i64 p##_s1, i64 p##_s2, i64 p##_in
#define ROW(p, r) (p + row_offset(r, n1, n2, p##_s0, p##_s1, p##_s2))

__device__ __forceinline__ i64 row_offset(i64 r, i64 n1, i64 n2, i64 s0, i64 s1, i64 s2)
{
    i64 i2 = r % n2;
    r /= n2;
    return (r / n1) * s0 + (r % n1) * s1 + i2 * s2;
}

// VEC consecutive elements, moved as one 16-byte access when VEC > 1.  A
// pack of 8 floats (the weight beside 16-bit rows) is aligned to 16 bytes
// only, as its vector is: two 16-byte loads, not one 32-byte load that
// sm_100 would require aligned to 32.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC < 16 ? sizeof(T) * VEC : 16) Pack {
    T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load(const T *row, i64 j, i64 inner)
{
    Pack<T, VEC> p;
    if (VEC > 1) {
        p = *reinterpret_cast<const Pack<T, VEC> *>(row + j);
    } else {
        p.v[0] = row[j * inner];
    }
    return p;
}

template <typename T, int VEC>
__device__ __forceinline__ void store(T *row, i64 j, const Pack<T, VEC> &p)
{
    *reinterpret_cast<Pack<T, VEC> *>(row + j) = p;
}

// The reductions of block_reduce: a sum, and a maximum where NaN counts as
// no value (fmax's).
struct Add {
    __device__ double operator()(double a, double b) const { return a + b; }
};
struct Max {
    __device__ double operator()(double a, double b) const { return fmax(a, b); }
};

// N doubles per thread reduced over the block by op, in a fixed order: a
// butterfly in each warp, then the warps' results by warp 0 (`lo` stands in
// for the warps a block lacks).  Every thread gets the results.
template <int N, typename Op>
__device__ void block_reduce(double (&v)[N], double *smem /* [32 * N] */, Op op, double lo)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int k = 0; k < N; k++)
        for (int off = 16; off > 0; off >>= 1)
            v[k] = op(v[k], __shfl_xor_sync(0xffffffffu, v[k], off));
    __syncthreads();            // smem may still be read from the last call
    if (lane == 0)
        for (int k = 0; k < N; k++)
            smem[k * 32 + warp] = v[k];
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int k = 0; k < N; k++) {
            double s = lane < nwarps ? smem[k * 32 + lane] : lo;
            for (int off = 16; off > 0; off >>= 1)
                s = op(s, __shfl_xor_sync(0xffffffffu, s, off));
            if (lane == 0)
                smem[k * 32] = s;
        }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < N; k++)
        v[k] = smem[k * 32];
}

template <int N> __device__ void block_sum(double (&v)[N], double *smem)
{
    block_reduce<N>(v, smem, Add(), 0.0);
}

template <int N> __device__ void block_max(double (&v)[N], double *smem, double lo)
{
    block_reduce<N>(v, smem, Max(), lo);
}

// float64's largest finite value, and grad_exact's mark of a row with no
// nonzero dy * w (the CPU's INT_MIN).
constexpr double DMAX = 0x1.fffffffffffffp1023;
constexpr int NO_EXPONENT = -0x7fffffff - 1;

// ---------------------------------------------------------------------------
// Forward: the sums of a row's x - shift and (x - shift)^2, in float64.
// Unless EXACT, a TINY value of a Flushed type sets s[0] to tiny_mark(), which
// sends the row to the EXACT sums and the float64 map.
template <typename T, int VEC, bool EXACT>
__device__ __forceinline__ void row_sums(const T *src, i64 inner, double shift, i64 D,
                                         double (&s)[2])
{
    bool small = false;
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += (i64)blockDim.x * VEC) {
        Pack<T, VEC> a = load<T, VEC>(src, j, inner);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            double d = (EXACT ? to_d(a.v[k]) : (double)to_f(a.v[k])) - shift;
            if (Flushed<T>::value && !EXACT)
                small |= tiny(to_f(a.v[k]));
            s[0] += d;
            s[1] += d * d;
        }
    }
    if (small)
        s[0] = tiny_mark();
}

// The map of a row, y = ((x - hi) - lo) * rs * w + b (RMSNorm: x * rs * w),
// with its terms in C: F, or float64 for the rare float32 rows whose
// deviations or rstd leave float32's range (as the CPU's row_exact) and the
// rows with TINY values.
template <typename C, typename T, int VEC, bool CENTERED>
__device__ __forceinline__ void row_map(const T *src, i64 inner,
                                        const typename Math<T>::type *__restrict__ w,
                                        const typename Math<T>::type *__restrict__ b, T *yr,
                                        C hi, C lo, C rs, i64 D)
{
    typedef typename Math<T>::type F;
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += (i64)blockDim.x * VEC) {
        Pack<T, VEC> a = load<T, VEC>(src, j, inner);
        Pack<F, VEC> wp = load<F, VEC>(w, j, 1), bp = load<F, VEC>(b, j, 1);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            const C xv = Wide<C>::in(a.v[k]), wv = Wide<C>::in(wp.v[k]);
            C v = CENTERED ? ((xv - hi) - lo) * rs * wv + Wide<C>::in(bp.v[k]) : xv * rs * wv;
            a.v[k] = from_m<T>(fit<F>(v));
        }
        store<T, VEC>(yr, j, a);
    }
}

// t w 2^e, with w's own power of two applied with e, last and once (frexp),
// so that no partial product leaves float64's range where the result does
// not (row_exact; the CPU's scaled_product).
__device__ __forceinline__ double scaled_product(double t, double w, int e)
{
    int ew;
    const double fw = frexp(w, &ew);
    return ldexp(t * fw, ew + e);
}

// Whether a float64 row's sums serve (the CPU's row_ok): squares that
// overflowed, or a variance below 1e-290 where the squares may have
// underflowed (unless the row is constant and eps swamps it), do not; nor
// does a row with NaN or infinity (redone, it stays so).
__device__ __forceinline__ bool sums_ok(const double (&s)[2], double var, double eps)
{
    const double floor = 1e-290;
    return (var >= floor || (s[0] == 0.0 && s[1] == 0.0 && eps >= floor)) && s[1] < 1e300;
}

// A float64 row that sums_ok turns down, every term in float64 (the CPU's
// row_exact): x halved where x - x[0] could overflow (x / 2 is exact
// there), the deviations d = x - x[0] (RMSNorm: x) scaled by the power of
// two sc that brings the largest near 1, so that no square overflows or
// underflows, and two passes (the mean of d, then the sums about it).  Any
// finite row, at the cost of four reads.  Writes y; mean and rstd as
// stored.  (Built for every T; only float64 rows come here.)
template <typename T, int VEC, bool CENTERED>
__device__ void row_exact(const T *src, i64 inner, const typename Math<T>::type *__restrict__ w,
                          const typename Math<T>::type *__restrict__ b, T *yr, i64 D,
                          double eps, double *smem, double &mean, double &rstd)
{
    typedef typename Math<T>::type F;
    const i64 step = (i64)blockDim.x * VEC;
    double top[1] = {0.0};          // the largest finite |x|, then |x pre - shift|
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
        for (int k = 0; k < VEC; k++) {
            const double a = fabs(to_d(src[(j + k) * inner]));
            top[0] = a <= DMAX && a > top[0] ? a : top[0];
        }
    block_max<1>(top, smem, 0.0);
    const double pre = top[0] > 0x1p1022 ? 0.5 : 1.0;
    eps *= pre * pre;
    const double shift = CENTERED ? to_d(src[0]) * pre : 0.0;
    top[0] = 0.0;
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
        for (int k = 0; k < VEC; k++) {
            const double d = fabs(to_d(src[(j + k) * inner]) * pre - shift);
            top[0] = d <= DMAX && d > top[0] ? d : top[0];
        }
    block_max<1>(top, smem, 0.0);
    double sc = 1.0;
    int esc = 0;                    // sc = 2^esc
    if (top[0] > 0.0) {
        int e;
        frexp(top[0], &e);
        esc = e > -1022 ? -e : 1022;                // (2^1024 overflows)
        sc = ldexp(1.0, esc);
    }
    double m = 0.0;
    if (CENTERED) {
        double s[1] = {0.0};
        for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
            for (int k = 0; k < VEC; k++)
                s[0] += (to_d(src[(j + k) * inner]) * pre - shift) * sc;
        block_sum<1>(s, smem);
        m = s[0] / D;
    }
    double s[2] = {0.0, 0.0};
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
        for (int k = 0; k < VEC; k++) {
            const double d = (to_d(src[(j + k) * inner]) * pre - shift) * sc - m;
            s[0] += d;
            s[1] += d * d;
        }
    block_sum<2>(s, smem);
    m += CENTERED ? s[0] / D : 0.0;
    double var = CENTERED ? s[1] / D - (s[0] / D) * (s[0] / D) : s[1] / D;
    var = var < 0.0 ? 0.0 : var;
    // rstd = 1 / sqrt(var / sc^2 + eps), and y = (x - mean) rstd = (d sc - m)
    // rs with rs = rstd / sc, from the scaled variance unless eps sc^2
    // overflows; there rstd / sc can underflow, so that y is (d sc - m) rstd
    // w / sc with the powers of two of rstd, w and 1 / sc applied last, once
    // (the CPU's row_exact does the same)
    const bool apart = !(eps * sc * sc <= DMAX);
    double rs;
    int er = 0;
    if (!apart) {
        rs = 1.0 / sqrt(var + eps * sc * sc);
        rstd = rs * sc * pre;
    } else {
        rstd = 1.0 / sqrt(var / sc / sc + eps);
        rs = frexp(rstd, &er);      // rstd's fraction
        rstd *= pre;
    }
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
        for (int k = 0; k < VEC; k++) {
            const i64 e = j + k;
            const double u = (to_d(src[e * inner]) * pre - shift) * sc - m, wv = to_d(w[e]);
            const double d = apart ? scaled_product(u * rs, wv, er - esc) : u * rs * wv;
            yr[e] = from_m<T>(fit<F>(CENTERED ? d + to_d(b[e]) : d));
        }
    mean = CENTERED ? (shift + m / sc) / pre : 0.0;
}

// Forward: one block per row (a grid-stride loop over rows).  With `res`,
// z = x + res is written first and normalized from there (L1/L2): the z
// that is returned, rounded to T.  S is the type of mean and rstd; weight
// and bias come in the arithmetic type (float for 16-bit T).
template <typename T, typename S, int VEC, bool CENTERED>
__global__ void norm_forward(ROWS(x), ROWS(res), T *z, T *y,
                             const typename Math<T>::type *__restrict__ w,
                             const typename Math<T>::type *__restrict__ b,
                             S *__restrict__ mean_out, S *__restrict__ rstd_out, i64 M,
                             i64 D, i64 n1, i64 n2, double eps)
{
    typedef typename Math<T>::type F;
    __shared__ double smem[32 * 2];
    for (i64 r = blockIdx.x; r < M; r += gridDim.x) {
        const T *xr = ROW(x, r);
        const T *src = xr;              // the row that is normalized
        i64 inner = x_in;
        if (res != nullptr) {
            const T *rr = ROW(res, r);
            T *zr = z + r * D;
            for (i64 j = (i64)threadIdx.x * VEC; j < D; j += (i64)blockDim.x * VEC) {
                Pack<T, VEC> a = load<T, VEC>(xr, j, x_in), c = load<T, VEC>(rr, j, res_in);
#pragma unroll
                for (int k = 0; k < VEC; k++)
                    a.v[k] = from_m<T>(add_kept<T>((F)to_f(a.v[k]), (F)to_f(c.v[k])));
                store<T, VEC>(zr, j, a);
            }
            __syncthreads();            // z complete before any thread reads it
            src = zr;
            inner = 1;
        }
        double shift = CENTERED ? to_d(src[0]) : 0.0;
        double s[2] = {0.0, 0.0};
        row_sums<T, VEC, false>(src, inner, shift, D, s);
        block_sum<2>(s, smem);
        const bool exact = Flushed<T>::value && s[0] != s[0];   // TINY values (or NaN)
        if (exact) {
            s[0] = s[1] = 0.0;
            row_sums<T, VEC, true>(src, inner, shift, D, s);
            block_sum<2>(s, smem);
        }
        double m = CENTERED ? s[0] / D : 0.0;
        // float64 rows: squares of x - shift are rounded, and the
        // cancellation below magnifies that by 1 + m^2 / var; sum again
        // about the mean where the shift lies 2 deviations off (the CPU's
        // RESHIFT_F64; float32 terms are squared exactly in float64).
        if (sizeof(T) == 8 && CENTERED && m * m > 4.0 * (s[1] / D - m * m)) {
            shift += m;
            s[0] = s[1] = 0.0;
            row_sums<T, VEC, true>(src, inner, shift, D, s);
            block_sum<2>(s, smem);
            m = s[0] / D;
        }
        double var = s[1] / D - m * m;
        var = var < 0.0 ? 0.0 : var;    // clamp rounding below zero; NaN stays
        T *yr = y + r * D;
        S mo, ro;                       // mean and rstd as stored
        if (sizeof(T) == 8 && !sums_ok(s, var, eps)) {
            double mu, rsd;
            row_exact<T, VEC, CENTERED>(src, inner, w, b, yr, D, eps, smem, mu, rsd);
            mo = (S)mu, ro = (S)rsd;
        } else {
            const double mean = shift + m, t = mean - shift;
            const double err = (shift - (mean - t)) + (m - t);  // mean + err == shift + m
            const double rstd = 1.0 / sqrt(var + eps);
            const F hi = fit<F>(mean), lo = fit<F>((mean - to_d(hi)) + err), rs = fit<F>(rstd);
            if (sizeof(F) == 4 && (exact || !(D * var < 1e72 && rstd > 1e-30 && rstd < 1e30)))
                row_map<double, T, VEC, CENTERED>(src, inner, w, b, yr, mean, err, rstd, D);
            else
                row_map<F, T, VEC, CENTERED>(src, inner, w, b, yr, hi, lo, rs, D);
            mo = CENTERED ? (S)hi : (S)0, ro = (S)rs;
        }
        if (threadIdx.x == 0) {
            if (mean_out != nullptr)
                mean_out[r] = mo;
            if (rstd_out != nullptr)
                rstd_out[r] = ro;
        }
        __syncthreads();                // smem and z reused by the next row
    }
}

// ---------------------------------------------------------------------------
// Backward: a row's sums of d = x - m, g = dy * w and g d, with the terms
// formed in C (F, or float64 for the rare float32 rows whose terms overflow
// float32, as the CPU's backward_exact, and the rows with TINY x or dy) and
// summed in float64.  In F, a TINY value of a Flushed type sets s[0] to tiny_mark().
template <typename C, typename T, int VEC>
__device__ __forceinline__ void grad_sums(const T *xr, i64 x_in, const T *dyr, i64 dy_in,
                                          const typename Math<T>::type *__restrict__ w, C m,
                                          i64 D, double (&s)[3])
{
    typedef typename Math<T>::type F;
    bool small = false;
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += (i64)blockDim.x * VEC) {
        Pack<T, VEC> a = load<T, VEC>(xr, j, x_in), g = load<T, VEC>(dyr, j, dy_in);
        Pack<F, VEC> wp = load<F, VEC>(w, j, 1);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            C d = Wide<C>::in(a.v[k]) - m, gk = Wide<C>::in(g.v[k]) * Wide<C>::in(wp.v[k]);
            if (Flushed<T>::value && sizeof(C) == 4)
                small |= tiny(to_f(a.v[k])) | tiny(to_f(g.v[k]));
            s[0] += (double)d;
            s[1] += (double)gk;
            s[2] += (double)gk * (double)d;
        }
    }
    if (small)
        s[0] = tiny_mark();
}

// v, or NaN where a row's sums of g and g (x - m) are not finite (an
// infinity or NaN in dy or w): mean(g xhat) then makes every dx of the row
// NaN, where some would come out infinite (the CPU's backward_exact).
__device__ __forceinline__ double nan_unless_finite(double v, const double (&s)[3])
{
    return fabs(s[1]) <= DMAX && fabs(s[2]) <= DMAX ? v : quiet_nan();
}

// The map of a row: dx (plus dz) from its sums s, in C as grad_sums, and
// the row's dweight/dbias terms added to the block's partial rows.
template <typename C, typename T, int VEC, bool CENTERED>
__device__ __forceinline__ void grad_map(const T *xr, i64 x_in, const T *dyr, i64 dy_in,
                                         const T *dzr, i64 dz_in,
                                         const typename Math<T>::type *__restrict__ w,
                                         T *dxr, double *pw, double *pb, C m, C rs,
                                         const double (&s)[3], i64 D)
{
    typedef typename Math<T>::type F;
    const double c = CENTERED ? s[0] / D : 0.0;
    const C cr = (C)c, mg = CENTERED ? (C)(s[1] / D) : (C)0;
    const C mgx = (C)nan_unless_finite((double)rs * (s[2] - c * s[1]) / D, s);
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += (i64)blockDim.x * VEC) {
        Pack<T, VEC> a = load<T, VEC>(xr, j, x_in), g = load<T, VEC>(dyr, j, dy_in);
        Pack<F, VEC> wp = load<F, VEC>(w, j, 1);
        Pack<T, VEC> zp, out;
        if (dzr != nullptr)
            zp = load<T, VEC>(dzr, j, dz_in);
#pragma unroll
        for (int k = 0; k < VEC; k++) {
            C xh = ((Wide<C>::in(a.v[k]) - m) - cr) * rs;
            C gy = Wide<C>::in(g.v[k]);
            C v = rs * ((gy * Wide<C>::in(wp.v[k]) - mg) - xh * mgx);
            if (dzr != nullptr)   // the gradient reaching z flows on unchanged
                v = add_kept<T>(v, Wide<C>::in(zp.v[k]));
            out.v[k] = from_m<T>(fit<F>(v));
            pw[j + k] += (double)gy * (double)xh;
            if (CENTERED)
                pb[j + k] += (double)gy;
        }
        store<T, VEC>(dxr, j, out);
    }
}

// Whether a row's dy is all zeros, over the block: a row whose g and
// g (x - m) sum to exactly zero is padding then, else its products dy w
// underflowed (or were flushed) and it is redone (the CPU's lnf_row_zero).
template <typename T, int VEC>
__device__ bool dy_row_zero(const T *dyr, i64 dy_in, i64 D, double *smem)
{
    double any[1] = {0.0};
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += (i64)blockDim.x * VEC)
        for (int k = 0; k < VEC; k++)
            if (to_d(dyr[(j + k) * dy_in]) != 0.0)
                any[0] = 1.0;
    block_max<1>(any, smem, 0.0);
    return any[0] == 0.0;
}

// Whether a float64 row's backward sums serve (the CPU's row_grad_ok):
// not where they overflowed (with rstd > 0) or where the sum of g (x - m)
// is so small that its terms may have underflowed.
__device__ __forceinline__ bool grad_sums_ok(const double (&s)[3], double rs, i64 D)
{
    const double all = s[0] + s[1] + s[2];
    if (rs > 0.0 && !(fabs(all) <= DMAX))
        return false;
    return !(fabs(s[2]) < D * 0x1p-960 && (s[2] != 0.0 || s[1] != 0.0));
}

// (x - m) up, exactly where it does not overflow or underflow: scaled down
// (up < 1), x and m each before their difference.
__device__ __forceinline__ double deviation(double x, double m, double up)
{
    return up < 1.0 ? x * up - m * up : (x - m) * up;
}

// g = dy w scaled by 2^-eg: the product of dy's and w's fractions (frexp),
// rounded once, times 2 to its exponent less eg, so that the product itself
// cannot leave the range where its scaled value does not.
__device__ __forceinline__ double grad_term(double dy, double w, int eg)
{
    if (!eg)
        return dy * w;
    int a, b;
    const double f = frexp(dy, &a) * frexp(w, &b);
    return ldexp(f, a + b - eg);
}

// A float64 row that grad_sums_ok turns down, in float64 throughout with
// its terms scaled where they would leave float64's range (the CPU's
// backward_exact, which says why each scale): deviations from the mean all
// below 2^-900 by 2^1000 (up), those past 2^960 to below 1; g = dy w by
// 2^-eg where it is below 1 or its products with the deviations could
// underflow, where it is near float64's top, or where the sums overflow;
// dx then rstd scaled into [1, 2) times the scaled terms, scaled back once.
// Writes dx (plus dz) and adds the row's dweight/dbias terms to pw, pb.
// (Built for every T; only float64 rows come here.)
template <typename T, int VEC, bool CENTERED>
__device__ void grad_exact(const T *xr, i64 x_in, const T *dyr, i64 dy_in, const T *dzr,
                           i64 dz_in, const typename Math<T>::type *__restrict__ w, T *dxr,
                           double *pw, double *pb, double m, double rs, i64 D, double *smem)
{
    typedef typename Math<T>::type F;
    const i64 step = (i64)blockDim.x * VEC;
    // big: the largest |x - m| (infinite where it overflows); gb: the largest
    // |dy w| (infinite where it overflows); bad: dy or w not finite
    double big = 0.0, gb = 0.0, bad = 0.0;
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
        for (int k = 0; k < VEC; k++) {
            const i64 e = j + k;
            const double x = to_d(xr[e * x_in]), dy = to_d(dyr[e * dy_in]), wv = to_d(w[e]);
            const double d = fabs(x - m), p = fabs(dy * wv);
            big = big < d ? d : big;
            if (!(fabs(dy) <= DMAX && fabs(wv) <= DMAX))
                bad = 1.0;
            else
                gb = gb < p ? p : gb;
        }
    double most[3] = {big, gb, bad};
    block_max<3>(most, smem, 0.0);
    big = most[0], gb = most[1], bad = most[2];
    double up = 1.0;
    if (big < 0x1p-900)
        up = 0x1p1000;
    else if (big > 0x1p960)
        up = big > DMAX ? 0x1p-1025 : ldexp(1.0, -ilogb(big) - 1);
    // e: the exponent (frexp's) of the largest g, from the fractions' products
    // where the largest product is not a normal number
    int e = NO_EXPONENT;
    if (bad == 0.0 && gb >= 0x1p-1022 && gb <= DMAX) {
        frexp(gb, &e);
    } else if (bad == 0.0) {
        double top[1] = {-1e9};         // (no nonzero product)
        for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
            for (int k = 0; k < VEC; k++) {
                const i64 i = j + k;
                int a, b;
                const double f = fabs(frexp(to_d(dyr[i * dy_in]), &a) * frexp(to_d(w[i]), &b));
                if (f > 0.0)
                    top[0] = fmax(top[0], (double)(a + b - (f < 0.5)));
            }
        block_max<1>(top, smem, -1e9);
        e = top[0] > -1e8 ? (int)top[0] : NO_EXPONENT;
    }
    const int ed = up < 1.0 || big == 0.0 ? 0 : ilogb(big * up);
    int eg = e != NO_EXPONENT && (e < 0 || e + ed < -900 || e > 1000) ? e : 0;
    // xhat = (deviation - c) rsx, unscaled where deviations are scaled down,
    // scaled by up where they are scaled up
    const double rsx = up < 1.0 ? rs / up : rs, xs = up < 1.0 ? 1.0 : up;
    double c, mg, mgx, s[3];
    for (int pass = 0;; pass++) {
        s[0] = s[1] = s[2] = 0.0;
        for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
            for (int k = 0; k < VEC; k++) {
                const i64 i = j + k;
                const double d = deviation(to_d(xr[i * x_in]), m, up);
                const double g = grad_term(to_d(dyr[i * dy_in]), to_d(w[i]), eg);
                s[0] += d;
                s[1] += g;
                s[2] += g * d;
            }
        block_sum<3>(s, smem);
        c = CENTERED ? s[0] / D : 0.0;
        mg = CENTERED ? s[1] / D : 0.0;
        mgx = rsx * (s[2] - c * s[1]) / D;
        // sums that overflowed, or a mean(g xhat) xs past 2^1000 that could
        // overflow the map, with finite dy and w: once more, g scaled
        if (pass || eg || bad != 0.0 || e == NO_EXPONENT
            || (fabs(mgx) < 0x1p1000 && fabs(s[1]) <= DMAX))
            break;
        eg = e;
    }
    mgx = nan_unless_finite(mgx, s);
    const int er = eg && rs > 0.0 && rs <= DMAX ? ilogb(rs) : 0;
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += step)
        for (int k = 0; k < VEC; k++) {
            const i64 i = j + k;
            const double dy = to_d(dyr[i * dy_in]);
            const double xh = (deviation(to_d(xr[i * x_in]), m, up) - c) * rsx;  // xhat xs
            double d = (grad_term(dy, to_d(w[i]), eg) - mg) - xh * (mgx / xs) / xs;
            d = eg ? ldexp(ldexp(rs, -er) * d, eg + er) : rs * d;
            if (dzr != nullptr)
                d += to_d(dzr[i * dz_in]);
            dxr[i] = from_m<T>(fit<F>(d));
            pw[i] += xs == 1.0 ? dy * xh : fabs(xh) >= 1.0 ? dy * (xh / xs) : dy * xh / xs;
            if (CENTERED)
                pb[i] += dy;
        }
}

// Backward, step 1: block b takes the rows [b M / G, (b + 1) M / G) in order,
// writes dx (plus dz), and sums dy * xhat and dy into its own partial rows
// part[b][0:D] and part[b][D:2D].  Each column belongs to one thread, so the
// partial rows need no atomics and their sums have a fixed order.
template <typename T, typename S, int VEC, bool CENTERED>
__global__ void norm_backward_partial(ROWS(dy), ROWS(x), ROWS(dz),
                                      const S *__restrict__ mean, const S *__restrict__ rstd,
                                      const typename Math<T>::type *__restrict__ w,
                                      T *__restrict__ dx, double *__restrict__ part, i64 M,
                                      i64 D, i64 n1, i64 n2)
{
    typedef typename Math<T>::type F;
    typedef double A;
    __shared__ double smem[32 * 3];
    const i64 G = gridDim.x, r0 = blockIdx.x * M / G, r1 = (blockIdx.x + 1) * M / G;
    A *pw = part + 2 * D * blockIdx.x, *pb = pw + D;
    for (i64 j = (i64)threadIdx.x * VEC; j < D; j += (i64)blockDim.x * VEC)
#pragma unroll
        for (int k = 0; k < VEC; k++)
            pw[j + k] = pb[j + k] = 0;
    for (i64 r = r0; r < r1; r++) {
        const T *xr = ROW(x, r), *dyr = ROW(dy, r);
        const double m = CENTERED ? to_d(mean[r]) : 0.0, rs = to_d(rstd[r]);
        double s[3] = {0.0, 0.0, 0.0};      // sum(x - m), sum(g), sum(g (x - m))
        grad_sums<F, T, VEC>(xr, x_in, dyr, dy_in, w, fit<F>(m), D, s);
        block_sum<3>(s, smem);
        T *dxr = dx + r * D;
        const T *dzr = dz != nullptr ? ROW(dz, r) : nullptr;
        // g summed to zero where dy is not all zero: products that
        // underflowed or were flushed (the same for every thread of the block)
        const bool lost = s[1] == 0.0 && s[2] == 0.0 && !dy_row_zero<T, VEC>(dyr, dy_in, D, smem);
        // float64 where the sums overflowed or met TINY values, where rstd is
        // below float32's normal range, or where products were lost
        if (sizeof(F) == 4 && (lost || !(-1e300 < s[0] + s[1] + s[2] && s[0] + s[1] + s[2] < 1e300
                                         && !(rs < 0x1p-126)))) {
            s[0] = s[1] = s[2] = 0.0;       // (the same for every thread of the block)
            grad_sums<double, T, VEC>(xr, x_in, dyr, dy_in, w, m, D, s);
            block_sum<3>(s, smem);
            grad_map<double, T, VEC, CENTERED>(xr, x_in, dyr, dy_in, dzr, dz_in, w, dxr, pw, pb,
                                               m, rs, s, D);
        } else if (sizeof(F) == 8 && (lost || !grad_sums_ok(s, rs, D))) {
            grad_exact<T, VEC, CENTERED>(xr, x_in, dyr, dy_in, dzr, dz_in, w, dxr, pw, pb, m,
                                         rs, D, smem);
        } else {
            grad_map<F, T, VEC, CENTERED>(xr, x_in, dyr, dy_in, dzr, dz_in, w, dxr, pw, pb,
                                          fit<F>(m), fit<F>(rs), s, D);
        }
    }
}

// Backward, step 2: out[j] = sum over blocks b = 0, 1, ... of part[b][j], in
// that order, for the 2 D columns (dweight then dbias), in float64, stored as
// O: float64, or float32 rounded here, subnormals kept (a CuPy cast would
// flush them).
template <typename O>
__global__ void norm_backward_reduce(const double *__restrict__ part, i64 G, i64 width,
                                     O *__restrict__ out)
{
    for (i64 j = blockIdx.x * (i64)blockDim.x + threadIdx.x; j < width;
         j += (i64)gridDim.x * blockDim.x) {
        double s = 0.0;
        for (i64 b = 0; b < G; b++)
            s += part[b * width + j];
        out[j] = fit<O>(s);
    }
}

#undef ROW
#undef ROWS

}  // namespace lnf
