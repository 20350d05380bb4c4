/* y = x W^T (+ bias) for decode-sized batches, reading W where oneDNN packed it.
 *
 * The layout is the one backends/cpu/onednn.py verifies before this is called: rows of W in blocks of 64,
 * each column's 64 values side by side, element (r, c) at ((r / 64) * k + c) * 64 + r % 64, the last
 * block padded. Read front to back a block is a stream of 64-float rows. One task multiplies a group
 * of rows of x by one block, in passes over column slices of it: per column, four vectors of weights
 * into rows x 4 accumulators, each weight used once per row from a register. The tiling is the
 * register file's: on AVX-512 a pass is the whole 64-float slice and a group 6 rows (24 of its 32
 * registers); with AVX2's 16 registers of 8 floats a pass is 32 floats and a group 3 rows (12
 * accumulators + 4 weights), two passes a block, the second reading it from L1/L2. The first group of
 * a block reads it from memory, later groups from L2 (a block is 64 k floats: 147 KB for k = 576).
 *
 * With few rows this streams the weights at close to what two cores can read, where oneDNN's fp32
 * matmul ran well below it; up to a few hundred rows it was still ahead (backends/cpu/layers.py has the
 * measurements).
 *
 * Two entry points also compute the matmul's input from the rows they are given, in the same
 * parallel region: RMSNorm (with the residual add) before q/k/v and gate/up, SiLU * up before down.
 * In a decode step those were 3 of a layer's ~6 Python-to-C crossings, and their small passes ran
 * 2-4x slower between matmuls than in a loop, the weights having evicted their rows. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "q8_activations.h"
#include "quants.h"
#include "simd.h"

#define BLOCK 64
#if defined(__AVX512F__)
#define GROUP 6
#else
#define GROUP 3 /* AVX2, and the portable build */
#endif
#define SLICE (4 * VEC_FLOATS) /* the block's columns one pass covers */
#define ONE_ROW_BLOCKS (SLICE < BLOCK)

/* acc[r] = rows [0, m) of x (m <= GROUP) times the SLICE rows of W at w (within a block), over all k
 * columns */
static inline __attribute__((always_inline)) void group_times_slice(const float *x, int64_t x_stride,
                                                                    const float *w, int64_t k,
                                                                    vec_t acc[GROUP][4], const int m) {
    for (int r = 0; r < m; r++)
        for (int q = 0; q < 4; q++) acc[r][q] = (vec_t){0};
    for (int64_t c = 0; c < k; c++) {
        const float *wc = w + c * BLOCK;
        const vec_t w0 = load_vec(wc), w1 = load_vec(wc + VEC_FLOATS), w2 = load_vec(wc + 2 * VEC_FLOATS),
                    w3 = load_vec(wc + 3 * VEC_FLOATS);
        for (int r = 0; r < m; r++) {
            const float xv = x[r * x_stride + c];
            acc[r][0] += xv * w0;
            acc[r][1] += xv * w1;
            acc[r][2] += xv * w2;
            acc[r][3] += xv * w3;
        }
    }
}

/* One row of x times a whole block in one pass, eight vectors: where a slice is narrower than the
 * block (AVX2), a single row has the registers for it, and streams each weight from memory once. */
static inline void row_times_block(const float *x, const float *w, int64_t k, float sums[BLOCK]) {
    vec_t acc[BLOCK / VEC_FLOATS] = {0};
    for (int64_t c = 0; c < k; c++) {
        const float xv = x[c];
        for (int q = 0; q < BLOCK / VEC_FLOATS; q++) acc[q] += xv * load_vec(w + c * BLOCK + q * VEC_FLOATS);
    }
    memcpy(sums, acc, sizeof acc);
}

/* The matmul's tasks, shared out over the threads of the enclosing parallel region. x: [m, k] rows
 * x_stride floats apart; packed: W [n, k] in 64-row blocks; bias: [n] or NULL; out: [m, n]
 * contiguous. */
static void matmul_tasks(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                         int64_t m, int64_t n, int64_t k) {
    const int64_t blocks = (n + BLOCK - 1) / BLOCK, groups = (m + GROUP - 1) / GROUP;
    /* consecutive tasks share a block, so a thread's later groups find it in L2 */
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + g * GROUP * x_stride;
            const int rows = m - g * GROUP < GROUP ? (int)(m - g * GROUP) : GROUP;
            if (ONE_ROW_BLOCKS && m == 1) {
                float sums[BLOCK];
                const int64_t first = b * BLOCK, width = n - first < BLOCK ? n - first : BLOCK;
                row_times_block(x, packed + b * k * BLOCK, k, sums);
                for (int64_t j = 0; j < width; j++) out[first + j] = bias != NULL ? sums[j] + bias[first + j] : sums[j];
                continue;
            }
            for (int64_t first = b * BLOCK; first < (b + 1) * BLOCK && first < n; first += SLICE) {
                vec_t acc[GROUP][4];
                const float *w = packed + b * k * BLOCK + (first - b * BLOCK);
                /* constant row counts, so the accumulators stay in registers */
                switch (rows) {
                case 1: group_times_slice(xg, x_stride, w, k, acc, 1); break;
                case 2: group_times_slice(xg, x_stride, w, k, acc, 2); break;
#if GROUP == 6
                case 3: group_times_slice(xg, x_stride, w, k, acc, 3); break;
                case 4: group_times_slice(xg, x_stride, w, k, acc, 4); break;
                case 5: group_times_slice(xg, x_stride, w, k, acc, 5); break;
#endif
                default: group_times_slice(xg, x_stride, w, k, acc, GROUP); break;
                }
                const int64_t width = n - first < SLICE ? n - first : SLICE;
                for (int r = 0; r < rows; r++) {
                    float sums[SLICE];
                    memcpy(sums, acc[r], sizeof sums);
                    float *o = out + (g * GROUP + r) * n + first;
                    for (int64_t j = 0; j < width; j++) o[j] = bias != NULL ? sums[j] + bias[first + j] : sums[j];
                }
            }
        }
    }
}

/* out [m, n] = x [m, k] W^T (+ bias) */
void packed_matmul_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                       int64_t m, int64_t n, int64_t k, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    matmul_tasks(x, x_stride, packed, bias, out, m, n, k);
}

/* Whether a weight of this layout (0 packed fp32, -count parts of n rows in all, else a GGML type)
 * takes rows of k floats and gives n outputs. */
static int weight_shape_ok(const void *weight, int64_t weight_type, int64_t n, int64_t k) {
    if (weight_type >= 0) return weight_type == 0 || quant_shape_ok(weight_type, k);
    const weight_part_t *parts = weight;
    int64_t rows = 0;
    for (int64_t i = 0; i < -weight_type; i++) {
        if (!quant_shape_ok(parts[i].type, k)) return 0;
        rows += parts[i].rows;
    }
    return rows == n;
}

/* One matmul's tasks, W packed fp32 (weight_type 0), in parts (-count: each part's rows by its own
 * type's kernel into its columns of out) or GGUF blocks of that type (csrc/quant_matmul.c), shared
 * over the enclosing parallel region; the caller checked weight_shape_ok. */
static void weight_matmul_tasks(const float *x, int64_t x_stride, const void *weight, int64_t weight_type,
                                const float *bias, float *out, int64_t m, int64_t n, int64_t k) {
    if (weight_type == 0) {
        matmul_tasks(x, x_stride, weight, bias, out, m, n, k);
    } else if (weight_type > 0) {
        quant_matmul_tasks(x, x_stride, weight, weight_type, bias, out, n, m, n, k);
    } else {
        const weight_part_t *parts = weight;
        for (int64_t i = 0, first = 0; i < -weight_type; first += parts[i].rows, i++)
            quant_matmul_tasks(x, x_stride, parts[i].blocks, parts[i].type, bias != NULL ? bias + first : NULL,
                               out + first, n, m, parts[i].rows, k);
    }
}

/* The forms of x's quantized rows that a weight's repacked tiles read (q8_rows_forms over its parts),
 * or 0 where it, or one of its parts, is not repacked. */
static unsigned repacked_forms(const void *weight, int64_t weight_type) {
    if (weight_type == 0) return 0;
    if (weight_type > 0) return weight_type & INT8_REPACKED ? q8_rows_forms(weight_type & ~TYPE_FLAGS) : 0;
    const weight_part_t *parts = weight;
    unsigned forms = 0;
    for (int64_t i = 0; i < -weight_type; i++) {
        if (!(parts[i].type & INT8_REPACKED)) return 0;
        forms |= q8_rows_forms(parts[i].type & ~TYPE_FLAGS);
    }
    return forms;
}

/* weight_matmul_tasks where every part is repacked, on x's rows quantized for all of them */
static void repacked_matmul_tasks(const q8_rows_t *rows, const void *weight, int64_t weight_type, const float *bias,
                                  float *out, int64_t m, int64_t n) {
    if (weight_type > 0) {
        q8_gemm_part_tasks(rows, weight, weight_type & ~TYPE_FLAGS, bias, out, n, m, n);
        return;
    }
    const weight_part_t *parts = weight;
    for (int64_t i = 0, first = 0; i < -weight_type; first += parts[i].rows, i++)
        q8_gemm_part_tasks(rows, parts[i].blocks, parts[i].type & ~TYPE_FLAGS, bias != NULL ? bias + first : NULL,
                           out + first, n, m, parts[i].rows);
}

enum prologue { NO_ROWS, NORM_ROWS, SILU_MUL_ROWS };

/* The matmul on rows computed first from x, in one parallel region: the `omp for` over the rows
 * ends in a barrier, so every row is written before a matmul task reads it. NO_ROWS: x itself;
 * NORM_ROWS: x [m, k] rows x_stride floats apart through rms_norm_row; SILU_MUL_ROWS: x rows
 * [gate | up] of 2k floats through silu_mul_row. Where every part of W is repacked for the int8
 * GEMM, the same loop quantizes each row once for all of them. Returns nonzero where a buffer could
 * not be allocated or the type is not handled (nothing is written). */
static int prologue_matmul(enum prologue kind, const float *x, int64_t x_stride, float *residual,
                           const float *norm_weight, float eps, const void *packed, int64_t weight_type,
                           const float *bias, float *out, int64_t m, int64_t n, int64_t k, int num_threads) {
    if (!weight_shape_ok(packed, weight_type, n, k)) return 1;
    const unsigned forms = repacked_forms(packed, weight_type);
    float *rows = kind == NO_ROWS ? NULL : malloc((size_t)(m * k) * sizeof(float));
    void *quantized = forms ? malloc(q8_rows_bytes(forms, m, k)) : NULL;
    if ((kind != NO_ROWS && rows == NULL) || (forms && quantized == NULL)) {
        free(rows);
        free(quantized);
        return 1;
    }
    const q8_rows_t q8 = forms ? q8_rows_at(quantized, forms, m, k) : (q8_rows_t){0};
    const float *input = kind == NO_ROWS ? x : rows;
    const int64_t input_stride = kind == NO_ROWS ? x_stride : k;
#pragma omp parallel num_threads(num_threads)
    {
        if (kind != NO_ROWS || forms) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) {
                const float *row = x + i * x_stride;
                if (kind == NORM_ROWS)
                    rms_norm_row(row, residual != NULL ? residual + i * k : NULL, norm_weight, rows + i * k, k, eps);
                else if (kind == SILU_MUL_ROWS)
                    silu_mul_row(row, row + k, rows + i * k, k);
                if (forms) q8_rows_quantize(&q8, input + i * input_stride, i);
            }
        }
        if (forms)
            repacked_matmul_tasks(&q8, packed, weight_type, bias, out, m, n);
        else
            weight_matmul_tasks(input, input_stride, packed, weight_type, bias, out, m, n, k);
    }
    free(rows);
    free(quantized);
    return 0;
}

/* out [m, n] = x [m, k] W^T (+ bias), W packed fp32 (weight_type 0), -weight_type parts
 * (weight_part_t) or GGUF blocks of that type. Returns nonzero (nothing written) where a type is not
 * handled, k is not whole blocks of it, the parts' rows do not add up to n or a buffer could not be
 * allocated. */
int weight_matmul_f32(const float *x, int64_t x_stride, const void *weight, int64_t weight_type, const float *bias,
                      float *out, int64_t m, int64_t n, int64_t k, int num_threads) {
    return prologue_matmul(NO_ROWS, x, x_stride, NULL, NULL, 0.0f, weight, weight_type, bias, out, m, n, k,
                           num_threads);
}

/* out = rms_norm(x (+ residual)) W^T (+ bias), with rms_norm_f32's rounding (rms_norm_row). residual:
 * [m, k] contiguous or NULL; given, it is updated in place to x + residual, as rms_norm_f32 does.
 * W: as weight_matmul_f32 takes it. */
int rms_norm_packed_matmul_f32(const float *x, int64_t x_stride, float *residual, const float *norm_weight, float eps,
                               const void *packed, int64_t weight_type, const float *bias, float *out, int64_t m,
                               int64_t n, int64_t k, int num_threads) {
    return prologue_matmul(NORM_ROWS, x, x_stride, residual, norm_weight, eps, packed, weight_type, bias, out, m, n,
                           k, num_threads);
}

/* out = (silu(gate) * up) W^T (+ bias), where gate_up row i is [gate | up], each k floats, rows
 * contiguous: silu_mul_f32 and packed_matmul_f32 in one call. */
int silu_mul_packed_matmul_f32(const float *gate_up, const void *packed, int64_t weight_type, const float *bias,
                               float *out, int64_t m, int64_t n, int64_t k, int num_threads) {
    return prologue_matmul(SILU_MUL_ROWS, gate_up, 2 * k, NULL, NULL, 0.0f, packed, weight_type, bias, out, m, n, k,
                           num_threads);
}

/* The matmul floor's decode steps (bench/floor.py): `steps` times, each of `count` weights times the
 * same m rows, back to back, with no Python between them: the matmuls as decode_layers_f32 runs them
 * and nothing else. Weight i is [n[i], k[i]] in layout types[i] (as weight_matmul_f32 takes it), with
 * bias[i] or NULL; x: [m, x_stride] (x_stride >= every k); out: [m, max n] scratch.
 * Returns nonzero where a quantized weight's type or width is not handled. */
int packed_matmul_steps_f32(const void *const *packed, const int64_t *types, const float *const *bias,
                            const int64_t *n, const int64_t *k, int64_t count, const float *x, int64_t x_stride,
                            float *out, int64_t m, int64_t steps, int num_threads) {
    int failed = 0;
    for (int64_t s = 0; s < steps; s++)
        for (int64_t i = 0; i < count; i++)
            failed |= weight_matmul_f32(x, x_stride, packed[i], types[i], bias[i], out, m, n[i], k[i], num_threads);
    return failed;
}
