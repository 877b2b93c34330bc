// XLA FFI handlers (CPU) over lnfast's C API, for lnfast.jax.
//
// Built by lnfast/jax.py on first use, against jaxlib's FFI headers
// (jax.ffi.include_dir()) and lnfast's own C API header; it links nothing:
// the addresses of lnf_array_init, lnf_forward and lnf_backward come from
// the lnfast._cpu extension at load time (lnfast_ffi_set_api).
//
// Rows are the last axis of C-ordered buffers (XLA's default layout on the
// CPU).  Under jax.vmap the calls use vmap_method="broadcast_all": every
// argument then has the batch axes in front, weight and bias included, so
// a call is `nb` batches of rows, each with its own weight (nb is 1 outside
// vmap) and, in the backward, its own dweight/dbias.
#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"
#include "lnfast_cpu.h"

namespace ffi = xla::ffi;

namespace {

int (*array_init)(lnf_array *, void *, int, int, const ptrdiff_t *, const ptrdiff_t *);
int (*forward)(const lnf_forward_args *);
int (*backward)(const lnf_backward_args *);

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

// `rows` rows of D elements from row `first` of buffer b, C-ordered.
ffi::Error describe(lnf_array *a, const ffi::AnyBuffer &b, int64_t first, int64_t rows,
                    int64_t D, const char *name)
{
    int t = lnf_type(b.element_type());
    if (t < 0)
        return ffi::Error::InvalidArgument(std::string("lnfast: unsupported dtype of ") + name);
    ptrdiff_t shape[2] = {(ptrdiff_t)rows, (ptrdiff_t)D};
    ptrdiff_t strides[2] = {(ptrdiff_t)D * itemsize(t), itemsize(t)};
    char *base = (char *)b.untyped_data() + first * D * itemsize(t);
    if (array_init(a, base, t, 2, shape, strides) != LNF_OK)
        return ffi::Error::InvalidArgument(std::string("lnfast: cannot describe ") + name);
    return ffi::Error::Success();
}

// Vector k (of D elements) of weight or bias: one per batch.
ffi::Error vector(lnf_array *a, const ffi::AnyBuffer &b, int64_t k, int64_t D, const char *name)
{
    int t = lnf_type(b.element_type());
    if (t < 0)
        return ffi::Error::InvalidArgument(std::string("lnfast: unsupported dtype of ") + name);
    ptrdiff_t shape[1] = {(ptrdiff_t)D}, strides[1] = {itemsize(t)};
    char *base = (char *)b.untyped_data() + k * D * itemsize(t);
    if (array_init(a, base, t, 1, shape, strides) != LNF_OK)
        return ffi::Error::InvalidArgument(std::string("lnfast: cannot describe ") + name);
    return ffi::Error::Success();
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
    int ct = lnf_type(weight.element_type()) == LNF_FLOAT64 ? LNF_FLOAT64 : LNF_FLOAT32;
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
        a.mean = centered && mean->element_count() ? (char *)mean->untyped_data()
                                                     + first * itemsize(ct) : nullptr;
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
                        ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dwdb,
                        int64_t centered, int64_t has_dz, int64_t nthreads)
{
    int64_t D = last_dim(x), nb, rows;
    TRY(batches(x, weight, D, &nb, &rows));
    int ct = lnf_type(weight.element_type()) == LNF_FLOAT64 ? LNF_FLOAT64 : LNF_FLOAT32;
    int gt = lnf_type(dwdb->element_type());
    if (gt < 0 || (int64_t)dwdb->element_count() != nb * 2 * D)
        return ffi::Error::InvalidArgument("lnfast: dweight/dbias of the wrong type or shape");
    for (int64_t k = 0; k < nb; k++) {
        int64_t first = k * rows;
        char *out = (char *)dwdb->untyped_data() + k * 2 * D * itemsize(gt);
        if (rows == 0) {                        // (no rows: zero gradients)
            std::memset(out, 0, 2 * D * itemsize(gt));
            continue;
        }
        lnf_backward_args a;
        std::memset(&a, 0, sizeof a);
        TRY(describe(&a.x, x, first, rows, D, "x"));
        TRY(describe(&a.dy, dy, first, rows, D, "dy"));
        TRY(describe(&a.dx, *dx, first, rows, D, "dx"));
        TRY(vector(&a.weight, weight, k, D, "weight"));
        if (has_dz)
            TRY(describe(&a.dz, dz, first, rows, D, "dz"));
        a.mean = centered ? (const char *)mean.untyped_data() + first * itemsize(ct) : nullptr;
        a.rstd = (const char *)rstd.untyped_data() + first * itemsize(ct);
        a.dwdb = out, a.dwdb_dtype = gt;
        a.M = rows, a.D = D, a.nchunks = 0;
        a.has_dz = (int)has_dz, a.centered = (int)centered, a.nthreads = (int)nthreads;
        TRY(status(backward(&a), "the backward pass"));
    }
    return ffi::Error::Success();
}

}  // namespace

extern "C" void lnfast_ffi_set_api(void *init, void *fwd, void *bwd)
{
    array_init = (int (*)(lnf_array *, void *, int, int, const ptrdiff_t *,
                          const ptrdiff_t *))init;
    forward = (int (*)(const lnf_forward_args *))fwd;
    backward = (int (*)(const lnf_backward_args *))bwd;
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
                                  .Ret<ffi::AnyBuffer>()   // [dweight, dbias]
                                  .Attr<int64_t>("centered")
                                  .Attr<int64_t>("has_dz")
                                  .Attr<int64_t>("nthreads"));
