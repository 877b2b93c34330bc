/* The kernel table: which build of the row operations each storage type
 * runs on this CPU, chosen once (lnf_select) rather than per row.  Every
 * build gives the same bits; the choice is speed only. */
#include "kernels.h"
#include "lnfast_cpu.h"

static lnf_kernels table[LNF_NDTYPES];
static int level = -1;     /* float32's: 0 baseline, 1 AVX2, 2 AVX-512; -1 none chosen */
/* Whether the tiles fetch columns' stretches ahead: on Intel's x86-64 CPUs,
 * where that paid; on AMD's a like scheme was slower (performance_axes.md). */
static int runs_ahead;

/* x86-64: 2 where AVX-512 may run below `limit`, 1 AVX2, 0 the baseline;
 * needs_f16c: the type's builds use F16C (float16) too. */
static int x86_level(int limit, int needs_f16c)
{
#if LNF_X86_UNITS
    if (limit < LNF_BASELINE && (!needs_f16c || lnf_has_f16c())) {
        if (limit < LNF_NO_AVX512 && __builtin_cpu_supports("avx512f"))
            return 2;
        if (__builtin_cpu_supports("avx2"))
            return 1;
    }
#else
    (void)limit;
    (void)needs_f16c;
#endif
    return 0;
}

/* The build of one storage type for `lvl` (x86_level). */
#define LNF_PICK(type, lvl)                                                    \
    ((lvl) == 2   ? &lnf_ops_##type##_avx512                                     \
     : (lvl) == 1 ? &lnf_ops_##type##_avx2                                       \
                  : &lnf_ops_##type##_baseline)

int lnf_select(int limit)
{
    lnf_kernels t[LNF_NDTYPES] = {
        [LNF_FLOAT32] = {&lnf_ops_f32_baseline, NULL, NULL},
        [LNF_FLOAT64] = {&lnf_ops_f64_baseline, NULL, NULL},
        [LNF_FLOAT16] = {&lnf_ops_f16_baseline, lnf_widen_f16_portable, lnf_narrow_f16_portable},
        [LNF_BFLOAT16] = {&lnf_ops_bf16_baseline, lnf_widen_bf16_portable,
                          lnf_narrow_bf16_portable},
    };
    int lvl = x86_level(limit, 0);
#if LNF_X86_UNITS
    int lvl16 = x86_level(limit, 1);
    t[LNF_FLOAT32].ops = LNF_PICK(f32, lvl);
    t[LNF_FLOAT64].ops = LNF_PICK(f64, lvl);
    t[LNF_FLOAT16].ops = LNF_PICK(f16, lvl16);
    t[LNF_BFLOAT16].ops = LNF_PICK(bf16, lvl);
#if LNF_BF16_UNITS
    if (lvl == 2 && limit < LNF_NO_BF16 && __builtin_cpu_supports("avx512bf16")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw"))
        t[LNF_BFLOAT16].ops = &lnf_ops_bf16_avx512bf16;
#endif
#endif
#if LNF_CPU_DISPATCH
    if (limit < LNF_BASELINE && lnf_has_f16c()) {
        t[LNF_FLOAT16].widen = lnf_widen_f16_f16c;
        t[LNF_FLOAT16].narrow = lnf_narrow_f16_f16c;
    }
#endif
#if LNF_NEON_UNITS
    if (limit < LNF_BASELINE) {
        t[LNF_FLOAT16] = (lnf_kernels){&lnf_ops_f16_neon, lnf_widen_f16_neon, lnf_narrow_f16_neon};
        t[LNF_BFLOAT16] = (lnf_kernels){&lnf_ops_bf16_neon, lnf_widen_bf16_neon,
                                        lnf_narrow_bf16_neon};
    }
#endif
    memcpy(table, t, sizeof table);
#if LNF_X86_UNITS
    runs_ahead = __builtin_cpu_is("intel");
#endif
    level = lvl;
    return lvl;
}
#undef LNF_PICK

const lnf_kernels *lnf_kernels_for(int dtype)
{
    if (level < 0)
        lnf_select(LNF_BEST);
    return &table[dtype];
}

int lnf_tile_runs_ahead(void)
{
    if (level < 0)
        lnf_select(LNF_BEST);
    return runs_ahead;
}

const char *lnf_simd_name(void)
{
    if (level < 0)
        lnf_select(LNF_BEST);
#if LNF_X86_UNITS
    static const char *const names[] = {"SSE2 (runtime dispatch)", "AVX2 (runtime dispatch)",
                                        "AVX-512 (runtime dispatch)"};
    return names[level];
#elif defined(__AVX512F__)
    return "AVX-512";
#elif defined(__AVX2__)
    return "AVX2";
#elif defined(__SSE2__) || defined(_M_X64)
    return "SSE2";
#elif defined(__ARM_NEON) || defined(_M_ARM64)
    return "NEON";
#else
    return "none";
#endif
}
