// Runs the CUDA kernels of src/lnfast/kernels/norm.cu on the CPU
// (emulate.h) against a float64 reference, case by case.
//
// Prints one line per case: "<case> <max relative error>".  Driven by
// tests/gpu/test_cuda_emulated.py.
#include <random>

#include "emulate.h"
#include "norm.cu"

template <class T> double val(T v) { return (double)lnf::to_f(v); }
template <class T> T make(double v) { return lnf::from_m<T>((typename lnf::Math<T>::type)v); }

static double rel(const std::vector<double> &a, const std::vector<double> &b)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return std::isnan(num) ? INFINITY : std::sqrt(num / (den > 0 ? den : 1));
}

// One case: M rows of D, x strided by `xs` elements along the row (VEC 1) or
// contiguous (VEC > 1), a residual when `res`, centred (LayerNorm) or not.
// x, the residual (also dz) and dy are drawn, then scaled by `scale`.
template <class T, class S, int VEC, bool CENTERED>
void run_case(const char *name, long long M, long long D, int xs, bool res, unsigned grid,
              unsigned block, std::mt19937 &rng, double scale = 1.0, double eps = 1e-5)
{
    typedef typename lnf::Math<T>::type F;
    std::normal_distribution<double> nd(0.5, 2.0);
    std::vector<T> x(M * D * xs), r(M * D), dy(M * D), z(M * D), y(M * D), dx(M * D);
    std::vector<F> w(D), b(D);
    std::vector<S> mean(M), rstd(M);
    for (auto &v : x) v = make<T>((nd(rng) + 100.0) * scale);   // a common offset
    for (auto &v : r) v = make<T>(nd(rng) * scale);
    for (auto &v : dy) v = make<T>(nd(rng) * scale);
    for (auto &v : w) v = (F)nd(rng);
    for (auto &v : b) v = (F)nd(rng);
    lnf::i64 in = xs;
    launch(grid, block, lnf::norm_forward<T, S, VEC, CENTERED>, x.data(), (lnf::i64)0,
           (lnf::i64)0, (lnf::i64)(D * xs), in, res ? r.data() : (T *)nullptr, (lnf::i64)0,
           (lnf::i64)0, (lnf::i64)D, (lnf::i64)1, res ? z.data() : (T *)nullptr, y.data(),
           (const F *)w.data(), (const F *)b.data(), mean.data(), rstd.data(), (lnf::i64)M,
           (lnf::i64)D, (lnf::i64)1, (lnf::i64)M, eps);
    // float64 reference of the forward pass, from the rows normalized: x, or
    // z = x + residual rounded once to T
    std::vector<double> got, want, src(M * D);
    for (long long i = 0; i < M; i++)
        for (long long j = 0; j < D; j++)
            src[i * D + j] = res ? val(make<T>(val(x[(i * D + j) * xs]) + val(r[i * D + j])))
                                 : val(x[(i * D + j) * xs]);
    std::vector<double> rmean(M), rrstd(M);
    for (long long i = 0; i < M; i++) {
        double m = 0, v = 0;
        for (long long j = 0; j < D; j++) m += src[i * D + j];
        m = CENTERED ? m / D : 0.0;
        for (long long j = 0; j < D; j++) v += (src[i * D + j] - m) * (src[i * D + j] - m);
        rmean[i] = m;
        rrstd[i] = 1.0 / std::sqrt(v / D + eps);
        for (long long j = 0; j < D; j++) {
            got.push_back(val(y[i * D + j]));
            double xh = (src[i * D + j] - m) * rrstd[i];
            want.push_back(CENTERED ? xh * w[j] + b[j] : xh * w[j]);
        }
    }
    printf("%s.forward %.3e\n", name, rel(got, want));
    // backward through the partial and reduce kernels
    unsigned G = (unsigned)std::min<long long>(M, 3);
    std::vector<double> part(G * 2 * D), dwdb(2 * D);
    const T *xb = res ? z.data() : x.data();
    lnf::i64 xin = res ? 1 : xs;
    launch(G, block, lnf::norm_backward_partial<T, S, VEC, CENTERED>, dy.data(), (lnf::i64)0,
           (lnf::i64)0, (lnf::i64)D, (lnf::i64)1, xb, (lnf::i64)0, (lnf::i64)0,
           (lnf::i64)(D * xin), xin, res ? r.data() : (T *)nullptr, (lnf::i64)0, (lnf::i64)0,
           (lnf::i64)D, (lnf::i64)1, CENTERED ? (const S *)mean.data() : (const S *)nullptr,
           (const S *)rstd.data(), (const F *)w.data(), dx.data(), part.data(), (lnf::i64)M,
           (lnf::i64)D, (lnf::i64)1, (lnf::i64)M);
    launch(1, 64, lnf::norm_backward_reduce<double>, (const double *)part.data(), (lnf::i64)G,
           (lnf::i64)(2 * D), dwdb.data());
    std::vector<double> gdx, wdx, gdw, wdw;
    std::vector<double> rdw(D, 0.0), rdb(D, 0.0);
    for (long long i = 0; i < M; i++) {
        double mg = 0, mgx = 0;
        std::vector<double> xh(D), g(D);
        for (long long j = 0; j < D; j++) {
            xh[j] = (src[i * D + j] - rmean[i]) * rrstd[i];
            g[j] = val(dy[i * D + j]) * w[j];
            mg += g[j];
            mgx += g[j] * xh[j];
        }
        mg = CENTERED ? mg / D : 0.0;
        mgx /= D;
        for (long long j = 0; j < D; j++) {
            double d = rrstd[i] * (g[j] - mg - xh[j] * mgx) + (res ? val(r[i * D + j]) : 0.0);
            gdx.push_back(val(dx[i * D + j]));
            wdx.push_back(d);
            rdw[j] += val(dy[i * D + j]) * xh[j];
            rdb[j] += val(dy[i * D + j]);
        }
    }
    for (long long j = 0; j < D; j++) {
        gdw.push_back(dwdb[j]);
        wdw.push_back(rdw[j]);
        if (CENTERED) {
            gdw.push_back(dwdb[D + j]);
            wdw.push_back(rdb[j]);
        }
    }
    printf("%s.dx %.3e\n%s.dweight_dbias %.3e\n", name, rel(gdx, wdx), name, rel(gdw, wdw));
}

int main()
{
    std::mt19937 rng(3);
    // name, M, D, element stride, residual, grid (< M: grid-stride loop), threads
    run_case<float, float, 4, true>("float.vec4.layernorm", 7, 1000, 1, false, 3, 64, rng);
    run_case<float, float, 1, true>("float.strided.layernorm", 5, 999, 3, false, 2, 64, rng);
    run_case<float, float, 4, true>("float.vec4.residual", 6, 512, 1, true, 4, 32, rng);
    run_case<float, float, 4, false>("float.vec4.rmsnorm", 5, 768, 1, false, 5, 64, rng);
    run_case<double, double, 2, true>("double.vec2.layernorm", 4, 1026, 1, false, 2, 128, rng);
    run_case<double, double, 1, false>("double.strided.rmsnorm", 3, 77, 2, false, 3, 32, rng);
    run_case<__half, float, 8, true>("half.vec8.layernorm", 4, 1024, 1, false, 2, 64, rng);
    run_case<__nv_bfloat16, float, 8, true>("bfloat16.vec8.residual", 4, 512, 1, true, 4, 32, rng);
    run_case<float, float, 1, true>("float.one_element_rows", 9, 1, 1, false, 4, 32, rng);
    run_case<float, float, 4, true>("float.long_rows", 2, 16384, 1, false, 2, 512, rng);
    // Subnormal data, which the launches flush in float32 arithmetic as the
    // GPU does (emulate.h): x near 2^-133 (bfloat16: 2^-121, spaced by
    // subnormals, and 2^-127), and eps small enough to leave rstd near 2^127.
    const double eps = std::ldexp(1.0, -254);
    run_case<float, float, 4, true>("float.subnormal.layernorm", 5, 256, 1, false, 3, 64, rng,
                                    std::ldexp(1.0, -140), eps);
    run_case<float, float, 1, false>("float.subnormal.rmsnorm", 4, 99, 2, true, 2, 32, rng,
                                     std::ldexp(1.0, -140), eps);
    run_case<__nv_bfloat16, float, 8, true>("bfloat16.subnormal.residual", 4, 512, 1, true, 4,
                                            64, rng, std::ldexp(1.0, -128), eps);
    run_case<__nv_bfloat16, float, 1, false>("bfloat16.subnormal.rmsnorm", 3, 77, 1, false, 3,
                                             32, rng, std::ldexp(1.0, -134), eps);
    return 0;
}
