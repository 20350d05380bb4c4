/* y = x W^T (+ bias) for a few rows of x (decode at batch 1-4), reading W where oneDNN packed it.
 *
 * With one to four rows a matmul is a stream over the weights: each weight is used once per row.
 * oneDNN's fp32 matmul ran the default model's weights at ~18 GB/s there; one pass that keeps every
 * row's accumulators in registers and reads each block front to back runs at ~27 GB/s, close to what
 * two cores can read (layers/linear.py has the measurements).
 *
 * The layout is the one layers/linear.py verifies before calling this: rows of W in blocks of 64,
 * each column's 64 values side by side, element (r, c) at ((r / 64) * k + c) * 64 + r % 64, the last
 * block padded. A block of 64 outputs is one task: four 16-float vectors of weights per column,
 * multiplied into up to 4 x 4 accumulators (16 of AVX-512's 32 registers). */
#include <stdint.h>

#include "simd.h"

#define BLOCK 64
#define MAX_ROWS 4

/* Outputs block_row .. block_row + 63 of rows [0, m): all m rows' dot products over one block. */
static inline __attribute__((always_inline)) void gemv_block(const float *x, int64_t x_stride, const float *w,
                                                             int64_t k, vec16 acc[MAX_ROWS][4], const int m) {
    for (int r = 0; r < m; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = (vec16){0};
    for (int64_t c = 0; c < k; c++) {
        const float *wc = w + c * BLOCK;
        const vec16 w0 = load16(wc), w1 = load16(wc + 16), w2 = load16(wc + 32), w3 = load16(wc + 48);
        for (int r = 0; r < m; r++) {
            const float xv = x[r * x_stride + c];
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
            acc[r][2] += xv * w2;
            acc[r][3] += xv * w3;
        }
    }
}

/* x: [m, k] rows x_stride floats apart (m <= 4); packed: W [n, k] in 64-row blocks; bias: [n] or NULL;
 * out: [m, n] contiguous. */
void packed_gemv_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                     int64_t m, int64_t n, int64_t k, int num_threads) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        vec16 acc[MAX_ROWS][4];
        const float *w = packed + b * k * BLOCK;
        /* constant row counts, so the accumulators stay in registers */
        switch (m) {
        case 1: gemv_block(x, x_stride, w, k, acc, 1); break;
        case 2: gemv_block(x, x_stride, w, k, acc, 2); break;
        case 3: gemv_block(x, x_stride, w, k, acc, 3); break;
        default: gemv_block(x, x_stride, w, k, acc, 4); break;
        }
        const int64_t first = b * BLOCK, width = n - first < BLOCK ? n - first : BLOCK;
        for (int r = 0; r < m; r++) {
            float sums[BLOCK];
            for (int q = 0; q < 4; q++) store16(sums + q * 16, acc[r][q]);
            float *o = out + r * n + first;
            for (int64_t j = 0; j < width; j++) o[j] = bias != NULL ? sums[j] + bias[first + j] : sums[j];
        }
    }
}
