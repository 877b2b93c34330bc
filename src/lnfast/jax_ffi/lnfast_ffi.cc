// XLA FFI handlers (CPU) over lnfast's C API, for lnfast.jax.
//
// Built by lnfast/jax.py on first use, against jaxlib's FFI headers
// (jax.ffi.include_dir()) and lnfast's own C API header; it links nothing:
// the addresses of lnf_array_init, lnf_forward, lnf_backward and
// lnf_round_sums come from the lnfast._cpu extension at load time
// (lnfast_ffi_set_api).
//
// Rows are the last axis of C-ordered buffers (XLA's default layout on the
// CPU).  Under jax.vmap the calls use vmap_method="broadcast_all": every
// argument then has the batch axes in front, weight and bias included, so
// a call is `nb` batches of rows, each with its own weight (nb is 1 outside
// vmap) and, in the backward, its own dweight/dbias.
//
// The handlers check every buffer's size and type against x's rows before
// they touch one: a call made by hand with other shapes is an error.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "lnfast_cpu.h"

namespace ffi = xla::ffi;

namespace {

int (*array_init)(lnf_array *, void *, int, int, const ptrdiff_t *, const ptrdiff_t *);
int (*forward)(const lnf_forward_args *);
int (*backward)(const lnf_backward_args *);
int (*round_sums)(const double *, void *, ptrdiff_t, int);

int lnf_type(ffi::DataType t)
{
    switch (t) {
    case ffi::DataType::F32: return LNF_FLOAT32;
    case ffi::DataType::F64: return LNF_FLOAT64;
    case ffi::DataType::F16: return LNF_FLOAT16;
    case ffi::DataType::BF16: return LNF_BFLOAT16;
    default: return -1;
    }
}

ptrdiff_t itemsize(int t) { return t == LNF_FLOAT64 ? 8 : t == LNF_FLOAT32 ? 4 : 2; }

// `rows` rows of D elements from row `first` of buffer b, C-ordered (ndim 1:
// row `first` alone, as a vector).
ffi::Error describe(lnf_array *a, const ffi::AnyBuffer &b, int64_t first, int64_t rows,
                    int64_t D, const char *name, int ndim = 2)
{
    int t = lnf_type(b.element_type());
    if (t < 0)
        return ffi::Error::InvalidArgument(std::string("lnfast: unsupported dtype of ") + name);
    ptrdiff_t shape[2] = {(ptrdiff_t)rows, (ptrdiff_t)D};
    ptrdiff_t strides[2] = {(ptrdiff_t)D * itemsize(t), itemsize(t)};
    char *base = (char *)b.untyped_data() + first * D * itemsize(t);
    if (array_init(a, base, t, ndim, shape + 2 - ndim, strides + 2 - ndim) != LNF_OK)
        return ffi::Error::InvalidArgument(std::string("lnfast: cannot describe ") + name);
    return ffi::Error::Success();
}

// Vector k (of D elements) of weight or bias: one per batch.
ffi::Error vector(lnf_array *a, const ffi::AnyBuffer &b, int64_t k, int64_t D, const char *name)
{
    return describe(a, b, k, 1, D, name, 1);
}

// XLA hands out a fresh buffer for each large output, which the first
// writes fault in page by page; asked for huge pages (as lnfast's own
// outputs are, _pool.h), they fault in 2 MiB at a time.  Advice only.
void huge_pages(const ffi::AnyBuffer &b)
{
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    size_t n = b.size_bytes(), page = 4096;
    if (n < ((size_t)4 << 20))
        return;
    size_t start = ((size_t)b.untyped_data() + page - 1) & ~(page - 1);
    size_t end = ((size_t)b.untyped_data() + n) & ~(page - 1);
    madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)b;
#endif
}

ffi::Error status(int s, const char *what)
{
    if (s == LNF_OK)
        return ffi::Error::Success();
    return ffi::Error::Internal(std::string("lnfast: ") + what +
                                (s == LNF_ENOMEM ? " ran out of memory"
                                                 : " was given arguments that do not fit"));
}

#define TRY(e)                        \
    do {                              \
        ffi::Error err_ = (e);        \
        if (!err_.success())          \
            return err_;              \
    } while (0)

int64_t last_dim(const ffi::AnyBuffer &b)
{
    auto dims = b.dimensions();
    return dims.size() ? dims.back() : 1;
}

// Buffer b holds n elements of type t (-1: x's or any kernel type).
bool holds(const ffi::AnyBuffer &b, int64_t n, int t)
{
    int bt = lnf_type(b.element_type());
    return bt >= 0 && (int64_t)b.element_count() == n && (t < 0 || bt == t);
}

ffi::Error sized(bool ok, const char *what)
{
    return ok ? ffi::Error::Success()
              : ffi::Error::InvalidArgument(std::string("lnfast: ") + what +
                                            " has the wrong size or type for x");
}

// Batches in a call: weight's elements over D (1 outside vmap).
ffi::Error batches(const ffi::AnyBuffer &x, const ffi::AnyBuffer &w, int64_t D, int64_t *nb,
                   int64_t *rows)
{
    int64_t n = (int64_t)x.element_count() / (D ? D : 1);
    *nb = (int64_t)w.element_count() / (D ? D : 1);
    if (*nb < 1 || (int64_t)w.element_count() != *nb * D || n % *nb != 0)
        return ffi::Error::InvalidArgument("lnfast: weight and x do not batch alike");
    *rows = n / *nb;
    return ffi::Error::Success();
}

ffi::Error NormForward(ffi::AnyBuffer x, ffi::AnyBuffer residual, ffi::AnyBuffer weight,
                       ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> z, ffi::Result<ffi::AnyBuffer> mean,
                       ffi::Result<ffi::AnyBuffer> rstd, double eps, int64_t centered,
                       int64_t has_residual, int64_t nthreads)
{
    int64_t D = last_dim(x), nb, rows;
    TRY(batches(x, weight, D, &nb, &rows));
    int xt = lnf_type(x.element_type());
    int ct = xt == LNF_FLOAT64 ? LNF_FLOAT64 : LNF_FLOAT32;
    int64_t n = nb * rows;
    TRY(sized(holds(*y, n * D, xt), "y"));
    TRY(sized(holds(*rstd, n, ct), "rstd"));
    TRY(sized(!centered || holds(*mean, n, ct), "mean"));
    TRY(sized(!centered || holds(bias, nb * D, -1), "bias"));
    TRY(sized(!has_residual || (holds(residual, n * D, xt) && holds(*z, n * D, xt)),
              "residual or z"));
    huge_pages(*y);
    if (has_residual)
        huge_pages(*z);
    for (int64_t k = 0; k < nb; k++) {
        int64_t first = k * rows;
        lnf_forward_args a;
        std::memset(&a, 0, sizeof a);
        TRY(describe(&a.x, x, first, rows, D, "x"));
        TRY(describe(&a.y, *y, first, rows, D, "y"));
        TRY(vector(&a.weight, weight, k, D, "weight"));
        a.weight_len = a.bias_len = D;
        if (centered)
            TRY(vector(&a.bias, bias, k, D, "bias"));
        if (has_residual) {
            TRY(describe(&a.residual, residual, first, rows, D, "residual"));
            TRY(describe(&a.z, *z, first, rows, D, "z"));
        }
        a.mean = centered ? (char *)mean->untyped_data() + first * itemsize(ct) : nullptr;
        a.rstd = (char *)rstd->untyped_data() + first * itemsize(ct);
        a.M = rows, a.D = D, a.eps = eps;
        a.has_residual = (int)has_residual, a.centered = (int)centered;
        a.nthreads = (int)nthreads;
        if (rows)
            TRY(status(forward(&a), "the forward pass"));
    }
    return ffi::Error::Success();
}


ffi::Error NormBackward(ffi::AnyBuffer dy, ffi::AnyBuffer x, ffi::AnyBuffer mean,
                        ffi::AnyBuffer rstd, ffi::AnyBuffer weight, ffi::AnyBuffer dz,
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw,
                        ffi::Result<ffi::AnyBuffer> db, int64_t centered, int64_t has_dz,
                        int64_t nthreads)
{
    int64_t D = last_dim(x), nb, rows;
    TRY(batches(x, weight, D, &nb, &rows));
    int xt = lnf_type(x.element_type());
    int ct = xt == LNF_FLOAT64 ? LNF_FLOAT64 : LNF_FLOAT32;
    int64_t n = nb * rows;
    TRY(sized(holds(dy, n * D, xt) && holds(*dx, n * D, xt), "dy or dx"));
    TRY(sized(holds(rstd, n, ct) && (!centered || holds(mean, n, ct)), "mean or rstd"));
    TRY(sized(!has_dz || holds(dz, n * D, xt), "dz"));
    TRY(sized(holds(*dw, nb * D, -1) && holds(*db, nb * D, -1), "dweight or dbias"));
    int wt = lnf_type(dw->element_type()), bt = lnf_type(db->element_type());
    huge_pages(*dx);
    std::vector<double> sums(2 * D);
    for (int64_t k = 0; k < nb; k++) {
        int64_t first = k * rows;
        std::fill(sums.begin(), sums.end(), 0.0);     // (no rows: zero gradients)
        if (rows) {
            lnf_backward_args a;
            std::memset(&a, 0, sizeof a);
            TRY(describe(&a.x, x, first, rows, D, "x"));
            TRY(describe(&a.dy, dy, first, rows, D, "dy"));
            TRY(describe(&a.dx, *dx, first, rows, D, "dx"));
            TRY(vector(&a.weight, weight, k, D, "weight"));
            if (has_dz)
                TRY(describe(&a.dz, dz, first, rows, D, "dz"));
            a.mean = centered ? (const char *)mean.untyped_data() + first * itemsize(ct)
                              : nullptr;
            a.rstd = (const char *)rstd.untyped_data() + first * itemsize(ct);
            a.dwdb = sums.data(), a.dwdb_dtype = LNF_FLOAT64;
            a.M = rows, a.D = D, a.nchunks = 0;
            a.has_dz = (int)has_dz, a.centered = (int)centered, a.nthreads = (int)nthreads;
            TRY(status(backward(&a), "the backward pass"));
        }
        // (each rounded once to its own type as the kernels round, in their
        // floating-point environment: XLA's threads flush subnormal values)
        round_sums(sums.data(), (char *)dw->untyped_data() + k * D * itemsize(wt), D, wt);
        round_sums(sums.data() + D, (char *)db->untyped_data() + k * D * itemsize(bt), D, bt);
    }
    return ffi::Error::Success();
}

}  // namespace

extern "C" void lnfast_ffi_set_api(void *init, void *fwd, void *bwd, void *round)
{
    array_init = (int (*)(lnf_array *, void *, int, int, const ptrdiff_t *,
                          const ptrdiff_t *))init;
    forward = (int (*)(const lnf_forward_args *))fwd;
    backward = (int (*)(const lnf_backward_args *))bwd;
    round_sums = (int (*)(const double *, void *, ptrdiff_t, int))round;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(lnfast_norm_forward, NormForward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // x
                                  .Arg<ffi::AnyBuffer>()   // residual (or empty)
                                  .Arg<ffi::AnyBuffer>()   // weight
                                  .Arg<ffi::AnyBuffer>()   // bias (or empty)
                                  .Ret<ffi::AnyBuffer>()   // y
                                  .Ret<ffi::AnyBuffer>()   // z (or empty)
                                  .Ret<ffi::AnyBuffer>()   // mean (or empty)
                                  .Ret<ffi::AnyBuffer>()   // rstd
                                  .Attr<double>("eps")
                                  .Attr<int64_t>("centered")
                                  .Attr<int64_t>("has_residual")
                                  .Attr<int64_t>("nthreads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(lnfast_norm_backward, NormBackward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // dy
                                  .Arg<ffi::AnyBuffer>()   // x (z for the fused step)
                                  .Arg<ffi::AnyBuffer>()   // mean (or empty)
                                  .Arg<ffi::AnyBuffer>()   // rstd
                                  .Arg<ffi::AnyBuffer>()   // weight
                                  .Arg<ffi::AnyBuffer>()   // dz (or empty)
                                  .Ret<ffi::AnyBuffer>()   // dx
                                  .Ret<ffi::AnyBuffer>()   // dweight
                                  .Ret<ffi::AnyBuffer>()   // dbias (zeros for RMSNorm)
                                  .Attr<int64_t>("centered")
                                  .Attr<int64_t>("has_dz")
                                  .Attr<int64_t>("nthreads"));
