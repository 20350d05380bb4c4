/* Row-wise kernels of the decoder layer (fp32, CPU), each one pass over memory where torch runs
 * several ops: RMSNorm (torch: pow, mean, add, rsqrt, two muls, ~10 us of dispatch each) with
 * the residual add folded in, and SiLU(gate) * up. Bound with ctypes in layers/native.py; called by
 * layers/norm.py and layers/activation.py. Rows are split over threads only when there is enough work to pay for
 * waking them. */
#include <math.h>
#include <stdint.h>

#include "simd.h"

#define PARALLEL_MIN_FLOATS 65536

/* out = weight * x / sqrt(mean(x^2) + eps) row by row, as LlamaRMSNorm computes it. With a
 * residual, x + residual is written back to residual first and normalised (vLLM's fused add). */
void rms_norm_f32(const float *x, int64_t x_row_stride, float *residual, const float *weight, float *out,
                  int64_t n, int64_t dim, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *row = x + i * x_row_stride;
        if (residual != NULL) {
            float *r = residual + i * dim;
            for (int64_t d = 0; d < dim; d++) r[d] += row[d];
            row = r;
        }
        const float inv = 1.0f / sqrtf(dot(row, row, dim) / (float)dim + eps);
        float *o = out + i * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = weight[d] * (row[d] * inv);
    }
}

/* out[i] = silu(gate[i]) * up[i], where gate_up row i is [gate | up], each `width` floats */
void silu_mul_f32(const float *gate_up, float *out, int64_t n, int64_t width, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * width >= PARALLEL_MIN_FLOATS)
    for (int64_t i = 0; i < n; i++) {
        const float *gate = gate_up + i * 2 * width, *up = gate + width;
        float *o = out + i * width;
#pragma omp simd
        for (int64_t d = 0; d < width; d++) o[d] = gate[d] / (1.0f + exp_f32(-gate[d])) * up[d];
    }
}
