/* The row sweeps built against musl, as musllinux wheels are: the run-time
 * choice of AVX-512, AVX2 or SSE2 sweeps works without glibc's ifunc, and
 * every path gives the same bytes (forward and backward sweeps, all four
 * storage types, blocks, single vectors and a tail).  Built and run by
 * .ci/run with Debian's musl-gcc; exits 1 if two paths differ. */
#include "rowops_all.h"
#include <stdio.h>
#include <stdlib.h>
enum { N = 777, P = 4 };
static float x[N], w[N], b[N], dy[N], y32[P][N], dx32[P][N], dw32[P][N], db32[P][N];
static double x64[N], w64[N], b64[N], y64[P][N];
static uint16_t xh[N], bh[N], dyh[N], yh[P][N], ybh[P][N], dxh[P][N];
static double s[P][6][3];
int main(void)
{
    srand(1);
    for (int i = 0; i < N; i++) {
        x[i] = rand() / (float)RAND_MAX * 4 - 2; w[i] = rand() / (float)RAND_MAX + 0.5f;
        b[i] = rand() / (float)RAND_MAX - 0.5f; dy[i] = rand() / (float)RAND_MAX - 0.5f;
        x64[i] = x[i] * 1.0000001; w64[i] = w[i]; b64[i] = b[i];
        xh[i] = lnf_f32_to_f16(x[i]); bh[i] = lnf_f32_to_bf16(x[i]); dyh[i] = lnf_f32_to_f16(dy[i]);
    }
    float k[5] = {0.1f, 0.001f, 1.3f, 0.2f, 0.05f};
    for (int p = 0; p < P; p++) {
        lnf_simd_path = p;
        printf("path %d: %s, f16 level %d\n", p, lnf_simd_runtime(), lnf_sweep_level(1));
        lnf_row_pipe_f32(x, y32[p], w, b, 0.1f, 0.001f, 1.3f, x, NULL, NULL, 1, s[p][0], N, NULL, NULL, 0);
        lnf_row_pipe_f64(x64, y64[p], w64, b64, 0.1, 0.001, 1.3, x64, NULL, NULL, 1, s[p][1], N, NULL, NULL, 0);
        lnf_row_pipe_f16(xh, yh[p], w, b, 0.1f, 0.001f, 1.3f, xh, NULL, NULL, 1, s[p][2], N, NULL, NULL, 0);
        lnf_row_pipe_bf16(bh, ybh[p], w, b, 0.1f, 0.001f, 1.3f, bh, NULL, NULL, 1, s[p][3], N, NULL, NULL, 0);
        lnf_row_grad_pipe_f32(x, dy, NULL, dx32[p], k, dw32[p], db32[p], x, dy, 0.1f, s[p][4], w, N, NULL, NULL, 0);
        lnf_row_grad_pipe_f16(xh, dyh, NULL, dxh[p], k, dw32[p], db32[p], xh, dyh, 0.1f, s[p][5], w, N, NULL, NULL, 0);
    }
    int bad = 0;
    for (int p = 1; p < P; p++) {
        bad |= memcmp(y32[p], y32[0], sizeof y32[0]) | memcmp(y64[p], y64[0], sizeof y64[0]);
        bad |= memcmp(yh[p], yh[0], sizeof yh[0]) | memcmp(ybh[p], ybh[0], sizeof ybh[0]);
        bad |= memcmp(dx32[p], dx32[0], sizeof dx32[0]) | memcmp(dxh[p], dxh[0], sizeof dxh[0]);
        bad |= memcmp(dw32[p], dw32[0], sizeof dw32[0]) | memcmp(s[p], s[0], sizeof s[0]);
    }
    printf("%s (sum %.17g)\n", bad ? "DIFFERENT" : "same bytes on every path", s[0][0][0]);
    return bad;
}
