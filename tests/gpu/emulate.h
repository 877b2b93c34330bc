// Runs CUDA kernels (src/lnfast/kernels/norm.cu) on the CPU, where no GPU is
// at hand: the CUDA types and intrinsics norm.cu uses, and launch(), which
// runs a grid block after block, each CUDA thread a fiber (ucontext) taking
// turns on one OS thread.  __syncthreads is a block barrier and
// __shfl_xor_sync a warp barrier around a shared slot array; a fiber that
// waits yields to the next.  This checks the kernels' logic (indexing,
// reductions, strides, packs, 16-bit conversions) and that every thread of a
// block reaches the same barriers; it says nothing about speed, lockstep
// warps or the memory model.
//
// Include this, then the kernels' source.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <type_traits>
#include <memory>
#include <vector>
#include <ucontext.h>

// (the CPU kernels' scalar conversions only: no vectors, no dispatch)
#define LNFAST_NO_VECTOR
#define LNFAST_NO_DISPATCH
#include "cpu/halfconv.h"

struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
inline float __half2float(__half h) { return lnf_f16_to_f32(h.x); }
inline float __bfloat162float(__nv_bfloat16 h) { return lnf_bf16_to_f32(h.x); }
inline __half __float2half_rn(float f) { return {lnf_f32_to_f16(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {lnf_f32_to_bf16(f)}; }
inline unsigned __float_as_uint(float f) { return lnf_bits(f); }
inline float __uint_as_float(unsigned u) { return lnf_float(u); }
inline double __longlong_as_double(long long v)
{
    double d;
    memcpy(&d, &v, sizeof d);
    return d;
}
inline long long __double_as_longlong(double d)
{
    long long v;
    memcpy(&v, &d, sizeof v);
    return v;
}

struct Dim3 { unsigned x = 0, y = 0, z = 0; };
// One fiber runs at a time: the scheduler sets threadIdx before resuming it.
inline Dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace lnf_emu {

struct Fiber {
    ucontext_t ctx;
    std::unique_ptr<char[]> stack;
    bool done;
};
inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline std::function<void()> body;      // the kernel call every fiber makes
inline unsigned long long progress;      // barriers completed + fibers finished
constexpr size_t STACK = 256 << 10;

inline void yield() { swapcontext(&fibers[threadIdx.x].ctx, &scheduler); }

// A barrier of n fibers: the last to arrive releases the others.
struct Barrier {
    unsigned n, arrived = 0, generation = 0;
    void arrive_and_wait()
    {
        unsigned g = generation;
        if (++arrived == n) {
            arrived = 0, generation++, progress++;
            return;
        }
        while (generation == g)
            yield();
    }
};
inline Barrier block_barrier{0};
inline std::vector<Barrier> warp_barriers;
inline double slots[1024];

inline void fiber_main()
{
    body();
    fibers[threadIdx.x].done = true;
    progress++;
}

// Runs body() as `block` CUDA threads of each of `grid` blocks.  Exits with a
// message if the threads of a block stop at different barriers (undefined
// behaviour on a GPU, often a hang).
inline void run_grid(unsigned grid, unsigned block)
{
    if (block == 0 || block > 1024 || block % 32) {
        fprintf(stderr, "emulate: %u threads per block (want a multiple of 32, <= 1024)\n", block);
        exit(3);
    }
    gridDim.x = grid, blockDim.x = block;
    if (fibers.size() < block)
        fibers.resize(block);
    for (unsigned b = 0; b < grid; b++) {
        blockIdx.x = b;
        block_barrier = Barrier{block};
        warp_barriers.assign(block / 32, Barrier{32});
        for (unsigned t = 0; t < block; t++) {
            Fiber &f = fibers[t];
            if (!f.stack)
                f.stack.reset(new char[STACK]);
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = f.stack.get();
            f.ctx.uc_stack.ss_size = STACK;
            f.ctx.uc_link = &scheduler;
            makecontext(&f.ctx, fiber_main, 0);
            f.done = false;
        }
        for (unsigned left = block, stalled = 0; left > 0;) {
            unsigned long long before = progress;
            for (unsigned t = 0; t < block; t++) {
                if (fibers[t].done)
                    continue;
                threadIdx.x = t;
                swapcontext(&scheduler, &fibers[t].ctx);
                left -= fibers[t].done;
            }
            stalled = progress == before ? stalled + 1 : 0;
            if (stalled > 1) {
                fprintf(stderr, "emulate: block %u: threads wait at different barriers\n", b);
                exit(4);
            }
        }
    }
}

}  // namespace lnf_emu

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define LNF_EMULATE 1
inline void __syncthreads() { lnf_emu::block_barrier.arrive_and_wait(); }
inline double __shfl_xor_sync(unsigned, double v, int off)
{
    unsigned t = threadIdx.x;
    lnf_emu::slots[t] = v;
    lnf_emu::warp_barriers[t / 32].arrive_and_wait();
    double r = lnf_emu::slots[t ^ off];
    lnf_emu::warp_barriers[t / 32].arrive_and_wait();
    return r;
}

// CuPy compiles every kernel with -ftz=true: float32 arithmetic reads and
// writes subnormals as zero, float64 arithmetic keeps them.  Launches model
// it with the CPU's own modes (x86-64: MXCSR's FTZ and DAZ; aarch64:
// FPCR.FZ), which flush float64 subnormals too, so they flush only kernels
// whose first argument is not a float64 array: those of float32 and 16-bit
// rows, whose float64 paths stay far above float64's subnormals (below
// 2.2e-308).  A float64 row's kernels, whose rows past its sums' range are
// scaled by powers of two down to 2^-1025, run unflushed, as on a GPU;
// elsewhere launches run without flushing.  The fibers' contexts are made
// inside run_grid, so they start in that mode.
#if defined(__x86_64__)
#include <xmmintrin.h>
struct lnf_emu_flush {
    unsigned saved = _mm_getcsr();
    explicit lnf_emu_flush(bool on) { _mm_setcsr(on ? saved | 0x8040u : saved); }
    ~lnf_emu_flush() { _mm_setcsr(saved); }
};
#elif defined(__aarch64__)
struct lnf_emu_flush {
    unsigned long saved;
    explicit lnf_emu_flush(bool on)
    {
        __asm__ volatile("mrs %0, fpcr" : "=r"(saved));
        __asm__ volatile("msr fpcr, %0" : : "r"(on ? saved | (1ul << 24) : saved));
    }
    ~lnf_emu_flush() { __asm__ volatile("msr fpcr, %0" : : "r"(saved)); }
};
#else
struct lnf_emu_flush {
    explicit lnf_emu_flush(bool) {}
};
#endif

namespace lnf_emu {
// Whether a kernel's first parameter is a pointer to float64 elements.
template <class P0, class... P> constexpr bool float64_rows(void (*)(P0, P...))
{
    return std::is_same_v<std::remove_cv_t<std::remove_pointer_t<P0>>, double>;
}
}  // namespace lnf_emu

// kernel<<<grid, block>>>(args...)
template <class... P, class... A>
void launch(unsigned grid, unsigned block, void (*kernel)(P...), A... args)
{
    lnf_emu::body = [=] { kernel(args...); };
    lnf_emu_flush flush(!lnf_emu::float64_rows(kernel));
    lnf_emu::run_grid(grid, block);
}

// --- launching from packed arguments, as CuPy's RawKernel does -------------
//
// args[i] points at argument i's bytes; kind[i] is 'a' for an array (the
// bytes are its address), 'n' for a null pointer (a zero integer) or 's' for
// a scalar, cls[i] is its element or scalar class ('f' floating, 'i' signed,
// 'u' unsigned) and size[i] its byte size.  Each argument must match the
// kernel's parameter type: a wrong size or class, which a GPU would read as
// garbage, is reported in `err` instead of launched.

#include <utility>

namespace lnf_emu {

template <class T> constexpr char cls()
{
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, __half> ||
                  std::is_same_v<T, __nv_bfloat16>)
        return 'f';
    else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>)
        return 'i';
    else if constexpr (std::is_integral_v<T>)
        return 'u';
    return '?';
}

template <class P>
bool check_arg(int i, char kind, char c, long size, char *err, size_t n)
{
    if constexpr (std::is_pointer_v<P>) {
        typedef std::remove_cv_t<std::remove_pointer_t<P>> E;
        if (kind == 'n' && size == sizeof(void *))
            return true;
        if (kind == 'a' && c == cls<E>() && size == (long)sizeof(E))
            return true;
        snprintf(err, n, "argument %d: the kernel takes a pointer to elements of %zu bytes "
                 "('%c'), got %s of %ld bytes ('%c')", i, sizeof(E), cls<E>(),
                 kind == 'a' ? "an array with elements" : "a scalar", size, c);
    } else {
        if (kind == 's' && c == cls<P>() && size == (long)sizeof(P))
            return true;
        snprintf(err, n, "argument %d: the kernel takes a scalar of %zu bytes ('%c'), "
                 "got %s of %ld bytes ('%c')", i, sizeof(P), cls<P>(),
                 kind == 's' ? "a scalar" : "an array with elements", size, c);
    }
    return false;
}

template <class... P, size_t... I>
int packed_launch(void (*kernel)(P...), std::index_sequence<I...>, unsigned grid,
                  unsigned block, void **args, const char *kind, const char *c,
                  const long *size, char *err, size_t n)
{
    if (!(check_arg<P>((int)I, kind[I], c[I], size[I], err, n) && ...))
        return 1;
    launch(grid, block, kernel, *static_cast<P *>(args[I])...);
    return 0;
}

// The entry point of one kernel: checks the argument count, then launches.
template <auto K> struct Entry;
template <class... P, void (*K)(P...)> struct Entry<K> {
    static int run(unsigned grid, unsigned block, int nargs, void **args, const char *kind,
                   const char *c, const long *size, char *err, size_t n)
    {
        if (nargs != (int)sizeof...(P)) {
            snprintf(err, n, "the kernel takes %zu arguments, got %d", sizeof...(P), nargs);
            return 1;
        }
        return packed_launch(K, std::index_sequence_for<P...>{}, grid, block, args, kind, c,
                             size, err, n);
    }
};

}  // namespace lnf_emu
