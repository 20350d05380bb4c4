/* y = x W^T (+ bias) for many rows of x, W in GGUF blocks: a thread dequantizes TILE_ROWS rows of W at
 * a time into its own fp32 buffer (rows as dequantize_rows_f32 writes them, the same values) and
 * multiplies every row of x by that tile, XR rows of x by WR rows of the tile a pass: vectors along k,
 * XR x WR accumulators, each summed across its lanes at the end. A weight is decoded once per call,
 * where the block kernel decodes it again for every group of rows; the tile stays in L2 while the
 * rows of x pass over it. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quants.h"
#include "simd.h"

#if defined(__AVX512F__)
#define XR 4
#define WR 6 /* 24 accumulators and 4 loads of 32 registers */
#else
#define XR 2
#define WR 4 /* AVX2's 16 registers: 8 accumulators */
#endif
#define TILE_ROWS 24 /* a multiple of WR; 24 rows of k = 8192 are 768 KB */

/* sums[a][b] = row a of x times tile row b, over k, for a full XR x WR pass */
static inline void tile_pass(const float *x, int64_t x_stride, const float *tile, int64_t k, float sums[XR][WR]) {
    vec_t acc[XR][WR];
    for (int a = 0; a < XR; a++)
        for (int b = 0; b < WR; b++) acc[a][b] = (vec_t){0};
    int64_t c = 0;
    for (; c + VEC_FLOATS <= k; c += VEC_FLOATS) {
        vec_t w[WR];
        for (int b = 0; b < WR; b++) w[b] = load_vec(tile + b * k + c);
        for (int a = 0; a < XR; a++) {
            const vec_t xv = load_vec(x + a * x_stride + c);
            for (int b = 0; b < WR; b++) acc[a][b] += xv * w[b];
        }
    }
    for (int a = 0; a < XR; a++)
        for (int b = 0; b < WR; b++) {
            float sum = 0.0f;
            for (int l = 0; l < VEC_FLOATS; l++) sum += acc[a][b][l];
            for (int64_t d = c; d < k; d++) sum += x[a * x_stride + d] * tile[b * k + d];
            sums[a][b] = sum;
        }
}

/* Whether it ran: 0 (nothing written) where the threads' buffers could not be allocated; every
 * thread of the enclosing region sees the same answer. */
int quant_tiled_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                      float *out, int64_t m, int64_t n, int64_t k) {
    const int64_t row_bytes = quant_row_bytes(type, k), tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    float *buffers = NULL;
#pragma omp single copyprivate(buffers)
    buffers = malloc((size_t)omp_get_num_threads() * TILE_ROWS * (size_t)k * sizeof(float));
    if (buffers == NULL) return 0;
    float *tile = buffers + (size_t)omp_get_thread_num() * TILE_ROWS * (size_t)k;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * TILE_ROWS, rows = n - first < TILE_ROWS ? n - first : TILE_ROWS;
        for (int64_t r = 0; r < rows; r++) dequantize_row(type, weight + (first + r) * row_bytes, k, tile + r * k);
        for (int64_t i = 0; i < m; i += XR) {
            for (int64_t j = 0; j < rows; j += WR) {
                if (i + XR <= m && j + WR <= rows) {
                    float sums[XR][WR];
                    tile_pass(x + i * x_stride, x_stride, tile + j * k, k, sums);
                    for (int a = 0; a < XR; a++)
                        for (int b = 0; b < WR; b++)
                            out[(i + a) * n + first + j + b] = sums[a][b] + (bias != NULL ? bias[first + j + b] : 0.0f);
                    continue;
                }
                for (int64_t a = i; a < m && a < i + XR; a++) /* the edges, one dot product each */
                    for (int64_t b = j; b < rows && b < j + WR; b++)
                        out[a * n + first + b] = dot(x + a * x_stride, tile + b * k, k) +
                                                 (bias != NULL ? bias[first + b] : 0.0f);
            }
        }
    }
#pragma omp single
    free(buffers);
    return 1;
}
