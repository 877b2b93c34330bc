// lnfast.torch's operators lnfast::norm and lnfast::norm_backward for CPU
// tensors, in C++: their kernels over lnfast's C API, their autograd
// (lnfast::norm's derivative an autograd node of its own; norm_backward
// has none), and the eager entry that lnfast.torch's functions call with
// plain CPU tensors, so that an eager call crosses from Python once, as a
// call of PyTorch's own operators does (docs/torch.md).
//
// lnfast/_torch_ops.py defines the operators (torch.library.custom_op:
// their schemas, fake kernels and the Python kernels that serve CUDA
// tensors), and lnfast/_torch_eager.py builds this on first import against PyTorch's headers
// (lnfast._build).  Loaded, it takes the CPU (kernels) and AutogradCPU
// (autograd) keys; it links none of lnfast: lnfast_torch_set_api hands it
// the C API's addresses, the output cache's and the thread count's
// (lnfast._threads.threads_for, asked per call with the GIL taken, so
// that the count is decided in one place).
//
// The kernels take any strides (rows whose elements are not adjacent are
// copied first: as_rows) and compute what the Python kernels compute, to
// the bit: the same C calls on the same rows, dweight and dbias summed in
// float64 and rounded once to the weight's dtype.
#include <Python.h>

// (the few ATen headers used, not ATen.h: a third less time to compile)
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros_like.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "lnfast_cpu.h"

namespace {

using at::Tensor;
using std::optional;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

int (*array_init)(lnf_array *, void *, int, int, const ptrdiff_t *, const ptrdiff_t *);
int (*forward_rows)(const lnf_forward_args *);
int (*backward_rows)(const lnf_backward_args *);
int (*round_sums)(const double *, void *, ptrdiff_t, int);
void *(*cache_malloc)(void *, size_t);
void (*cache_free)(void *, void *, size_t);
size_t cache_min = 0;
PyObject *threads_for = nullptr;        // lnfast._threads.threads_for
int64_t backward_min = 0;               // its min_elements for a backward call

int lnf_type(at::ScalarType t)
{
    switch (t) {
    case at::kFloat: return LNF_FLOAT32;
    case at::kDouble: return LNF_FLOAT64;
    case at::kHalf: return LNF_FLOAT16;
    case at::kBFloat16: return LNF_BFLOAT16;
    default: return -1;
    }
}

// The dtype of mean and rstd, and of dweight and dbias without a weight.
at::ScalarType compute_type(at::ScalarType t)
{
    return t == at::kDouble ? at::kDouble : at::kFloat;
}

// t, or an aligned copy: the kernels load elements of their own type (a
// tensor over a byte buffer may start anywhere).
Tensor aligned(const Tensor &t)
{
    return (uintptr_t)t.data_ptr() % t.element_size() ? t.clone() : t;
}

// The kernels' thread count for a call over n elements, from Python.
int threads(int64_t n, bool backward)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    PyObject *args[2] = {PyLong_FromLongLong(n), PyLong_FromLongLong(backward_min)};
    PyObject *r = args[0] != nullptr && args[1] != nullptr
                      ? PyObject_Vectorcall(threads_for, args, backward ? 2 : 1, nullptr)
                      : nullptr;
    Py_XDECREF(args[0]);
    Py_XDECREF(args[1]);
    long t = r != nullptr ? PyLong_AsLong(r) : -1;
    std::string error;
    if (PyErr_Occurred()) {             // (a bad LNFAST_NUM_THREADS: a ValueError)
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        PyObject *text = value != nullptr ? PyObject_Str(value) : nullptr;
        const char *s = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
        error = s != nullptr ? s : "lnfast could not choose a thread count";
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(trace);
        PyErr_Clear();
    }
    Py_XDECREF(r);
    PyGILState_Release(gil);
    TORCH_CHECK_VALUE(error.empty(), error);
    return (int)t;
}

// An output tensor; large ones from lnfast's output cache (already mapped
// and page-aligned, as lnfast's NumPy outputs are: _pool.h).
Tensor output(at::IntArrayRef sizes, at::ScalarType t)
{
    size_t n = (size_t)c10::multiply_integers(sizes) * at::elementSize(t);
    if (n < cache_min)
        return at::empty(sizes, at::TensorOptions().dtype(t));
    void *p = cache_malloc(nullptr, n);
    TORCH_CHECK(p != nullptr, "lnfast: out of memory for an output of ", n, " bytes");
    return at::from_blob(p, sizes, [n](void *q) { cache_free(nullptr, q, n); },
                         at::TensorOptions().dtype(t));
}

// The rows of D elements over the last k axes of t, whose elements are
// adjacent (as_rows), its leading axes with their own strides.
void rows(lnf_array *a, const Tensor &t, int64_t k, int64_t D)
{
    int dt = lnf_type(t.scalar_type());
    int64_t lead = t.dim() - k;
    std::vector<ptrdiff_t> shape(lead + 1), strides(lead + 1);
    for (int64_t d = 0; d < lead; d++) {
        shape[d] = (ptrdiff_t)t.size(d);
        strides[d] = (ptrdiff_t)(t.stride(d) * t.element_size());
    }
    shape[lead] = (ptrdiff_t)D;
    strides[lead] = (ptrdiff_t)t.element_size();
    TORCH_CHECK(dt >= 0 && array_init(a, t.data_ptr(), dt, (int)lead + 1, shape.data(),
                                      strides.data()) == LNF_OK,
                "lnfast: cannot describe a tensor of ", t.scalar_type());
}

// A vector of D elements (weight, bias).
void vector(lnf_array *a, const Tensor &t)
{
    ptrdiff_t n = t.numel(), stride = t.element_size();
    TORCH_CHECK(array_init(a, t.data_ptr(), lnf_type(t.scalar_type()), 1, &n, &stride) == LNF_OK,
                "lnfast: cannot describe a vector of ", t.scalar_type());
}

// weight or bias (`name`) as the kernels take it (lnfast._kernels.as_param):
// of x's dtype or float32 (lnfast.torch's rule), 16-bit or of the compute
// type as it is, else in the compute type; a constant where not given.
Tensor param(const optional<Tensor> &p, const Tensor &x, int64_t k, at::ScalarType ct,
             double fill, const char *name)
{
    at::IntArrayRef norm = x.sizes().slice(x.dim() - k);
    if (!p.has_value())
        return at::full({c10::multiply_integers(norm)}, fill, at::TensorOptions().dtype(ct));
    TORCH_CHECK_TYPE(p->scalar_type() == x.scalar_type() || p->scalar_type() == at::kFloat, name,
                     " must have input's dtype (", x.scalar_type(), ") or float32, got ",
                     p->scalar_type());
    TORCH_CHECK_VALUE(p->sizes() == norm, name, " must have shape ", norm,
                      " (the normalized axes'), got ", p->sizes());
    bool kept = p->scalar_type() == ct || p->element_size() == 2;
    return aligned((kept ? *p : p->to(ct)).contiguous());
}

// t as the kernels take its rows over the last k axes, aligned: where it
// lies when their elements are adjacent (the last k axes merge into one
// contiguous axis, whatever the leading axes' strides: the row kernels,
// which give such rows the bits of a contiguous copy, docs/api.md "Axes"),
// else a contiguous copy (the elements of strided rows would choose other
// kernels, and other bits); lnfast._torch_ops._rows' rule.
Tensor as_rows(const Tensor &t, int64_t k)
{
    bool adjacent = t.dim() - k <= LNF_MAX_LEAD;
    for (int64_t d = t.dim() - 1, n = 1; d >= t.dim() - k && adjacent; d--) {
        adjacent = t.size(d) == 1 || t.stride(d) == n;
        n *= t.size(d);
    }
    return aligned(adjacent ? t : t.contiguous());
}

// A tensor of x's shape and dtype (`name`), as the kernels take it (as_rows).
Tensor like_x(const Tensor &t, const Tensor &x, int64_t k, const char *name)
{
    TORCH_CHECK_VALUE(t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type(), name,
                      " must have x's shape and dtype (", x.sizes(), ", ", x.scalar_type(),
                      "), got (", t.sizes(), ", ", t.scalar_type(), ")");
    return as_rows(t, k);
}

void check(int status, const char *what)
{
    TORCH_CHECK(status == LNF_OK, "lnfast: ", what,
                status == LNF_ENOMEM ? " ran out of memory" : " was given arguments that do not fit");
}

// The row count and length of x over its last k axes.
std::pair<int64_t, int64_t> shape(const Tensor &x, int64_t k)
{
    TORCH_CHECK_TYPE(lnf_type(x.scalar_type()) >= 0,
                     "input must be float32, float64, float16 or bfloat16, got ", x.scalar_type());
    TORCH_CHECK_VALUE(k >= 1 && k <= x.dim(), "k: cannot normalize the last ", k, " axes of a ",
                      x.dim(), "-dimensional input");
    int64_t D = c10::multiply_integers(x.sizes().slice(x.dim() - k));
    TORCH_CHECK_VALUE(D >= 1, "normalized_shape must have no size 0 (D >= 1)");
    return {x.numel() / D, D};
}

std::tuple<Tensor, Tensor, Tensor, Tensor>
norm_cpu(const Tensor &x_, const optional<Tensor> &residual, const optional<Tensor> &weight,
         const optional<Tensor> &bias, c10::SymInt k_, double eps, bool centered)
{
    TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0, "eps must be finite and >= 0, got ", eps);
    int64_t k = k_.expect_int();
    auto [M, D] = shape(x_, k);
    Tensor x = as_rows(x_, k);
    at::ScalarType ct = compute_type(x.scalar_type());
    at::IntArrayRef lead = x.sizes().slice(0, x.dim() - k);
    bool fused = residual.has_value();
    TORCH_CHECK_VALUE(!fused || centered, "residual: the fused step is LayerNorm (centered)");
    Tensor r = fused ? like_x(*residual, x, k, "residual") : Tensor();
    Tensor y = output(x.sizes(), x.scalar_type());
    Tensor z = fused ? output(x.sizes(), x.scalar_type()) : x.new_empty({0});
    Tensor mean = centered ? output(lead, ct) : x.new_empty({0}, ct);
    Tensor rstd = output(lead, ct);
    Tensor w = param(weight, x, k, ct, 1.0, "weight");
    Tensor b = centered ? param(bias, x, k, ct, 0.0, "bias") : Tensor();
    if (M == 0)
        return {y, z, mean, rstd};
    lnf_forward_args a;
    std::memset(&a, 0, sizeof a);
    rows(&a.x, x, k, D);
    rows(&a.y, y, k, D);
    if (fused) {
        rows(&a.residual, r, k, D);
        rows(&a.z, z, k, D);
    }
    vector(&a.weight, w);
    if (centered)
        vector(&a.bias, b);
    a.weight_len = a.bias_len = D;
    a.mean = centered ? mean.data_ptr() : nullptr;
    a.rstd = rstd.data_ptr();
    a.M = M, a.D = D, a.eps = eps;
    a.has_residual = fused, a.centered = centered;
    a.nthreads = threads(M * D, false);
    check(forward_rows(&a), "the forward pass");
    return {y, z, mean, rstd};
}

// dweight or dbias of the normalized shape from its float64 sums, rounded
// once to t as the kernels round them (lnf_round_sums: in their
// floating-point environment, not the caller's).
Tensor rounded(const double *sums, at::IntArrayRef norm, at::ScalarType t)
{
    Tensor out = at::empty(norm, at::TensorOptions().dtype(t));
    round_sums(sums, out.data_ptr(), out.numel(), lnf_type(t));
    return out;
}

std::tuple<Tensor, Tensor, Tensor>
norm_backward_cpu(const Tensor &dy_, const Tensor &x_, const Tensor &mean_, const Tensor &rstd_,
                  const optional<Tensor> &weight, const optional<Tensor> &dz_, c10::SymInt k_,
                  bool centered)
{
    int64_t k = k_.expect_int();
    auto [M, D] = shape(x_, k);
    Tensor x = as_rows(x_, k);
    at::ScalarType ct = compute_type(x.scalar_type());
    at::ScalarType gt = weight.has_value() ? weight->scalar_type() : ct;   // dweight's dtype
    Tensor dy = like_x(dy_, x, k, "dy");
    Tensor dz = dz_.has_value() ? like_x(*dz_, x, k, "dz") : Tensor();
    // (.to() only where needed: a no-op .to() is a dispatched call too)
    Tensor rstd = aligned((rstd_.scalar_type() == ct ? rstd_ : rstd_.to(ct)).contiguous());
    Tensor mean = !centered                   ? Tensor()
                  : mean_.scalar_type() == ct ? aligned(mean_.contiguous())
                                              : aligned(mean_.to(ct).contiguous());
    TORCH_CHECK_VALUE(rstd.numel() == M, "rstd must have one value per row (", M, "), got ",
                      rstd.numel());
    TORCH_CHECK_VALUE(!centered || mean.numel() == M, "mean must have one value per row (", M,
                      "), got ", mean.numel());
    Tensor w = param(weight, x, k, ct, 1.0, "weight");
    Tensor dx = output(x.sizes(), x.scalar_type());
    std::vector<double> sums(2 * D, 0.0);      // (no rows: zero gradients)
    if (M > 0) {
        lnf_backward_args a;
        std::memset(&a, 0, sizeof a);
        rows(&a.x, x, k, D);
        rows(&a.dy, dy, k, D);
        rows(&a.dx, dx, k, D);
        if (dz.defined())
            rows(&a.dz, dz, k, D);
        vector(&a.weight, w);
        a.mean = centered ? mean.data_ptr() : nullptr;
        a.rstd = rstd.data_ptr();
        a.dwdb = sums.data(), a.dwdb_dtype = LNF_FLOAT64;
        a.M = M, a.D = D, a.nchunks = 0;
        a.has_dz = dz.defined(), a.centered = centered;
        a.nthreads = threads(M * D, true);
        check(backward_rows(&a), "the backward pass");
    }
    at::IntArrayRef norm = x.sizes().slice(x.dim() - k);
    Tensor dw = rounded(sums.data(), norm, gt);
    Tensor db = centered ? rounded(sums.data() + D, norm, gt) : x.new_empty({0}, gt);
    return {dx, dw, db};
}

// --- autograd ------------------------------------------------------------------

using NormSig = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor &, const optional<Tensor> &, const optional<Tensor> &, const optional<Tensor> &,
    c10::SymInt, double, bool);
using NormBackwardSig = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor &, const Tensor &, const Tensor &, const Tensor &, const optional<Tensor> &,
    const optional<Tensor> &, c10::SymInt, bool);

c10::TypedOperatorHandle<NormSig> norm_op()
{
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("lnfast::norm", "")
                         .typed<NormSig>();
    return op;
}

c10::TypedOperatorHandle<NormBackwardSig> norm_backward_op()
{
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("lnfast::norm_backward", "")
                         .typed<NormBackwardSig>();
    return op;
}

// lnfast::norm's derivative (lnfast/_torch_ops.py's _op_backward, for CPU
// tensors), an autograd node of its own, as PyTorch's operators have: the
// backward operator called below autograd, so that torch.compile traces
// through its fake kernel; with create_graph, through autograd, where its
// lack of a derivative is PyTorch's error.  Its inputs (the forward's
// outputs) are y, and z for the fused step; its outputs the gradients of
// x, residual, weight and bias.
struct NormBackward : public torch::autograd::Node {
    SavedVariable src;              // x, or z for the fused step
    SavedVariable mean, rstd, weight;
    c10::SymInt k;
    bool centered = true, fused = false;
    optional<at::ScalarType> bias_dtype;    // (where there is a bias)

    std::string name() const override { return "LnfastNormBackward"; }

    void release_variables() override
    {
        std::lock_guard<std::mutex> lock(mutex_);
        src.reset_data();
        mean.reset_data();
        rstd.reset_data();
        weight.reset_data();
    }

    variable_list apply(variable_list &&grads) override
    {
        std::lock_guard<std::mutex> lock(mutex_);
        Tensor s = src.unpack(getptr()), m = mean.unpack(), r = rstd.unpack();
        Tensor wt = weight.unpack();
        optional<Tensor> w = wt.defined() ? optional<Tensor>(wt) : std::nullopt, dz;
        Tensor dy = grads[0].defined() ? grads[0] : at::zeros_like(s);
        if (fused)      // (z has no gradient slot where it took no history)
            dz = grads.size() > 1 && grads[1].defined() ? grads[1] : at::zeros_like(s);
        auto call = [&](const optional<Tensor> &ww) {
            if (at::GradMode::is_enabled())
                return norm_backward_op().call(dy, s, m, r, ww, dz, k, centered);
            at::AutoDispatchBelowADInplaceOrView below;
            return norm_backward_op().call(dy, s, m, r, ww, dz, k, centered);
        };
        auto [dx, dw, db] = call(w);
        // A bias of another dtype than the weight's: the backward again with
        // the weight in the bias's dtype (ones where there is none) gives
        // dbias, which does not depend on the weight, rounded once from its
        // float64 sums to the bias's own dtype (lnfast/_torch_ops.py's _as_bias).
        if (bias_dtype && *bias_dtype != db.scalar_type()) {
            int64_t kk = k.expect_int();
            db = std::get<2>(call(w ? w->detach().to(*bias_dtype)
                                    : at::ones_symint(s.sym_sizes().slice(s.dim() - kk),
                                                      at::TensorOptions().dtype(*bias_dtype))));
        }
        return {dx, fused ? dx : Tensor(), w ? dw : Tensor(), bias_dtype ? db : Tensor()};
    }
};

std::tuple<Tensor, Tensor, Tensor, Tensor>
norm_autograd(const Tensor &x, const optional<Tensor> &residual, const optional<Tensor> &weight,
              const optional<Tensor> &bias, c10::SymInt k, double eps, bool centered)
{
    auto dual = [](const optional<Tensor> &t) { return t && t->_fw_grad(0).defined(); };
    TORCH_CHECK_NOT_IMPLEMENTED(!dual(x) && !dual(residual) && !dual(weight) && !dual(bias),
                                "lnfast::norm computes no forward-mode derivative (jvp): its "
                                "inputs must not be dual tensors");
    bool fused = residual.has_value();
    c10::intrusive_ptr<NormBackward> node;
    if (torch::autograd::compute_requires_grad(x, residual, weight, bias)) {
        node = c10::make_intrusive<NormBackward>();
        node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight, bias));
    }
    auto out = [&] {
        at::AutoDispatchBelowADInplaceOrView below;
        return norm_op().call(x, residual, weight, bias, k, eps, centered);
    }();
    if (node) {         // (mean, rstd and an unused z: no history, no gradient)
        Tensor &y = std::get<0>(out), &z = std::get<1>(out);
        torch::autograd::set_history(y, node);
        // z = x + residual needs a gradient only where x or residual does,
        // as torch's sum would (not where only the weight or bias does)
        if (fused && torch::autograd::compute_requires_grad(x, residual))
            torch::autograd::set_history(z, node);
        node->src = SavedVariable(fused ? z : x, fused);
        node->mean = SavedVariable(std::get<2>(out), false);
        node->rstd = SavedVariable(std::get<3>(out), false);
        node->weight = SavedVariable(weight, false);
        node->k = k;
        node->centered = centered, node->fused = fused;
        if (bias)
            node->bias_dtype = bias->scalar_type();
    }
    return out;
}

// --- the eager entry point --------------------------------------------------------

// An argument of eager(): a plain CPU tensor (torch.Tensor or
// torch.nn.Parameter, strided, not nested), else null.
const Tensor *cpu_tensor(PyObject *o)
{
    if (!THPVariable_CheckExact(o))
        return nullptr;
    const Tensor &t = THPVariable_Unpack(o);
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && !t.is_nested()
               ? &t : nullptr;
}

// k, the number of x's last axes that normalized_shape (an int, a tuple or
// a torch.Size of ints, none a subclass) names, or 0 where it names none
// of the sizes it must.
int64_t trailing(PyObject *shape, const Tensor &x)
{
    int64_t n = x.dim();
    auto same = [&](PyObject *v, int64_t i) {
        int over = 0;
        long long s = PyLong_CheckExact(v) ? PyLong_AsLongLongAndOverflow(v, &over) : 0;
        return over == 0 && s > 0 && s == x.size(i);
    };
    if (PyLong_CheckExact(shape))
        return n >= 1 && same(shape, n - 1) ? 1 : 0;
    int64_t k = PyTuple_CheckExact(shape) || THPSize_Check(shape) ? PyTuple_GET_SIZE(shape) : 0;
    if (k > n)
        return 0;
    for (int64_t i = 0; i < k; i++)
        if (!same(PyTuple_GET_ITEM(shape, i), n - k + i))
            return 0;
    return k;
}

// weight, bias or residual for eager(): true for None (p left empty) and
// for a plain CPU tensor of `sizes` in x's dtype, or float32 where
// `f32` (p set to it).
bool fits(PyObject *o, const Tensor &x, at::IntArrayRef sizes, bool f32, optional<Tensor> &p)
{
    if (o == Py_None)
        return true;
    const Tensor *t = cpu_tensor(o);
    if (t == nullptr || t->sizes() != sizes
        || (t->scalar_type() != x.scalar_type() && !(f32 && t->scalar_type() == at::kFloat)))
        return false;
    p = *t;
    return true;
}

// lnfast.torch's eager call for CPU tensors, from Python in one step:
// eager(x, normalized_shape, residual, weight, bias, eps, mode), mode 0
// LayerNorm, 1 RMSNorm (eps None: torch.finfo's), 2 the fused step; y, or
// (y, z) for mode 2, through the lnfast::norm operator as torch.ops calls
// it (the dispatcher: autograd, profiling, dispatch modes).  None where
// the arguments are not all that this takes: anything else (other
// tensors, devices, dtypes, shapes; a torch function mode; torch.jit.trace,
// which torch.onnx.export runs) goes to lnfast/torch.py's general path,
// which checks and names what is wrong.
PyObject *eager(PyObject *, PyObject *const *args, Py_ssize_t nargs)
{
    HANDLE_TH_ERRORS
    int over = 0;
    long mode = nargs == 7 && PyLong_CheckExact(args[6])
                    ? PyLong_AsLongAndOverflow(args[6], &over) : -1;
    const Tensor *px = mode >= 0 && mode <= 2 && over == 0 ? cpu_tensor(args[0]) : nullptr;
    if (px == nullptr || lnf_type(px->scalar_type()) < 0
        || at::impl::torch_function_mode_enabled() || torch::jit::tracer::isTracing())
        Py_RETURN_NONE;
    Tensor x = *px;     // (its own reference, held while the GIL is released)
    int64_t k = trailing(args[1], x);
    if (k == 0)
        Py_RETURN_NONE;
    at::IntArrayRef norm = x.sizes().slice(x.dim() - k);
    optional<Tensor> residual, weight, bias;
    if ((mode == 2) != (args[2] != Py_None) || !fits(args[2], x, x.sizes(), false, residual)
        || !fits(args[3], x, norm, true, weight) || (mode == 1 && args[4] != Py_None)
        || !fits(args[4], x, norm, true, bias))
        Py_RETURN_NONE;
    double eps;
    if (mode == 1 && args[5] == Py_None) {      // (as torch: float64's eps, else float32's)
        eps = x.scalar_type() == at::kDouble ? 0x1p-52 : 0x1p-23;
    } else if (PyFloat_CheckExact(args[5])) {
        eps = PyFloat_AS_DOUBLE(args[5]);
        if (!(std::isfinite(eps) && eps >= 0.0))
            Py_RETURN_NONE;
    } else {
        Py_RETURN_NONE;
    }
    std::tuple<Tensor, Tensor, Tensor, Tensor> out;
    {
        pybind11::gil_scoped_release unlocked;
        out = norm_op().call(x, residual, weight, bias, c10::SymInt(k), eps, mode != 1);
    }
    if (mode != 2)
        return THPVariable_Wrap(std::move(std::get<0>(out)));
    PyObject *y = THPVariable_Wrap(std::move(std::get<0>(out)));
    PyObject *z = y != nullptr ? THPVariable_Wrap(std::move(std::get<1>(out))) : nullptr;
    PyObject *yz = z != nullptr ? PyTuple_Pack(2, y, z) : nullptr;
    Py_XDECREF(y);
    Py_XDECREF(z);
    return yz;
    END_HANDLE_TH_ERRORS
}

PyMethodDef eager_def = {"eager", (PyCFunction)(void (*)())eager, METH_FASTCALL,
                         "lnfast.torch's eager call for CPU tensors (lnfast_torch.cc)"};

}  // namespace

TORCH_LIBRARY_IMPL(lnfast, CPU, m)
{
    m.impl("norm", TORCH_FN(norm_cpu));
    m.impl("norm_backward", TORCH_FN(norm_backward_cpu));
}

// lnfast::norm_backward has no derivative: where a gradient of its outputs
// could be asked for, they get PyTorch's node that says so; else it goes
// straight below autograd (a compiled graph's backward calls it with
// gradients off: PyTorch's own autograd kernel for a custom operator
// without a derivative would cross into Python for that).
TORCH_LIBRARY_IMPL(lnfast, AutogradCPU, m)
{
    m.impl("norm", TORCH_FN(norm_autograd));
    m.impl("norm_backward", torch::autograd::autogradNotImplementedFallback());
}

extern "C" void lnfast_torch_set_api(void *init, void *fwd, void *bwd, void *round,
                                     void *cmalloc, void *cfree, size_t cmin, PyObject *threads,
                                     int64_t bmin)
{
    array_init = (int (*)(lnf_array *, void *, int, int, const ptrdiff_t *,
                          const ptrdiff_t *))init;
    forward_rows = (int (*)(const lnf_forward_args *))fwd;
    backward_rows = (int (*)(const lnf_backward_args *))bwd;
    round_sums = (int (*)(const double *, void *, ptrdiff_t, int))round;
    cache_malloc = (void *(*)(void *, size_t))cmalloc;
    cache_free = (void (*)(void *, void *, size_t))cfree;
    cache_min = cmin;
    Py_XINCREF(threads);
    Py_XDECREF(threads_for);
    threads_for = threads;
    backward_min = bmin;
}

// eager() as a Python function, made once: a new reference on each call
// (ctypes' py_object result takes one over).
extern "C" PyObject *lnfast_torch_eager(void)
{
    static PyObject *f = PyCFunction_New(&eager_def, nullptr);
    Py_XINCREF(f);
    return f;
}
