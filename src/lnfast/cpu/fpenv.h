/* The floating-point environment the kernels compute in: IEEE's defaults
 * (round to nearest even, subnormals kept), whatever the calling thread
 * has set.  XLA runs custom calls with flush-to-zero on, PyTorch's
 * set_flush_denormal turns it on, and OpenMP's threads keep what they were
 * started with; left as found, a row with subnormal values would give
 * bits that depend on the caller and on the thread that took it.  Each
 * entry point and each thread of a parallel region enters the default
 * environment and leaves it as it was (exception flags included).  The
 * arithmetic between the two is in calls the compiler does not see into
 * (the row operations through their dispatch table), so it is not moved
 * across the switch. */
#ifndef LNFAST_CPU_FPENV_H
#define LNFAST_CPU_FPENV_H

#if defined(__SSE2__) || defined(_M_X64) || (defined(_M_IX86_FP) && _M_IX86_FP >= 2)
#include <xmmintrin.h>
typedef unsigned int lnf_fpenv;
/* MXCSR: every exception masked, round to nearest, no FTZ or DAZ. */
static inline lnf_fpenv lnf_fpenv_enter(void)
{
    lnf_fpenv old = _mm_getcsr();
    _mm_setcsr(0x1F80);
    return old;
}
static inline void lnf_fpenv_leave(lnf_fpenv old) { _mm_setcsr(old); }
#elif defined(__aarch64__) && defined(__GNUC__)
typedef unsigned long long lnf_fpenv;
/* FPCR 0: round to nearest, no flush-to-zero (FZ, FZ16), no traps. */
static inline lnf_fpenv lnf_fpenv_enter(void)
{
    lnf_fpenv old;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(old));
    __asm__ __volatile__("msr fpcr, %0" : : "r"(0ULL) : "memory");
    return old;
}
static inline void lnf_fpenv_leave(lnf_fpenv old)
{
    __asm__ __volatile__("msr fpcr, %0" : : "r"(old) : "memory");
}
#else
typedef int lnf_fpenv;   /* (elsewhere the caller's environment stands) */
static inline lnf_fpenv lnf_fpenv_enter(void) { return 0; }
static inline void lnf_fpenv_leave(lnf_fpenv old) { (void)old; }
#endif

#endif
