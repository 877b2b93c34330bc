/* The memory floor of the channels-first access patterns, without their
 * arithmetic, for a float32 (32, 96, 56, 56) array, best of 7 calls each.
 * The backward's: read x and dy, write dx (streaming stores), three ways:
 *   sequential  the arrays in memory order (what a copy does)
 *   tiles       16 rows side by side, column by column (tileops.h), one
 *               sweep, prefetching 4 tiles ahead into the L2
 *   two sweeps  as tiles, but the sums' sweep keeps x and dy in a copy
 *               and the map's sweep reads it back (backward_tiles)
 * The forward's: read x, write y, two sweeps as forward_tiles does, a
 * tile at a time (forward 1) and two adjacent tiles at once (forward 2).
 * Build and run (x86-64 with AVX-512; docs/performance_axes.md):
 *   gcc -O2 -fopenmp benchmarks/tile_floor.c -o tile_floor
 *   OMP_NUM_THREADS=2 ./tile_floor
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

enum { N = 32, C = 96, HW = 3136, T = 16 };

#define AVX512 __attribute__((target("avx512f")))

AVX512 static void sequential(const float *x, const float *dy, float *dx)
{
#pragma omp parallel for schedule(static)
    for (size_t j = 0; j < (size_t)N * C * HW; j += T)
        _mm512_stream_ps(dx + j, _mm512_add_ps(_mm512_loadu_ps(x + j), _mm512_loadu_ps(dy + j)));
    _mm_sfence();
}

AVX512 static void tiles(const float *x, const float *dy, float *dx, int two_sweeps)
{
#pragma omp parallel
    {
        float *keep = aligned_alloc(64, 2 * C * T * sizeof(float));
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++)
            for (int t = 0; t < HW; t += T) {
                __m512 s = _mm512_setzero_ps();
                for (int i = 0; i < C; i++) {
                    size_t o = ((size_t)n * C + i) * HW + t;
                    _mm_prefetch((const char *)(x + o + 4 * T), _MM_HINT_T2);
                    _mm_prefetch((const char *)(dy + o + 4 * T), _MM_HINT_T2);
                    __m512 a = _mm512_loadu_ps(x + o), b = _mm512_loadu_ps(dy + o);
                    if (two_sweeps) {
                        _mm512_store_ps(keep + i * T, a);
                        _mm512_store_ps(keep + (C + i) * T, b);
                        s = _mm512_add_ps(s, _mm512_mul_ps(a, b));
                    } else {
                        _mm512_stream_ps(dx + o, _mm512_add_ps(a, b));
                    }
                }
                for (int i = 0; i < C && two_sweeps; i++) {
                    size_t o = ((size_t)n * C + i) * HW + t;
                    __m512 a = _mm512_load_ps(keep + i * T), b = _mm512_load_ps(keep + (C + i) * T);
                    _mm512_stream_ps(dx + o, _mm512_sub_ps(_mm512_mul_ps(a, s), b));
                }
            }
        free(keep);
    }
    _mm_sfence();
}

/* The forward's two sweeps over `pair` adjacent tiles at a time (1 or 2). */
AVX512 static void forward(const float *x, float *y, int pair)
{
#pragma omp parallel
    {
        float *keep = aligned_alloc(64, 2 * C * T * sizeof(float));
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++)
            for (int t = 0; t < HW; t += pair * T) {
                int w = (HW - t) / T < pair ? (HW - t) / T : pair;
                __m512 s[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int i = 0; i < C; i++)
                    for (int k = 0; k < w; k++) {
                        size_t o = ((size_t)n * C + i) * HW + t + k * T;
                        _mm_prefetch((const char *)(x + o + 4 * T), _MM_HINT_T2);
                        __m512 a = _mm512_loadu_ps(x + o);
                        _mm512_store_ps(keep + (k * C + i) * T, a);
                        s[k] = _mm512_add_ps(s[k], _mm512_mul_ps(a, a));
                    }
                for (int i = 0; i < C; i++)
                    for (int k = 0; k < w; k++) {
                        size_t o = ((size_t)n * C + i) * HW + t + k * T;
                        __m512 a = _mm512_load_ps(keep + (k * C + i) * T);
                        _mm512_stream_ps(y + o, _mm512_mul_ps(a, s[k]));
                    }
            }
        free(keep);
    }
    _mm_sfence();
}

int main(void)
{
    if (!__builtin_cpu_supports("avx512f")) {
        puts("tile_floor: needs AVX-512");
        return 0;
    }
    size_t n = (size_t)N * C * HW;
    float *x = aligned_alloc(4096, n * 4), *dy = aligned_alloc(4096, n * 4);
    float *dx = aligned_alloc(4096, n * 4);
    for (size_t j = 0; j < n; j++)
        x[j] = dy[j] = dx[j] = 1.0f;
    const char *names[] = {"sequential", "tiles", "two sweeps", "forward 1", "forward 2"};
    for (int way = 0; way < 5; way++) {
        double best = 1e9;
        for (int k = 0; k < 7; k++) {
            double t0 = omp_get_wtime();
            if (way == 0)
                sequential(x, dy, dx);
            else if (way < 3)
                tiles(x, dy, dx, way == 2);
            else
                forward(x, dx, way - 2);
            double t = omp_get_wtime() - t0;
            best = t < best ? t : best;
        }
        printf("%-10s %6.2f ms %5.1f GB/s\n", names[way], best * 1e3,
               (way < 3 ? 3.0 : 2.0) * n * 4 / best / 1e9);
    }
    free(x);
    free(dy);
    free(dx);
    return 0;
}
