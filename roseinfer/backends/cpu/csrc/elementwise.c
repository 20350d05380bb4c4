/* Row-wise kernels (fp32, CPU), each one pass over memory where torch runs several ops (~10 us
 * of dispatch each): RMSNorm with the residual add folded in, SiLU(gate) * up, the rotary
 * embedding in place, and the greedy argmax over logits, for the CPU backend's layers and sampler
 * (backends/cpu). Rows are split over threads only when there is enough work to pay for waking
 * them. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "simd.h"

#define PARALLEL_MIN_FLOATS 65536

/* RMSNorm row by row (rms_norm_row in simd.h); with a residual, x + residual is written back to
 * residual first and normalised. */
void rms_norm_f32(const float *x, int64_t x_row_stride, float *residual, const float *weight, float *out,
                  int64_t n, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n; i++)
        rms_norm_row(x + i * x_row_stride, residual != NULL ? residual + i * dim : NULL, weight, out + i * dim, dim,
                     eps);
}

/* out[i] = silu(gate[i]) * up[i], where gate_up row i is [gate | up], each `width` floats */
void silu_mul_f32(const float *gate_up, float *out, int64_t n, int64_t width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * width >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *gate = gate_up + i * 2 * width;
        silu_mul_row(gate, gate + width, out + i * width, width);
    }
}

/* Rotates each head of x in place by its token's angles (rotate_heads in simd.h). x: [n, heads,
 * head_dim] with rows x_row_stride floats apart (q and k may sit side by side in one qkv row);
 * rope: [n, head_dim / 2, 2]. */
void rotary_f32(float *x, int64_t x_row_stride, const float *rope, int64_t n, int64_t heads, int64_t head_dim,
                int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * heads * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < n; t++) rotate_heads(x + t * x_row_stride, rope + t * head_dim, heads, head_dim);
}

/* out[i] = the index of row i's largest value: the first one on ties and the first NaN where
 * there is one, as torch.argmax decides. One vectorised pass for the peak, one scan to find it. */
void argmax_rows_f32(const float *x, int64_t n, int64_t width, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * width >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * width;
        float peak = -INFINITY;
        int has_nan = 0;
#pragma omp simd reduction(max : peak) reduction(| : has_nan)
        for (int64_t d = 0; d < width; d++) {
            peak = row[d] > peak ? row[d] : peak;
            has_nan |= row[d] != row[d];
        }
        int64_t best = 0;
        if (has_nan)
            while (row[best] == row[best]) best++;
        else
            while (best < width - 1 && row[best] != peak) best++;
        out[i] = best;
    }
}
