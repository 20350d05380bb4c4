/* y = x W^T (+ bias) with W kept in GGUF blocks (quants.h), fp32 sums, and the rows of a
 * quantized table dequantized for an embedding lookup.
 *
 * W is [n, k]: row j is k / 32 chunks of 32 weights in k / block_weights whole blocks. A task is
 * TILE output rows; for each group of up to GROUP rows of x it walks each weight row once, chunk by
 * chunk: the chunk is dequantized into four 8-float vectors and multiplied into every row of the
 * group from registers, so a weight is decoded once per group and never stored as fp32. A group
 * keeps at least eight independent FMA chains where the registers allow (fewer stall on latency):
 * four accumulators a row for one or two rows, two for three or four, one from five (three rows
 * with four each spilled). x's group stays in L1 (GROUP rows of k floats), and the tile's weights
 * in L1/L2 while every group passes over them.
 *
 * A single row of x (one sequence decoding) times Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/MXFP4 takes the block scale
 * out of the sum instead, d * sum(q x) + m * sum(x) with x's chunk sums taken once: the same real
 * weights and fp32 sums, in another order, and 6 multiplies a chunk in place of 8 (the one-row kernel is bound
 * by its instructions, not by memory). Q4_K and Q6_K on AVX-512 and AVX2 (and one row of Q5_K on AVX2)
 * take csrc/kquant.c instead, and from TILED_MIN_ROWS(type) rows every type takes csrc/quant_tiled_matmul.c
 * on every target. */
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "q8_activations.h"
#include "quants.h"
#include "simd.h"

#define GROUP 8
#define TILE 16
/* from this many rows of x, W dequantized once into fp32 tiles (csrc/quant_tiled_matmul.c) beats
 * decoding it again for every group of rows: the tiles cost the same up to one vector of rows. For
 * the 32-weight types from 14 (at 13 Q8_0's block kernel was 10 % faster on AVX2, the default
 * model's Q4_1 3 % on AVX-512); the K-quants' block kernels decode more a weight, and lose from 8. */
#define TILED_MIN_ROWS(type) (quant_block_weights(type) == 256 ? 8 : 14)

/* sums[r] = row r of x (r < rows) times weight row w, over k columns */
static inline __attribute__((always_inline)) void group_times_row(int type, const float *x, int64_t x_stride,
                                                                  const uint8_t *w, int64_t k, const int rows,
                                                                  float sums[GROUP]) {
    const int accs = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
    vec8 acc[GROUP][4];
    for (int r = 0; r < rows; r++)
        for (int a = 0; a < accs; a++) acc[r][a] = (vec8){0};
    for (int64_t c = 0; c < k / 32; c++) {
        vec8 wv[4];
        dequant_chunk(type, w, c, wv);
        for (int r = 0; r < rows; r++) {
            const float *xc = x + r * x_stride + 32 * c;
            for (int i = 0; i < 4; i++) acc[r][i % accs] += load8(xc + 8 * i) * wv[i];
        }
    }
    for (int r = 0; r < rows; r++) {
        for (int a = 1; a < accs; a++) acc[r][0] += acc[r][a];
        sums[r] = hsum8(acc[r][0]);
    }
}

/* The one-row path: sum over chunks of d * (q . x) + m * sx, sx[c] = x's chunk c summed. */
static inline __attribute__((always_inline)) float row_times_scaled_row(int type, const float *x, const float *sx,
                                                                        const uint8_t *w, int64_t k) {
    vec8 acc0 = {0}, acc1 = {0};
    float offsets = 0.0f;
    for (int64_t c = 0; c < k / 32; c++) {
        vec8 q[4];
        float d, m;
        scaled_chunk(type, w, c, q, &d, &m);
        const float *xc = x + 32 * c;
        acc0 += d * (load8(xc) * q[0] + load8(xc + 16) * q[2]);
        acc1 += d * (load8(xc + 8) * q[1] + load8(xc + 24) * q[3]);
        if (!scaled_chunk_unshifted(type)) offsets += m * sx[c];
    }
    return hsum8(acc0 + acc1) + offsets;
}

/* One type's tasks (type constant after inlining), shared over the enclosing parallel region. */
static inline __attribute__((always_inline)) void matmul_tasks(int type, const float *x, int64_t x_stride,
                                                               const uint8_t *weight, const float *bias, float *out,
                                                               int64_t out_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t row_bytes = quant_row_bytes(type, k);
    const int64_t tiles = (n + TILE - 1) / TILE;
    if (m == 1 && scaled_chunk_type(type) && k / 32 <= MAX_SCALED_CHUNKS) {
        float sx[MAX_SCALED_CHUNKS];
        chunk_sums(x, k, sx);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j++)
            out[j] = row_times_scaled_row(type, x, sx, weight + j * row_bytes, k) + (bias != NULL ? bias[j] : 0.0f);
        return;
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t end = (t + 1) * TILE < n ? (t + 1) * TILE : n;
        for (int64_t g = 0; g < m; g += GROUP) {
            const int rows = m - g < GROUP ? (int)(m - g) : GROUP;
            const float *xg = x + g * x_stride;
            for (int64_t j = t * TILE; j < end; j++) {
                float sums[GROUP];
                const uint8_t *w = weight + j * row_bytes;
                /* constant row counts, so the accumulators stay in registers */
                switch (rows) {
                case 1: group_times_row(type, xg, x_stride, w, k, 1, sums); break;
                case 2: group_times_row(type, xg, x_stride, w, k, 2, sums); break;
                case 3: group_times_row(type, xg, x_stride, w, k, 3, sums); break;
                case 4: group_times_row(type, xg, x_stride, w, k, 4, sums); break;
                case 5: group_times_row(type, xg, x_stride, w, k, 5, sums); break;
                case 6: group_times_row(type, xg, x_stride, w, k, 6, sums); break;
                case 7: group_times_row(type, xg, x_stride, w, k, 7, sums); break;
                default: group_times_row(type, xg, x_stride, w, k, GROUP, sums); break;
                }
                const float b = bias != NULL ? bias[j] : 0.0f;
                for (int r = 0; r < rows; r++) out[(g + r) * out_stride + j] = sums[r] + b;
            }
        }
    }
}

void quant_matmul_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                        float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k) {
    if (type & INT8_REPACKED) { /* no other kernel reads the repacked tiles */
        q8_gemm_tasks(x, x_stride, weight, type & ~TYPE_FLAGS, bias, out, out_stride, m, n, k);
        return;
    }
    if (type & INT8_ACTIVATIONS) {
        /* rows of x quantized to 8 bits where the output is this weight's alone (a part of a wider
         * one keeps fp32 rows), else, or when its buffer could not be allocated, the fp32 path */
        if (out_stride == n && q8_matmul_tasks(x, x_stride, weight, type & ~(int64_t)INT8_ACTIVATIONS, bias, out, m, n, k))
            return;
        type &= ~(int64_t)INT8_ACTIVATIONS;
    }
    if (m >= TILED_MIN_ROWS(type) && quant_tiled_tasks(x, x_stride, weight, type, bias, out, out_stride, m, n, k)) return;
    if (kquant_matmul_tasks(x, x_stride, weight, type, bias, out, out_stride, m, n, k)) return;
    switch (type) {
    case Q4_0: matmul_tasks(Q4_0, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    case Q4_1: matmul_tasks(Q4_1, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    case Q5_0: matmul_tasks(Q5_0, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    case Q5_1: matmul_tasks(Q5_1, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    case Q8_0: matmul_tasks(Q8_0, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    case MXFP4: matmul_tasks(MXFP4, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    case Q4_K: matmul_tasks(Q4_K, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    case Q5_K: matmul_tasks(Q5_K, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    default: matmul_tasks(Q6_K, x, x_stride, weight, bias, out, out_stride, m, n, k); break;
    }
}

/* out [m, n] = x [m, k] (rows x_stride floats apart) W^T (+ bias [n] or NULL); weight: W's blocks,
 * rows back to back. Returns nonzero (nothing written) for a type not handled or a k that is not a
 * whole number of blocks. */
int quant_matmul_f32(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                     float *out, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (!quant_shape_ok(type, k)) return 1;
#pragma omp parallel num_threads(num_threads)
    quant_matmul_tasks(x, x_stride, weight, type, bias, out, n, m, n, k);
    return 0;
}

/* out [count, k] = rows ids[0..count) of the quantized table [*, k], dequantized. Returns nonzero
 * (nothing written) as quant_matmul_f32 does. */
int dequantize_rows_f32(const uint8_t *weight, int64_t type, const int64_t *ids, int64_t count, int64_t k, float *out,
                        int num_threads) {
    if (!quant_shape_ok(type, k)) return 1;
    const int64_t row_bytes = quant_row_bytes(type, k);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < count; i++) dequantize_row(type, weight + ids[i] * row_bytes, k, out + i * k);
    return 0;
}
