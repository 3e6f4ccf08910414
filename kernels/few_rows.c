/* A few-row matmul for the CPU that reads the weights once (AVX2 + FMA, float32, one thread).

   y[m, n] = sum_k x[m, k] * W[n, k] for M rows of x (M small: a verify block, a few decoding rows).
   W is packed as panels of 16 output columns, (N/16, K, 16), so a panel streams from memory once
   and every row of x is multiplied against it while it is in registers: at M = 5 the kernel does
   five times the arithmetic of M = 1 over the same memory traffic. A general GEMM (MKL's) packs and
   tiles for large M and, at M = 2..10, costs about as much per row as at M = 1.

   Each output is one chain of fused multiply-adds in the order k = 0 .. K-1, whatever M and whatever
   the blocking, so a row's result is bit-identical whether it is computed alone or beside others:
   a plain step (one row) and a verify (k + 1 rows) see the same logits for the same position.

   Built on first use by few_rows.py with the system's C compiler; no torch headers, no Python API. */
#include <immintrin.h>
#include <stdint.h>

#define PANEL(MR)                                                                                     \
  static void panel_##MR(const float* x, int64_t ldx, const float* p, int64_t K, float* y, int64_t ldy) { \
    __m256 a0[MR], a1[MR];                                                                            \
    for (int m = 0; m < MR; ++m) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); }        \
    for (int64_t k = 0; k < K; ++k) {                                                                 \
      __m256 w0 = _mm256_loadu_ps(p + k * 16), w1 = _mm256_loadu_ps(p + k * 16 + 8);                  \
      for (int m = 0; m < MR; ++m) {                                                                  \
        __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);                                             \
        a0[m] = _mm256_fmadd_ps(xb, w0, a0[m]);                                                       \
        a1[m] = _mm256_fmadd_ps(xb, w1, a1[m]);                                                       \
      }                                                                                               \
    }                                                                                                 \
    for (int m = 0; m < MR; ++m) {                                                                    \
      _mm256_storeu_ps(y + m * ldy, a0[m]);                                                           \
      _mm256_storeu_ps(y + m * ldy + 8, a1[m]);                                                       \
    }                                                                                                 \
  }
PANEL(1) PANEL(2) PANEL(3) PANEL(4) PANEL(5) PANEL(6)

/* one row: two panels at a time, four independent chains to cover the FMA latency */
static void panels_1(const float* x, const float* p, const float* q, int64_t K, float* y) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
  for (int64_t k = 0; k < K; ++k) {
    __m256 xb = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(p + k * 16), a0);
    a1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(p + k * 16 + 8), a1);
    b0 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(q + k * 16), b0);
    b1 = _mm256_fmadd_ps(xb, _mm256_loadu_ps(q + k * 16 + 8), b1);
  }
  _mm256_storeu_ps(y, a0); _mm256_storeu_ps(y + 8, a1); _mm256_storeu_ps(y + 16, b0); _mm256_storeu_ps(y + 24, b1);
}

static void rows(int mr, const float* x, const float* P, int64_t K, int64_t N, float* y) {
  int64_t np = N / 16;
  for (int64_t j = 0; j < np; ++j) {
    const float* p = P + j * K * 16;
    float* yj = y + j * 16;
    switch (mr) {
      case 1:
        if (j + 1 < np) { panels_1(x, p, p + K * 16, K, yj); ++j; }
        else panel_1(x, K, p, K, yj, N);
        break;
      case 2: panel_2(x, K, p, K, yj, N); break;
      case 3: panel_3(x, K, p, K, yj, N); break;
      case 4: panel_4(x, K, p, K, yj, N); break;
      case 5: panel_5(x, K, p, K, yj, N); break;
      default: panel_6(x, K, p, K, yj, N); break;
    }
  }
}

void few_rows(const float* x, int64_t M, int64_t K, const float* P, int64_t N, float* y) {
  for (int64_t m = 0; m < M; m += 6) {
    int mr = (int)(M - m < 6 ? M - m : 6);
    rows(mr, x + m * K, P, K, N, y + m * N);
  }
}
