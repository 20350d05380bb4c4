/* y = x W^T (+ bias) with W in GGUF blocks and x quantized to 8 bits a row first (q8_activations.h):
 * the matmul of a weight whose type carries INT8_ACTIVATIONS (quants.h), which csrc/quant_matmul.c
 * hands here. The rows of x are quantized once per call into a buffer every thread reads; a task is
 * Q8_TILE weight rows, and for each group of up to Q8_GROUP rows of x each weight row of the tile is
 * decoded once and multiplied into every row of the group (csrc/q8_dot_*.c). The tile's blocks stay
 * in L1/L2 while the groups pass over them, so a weight is read from memory once per call. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "q8_activations.h"
#include "quants.h"

#define Q8_TILE 16

int q8_k_activations(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

/* round to nearest, ties to even, for |v| < 2^22: llama.cpp's nearest_int, which its quantizers use */
static inline int nearest_int(float v) {
    const float shifted = v + 12582912.0f;
    int32_t bits;
    __builtin_memcpy(&bits, &shifted, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

/* The value of x[0..n) largest in magnitude (the first of equals), and that magnitude. */
static inline float largest(const float *x, int n, float *magnitude) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        const float ax = fabsf(x[j]);
        if (ax > amax) amax = ax, max = x[j];
    }
    *magnitude = amax;
    return max;
}

void quantize_row_q8_k(const float *x, int64_t k, block_q8_k *out) {
    for (int64_t b = 0; b < k / 256; b++, x += 256) {
        block_q8_k *y = out + b;
        float amax;
        const float max = largest(x, 256, &amax);
        const float iscale = amax != 0.0f ? -127.0f / max : 0.0f;
        for (int j = 0; j < 256; j++) {
            const int v = nearest_int(iscale * x[j]);
            y->qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += y->qs[16 * j + i];
            y->bsums[j] = (int16_t)sum;
        }
        y->d = amax != 0.0f ? 1.0f / iscale : 0.0f;
    }
}

void quantize_row_q8_0(const float *x, int64_t k, block_q8_0 *out) {
    for (int64_t b = 0; b < k / 32; b++, x += 32) {
        block_q8_0 *y = out + b;
        float amax;
        largest(x, 32, &amax);
        const float iscale = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            const int v = nearest_int(iscale * x[j]);
            y->qs[j] = (int8_t)v;
            sum += v;
        }
        y->sum = sum;
        y->d = amax != 0.0f ? 1.0f / iscale : 0.0f;
    }
}

int q8_matmul_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                    float *out, int64_t m, int64_t n, int64_t k) {
    if (type == Q5_K) return 0; /* its integer dots read repacked tiles only: the caller's fp32 path */
    const int k_blocks = q8_k_activations(type);
    const int64_t blocks = k_blocks ? k / 256 : k / 32;
    const size_t block_bytes = k_blocks ? sizeof(block_q8_k) : sizeof(block_q8_0);
    const int64_t row_bytes = quant_row_bytes(type, k), tiles = (n + Q8_TILE - 1) / Q8_TILE;
    void *activations = NULL;
#pragma omp single copyprivate(activations)
    activations = malloc((size_t)(m * blocks) * block_bytes);
    if (activations == NULL) return 0;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; i++) {
        if (k_blocks)
            quantize_row_q8_k(x + i * x_stride, k, (block_q8_k *)activations + i * blocks);
        else
            quantize_row_q8_0(x + i * x_stride, k, (block_q8_0 *)activations + i * blocks);
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t end = (t + 1) * Q8_TILE < n ? (t + 1) * Q8_TILE : n;
        for (int64_t g = 0; g < m; g += Q8_GROUP) {
            const int rows = m - g < Q8_GROUP ? (int)(m - g) : Q8_GROUP;
            for (int64_t j = t * Q8_TILE; j < end; j++) {
                float sums[Q8_GROUP];
                if (k_blocks)
                    q8_k_dots(type, weight + j * row_bytes, (const block_q8_k *)activations + g * blocks, blocks, rows,
                              sums);
                else
                    q8_0_dots(type, weight + j * row_bytes, (const block_q8_0 *)activations + g * blocks, blocks, rows,
                              sums);
                const float b = bias != NULL ? bias[j] : 0.0f;
                for (int r = 0; r < rows; r++) out[(g + r) * n + j] = sums[r] + b;
            }
        }
    }
#pragma omp single
    free(activations);
    return 1;
}
