/* A mixture-of-experts layer's routed experts, GGUF blocks for gate/up and down, in one call: the
 * step's (token, slot) pairs grouped by expert, each routed expert's gate/up, SiLU * up and down on
 * its rows, each row times its routing weight, and each token's rows summed into its output.
 *
 * It computes what backends/cpu/quantized_experts.py's per-expert path computes, bit for bit, with
 * none of its per-expert Python between the kernels: pairs numbered slot-major (slot * tokens +
 * token) and sorted stably by expert, so an expert's rows come in the same order; each expert's
 * matmuls are quant_matmul_tasks on that expert's rows alone (the row count picks the kernel and
 * its sums' order, the tiled one from TILED_MIN_ROWS rows, as in a call of its own); SiLU * up is
 * silu_mul_row; the weight is a separate multiply and the token's sum starts at 0 and adds its rows
 * in ascending expert order, each in a loop of its own so no product fuses into a sum (torch's
 * `out * w` then `+=`). A projection's work is one loop over (routed expert, SLICE_ROWS of its
 * weight rows), shared out dynamically: both cores work when each expert has a single row (batch 1),
 * a thread the OS holds back leaves its items to the other, and a layer waits at 5 barriers rather
 * than at one per expert and projection (a prefill's many rows an expert make an item of it whole). An item runs quant_matmul_tasks in a team of its own thread
 * (its `omp for` then covers the slice alone); the slice of output rows changes no output's sum.
 *
 * With int8 activations (--cpu-activations int8) a projection whose type carries INT8_REPACKED
 * holds each expert's Q4_K or Q6_K rows in csrc/q8_gemm.c's tiles (the expert's own: its rows a
 * multiple of 16) and multiplies rows of x quantized to Q8_K: gate/up's input once a token (then
 * copied to its pairs' rows), down's once a (token, slot) pair after SiLU * up, never again per
 * slice. A row's quantization and integer sums do not depend on the rows beside it, so every output
 * is the bits the dense int8 GEMM gives running that expert's rows alone. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "q8_activations.h"
#include "quants.h"
#include "simd.h"

#define SLICE_ROWS 192 /* a multiple of the block kernels' row tiles (16 and 48) */
/* From this many rows an expert on average (the tiled kernel's on every target), with enough experts
 * to share out, an item is a whole expert: a slice would transpose the expert's x again and
 * allocate the tiled kernel's buffers again for a fraction of the work (a 4 x 512-token prefill ran
 * 0.88x the per-expert loop's speed sliced on one thread) */
#define WHOLE_EXPERT_ROWS 32
#define WHOLE_EXPERT_ITEMS_PER_THREAD 4

/* Where the pairs go: expert e's rows from starts[e] to starts[e + 1], order[i] the pair in row i,
 * position[p] the row of pair p, by_expert[t * top_k + r] the slot of token t's r-th smallest expert
 * id (ties in slot order), and routed[0 .. returned) the experts with rows, ascending; next:
 * [num_experts] scratch. Returns -1 for an expert id outside [0, num_experts). */
static int64_t group_pairs(const int64_t *experts, int64_t tokens, int64_t top_k, int64_t num_experts,
                           int64_t *starts, int64_t *next, int64_t *order, int64_t *position, int64_t *by_expert,
                           int64_t *routed) {
    memset(starts, 0, (size_t)(num_experts + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < tokens * top_k; i++) {
        const int64_t e = experts[i];
        if (e < 0 || e >= num_experts) return -1;
        starts[e + 1]++;
    }
    for (int64_t e = 0; e < num_experts; e++) starts[e + 1] += starts[e];
    memcpy(next, starts, (size_t)num_experts * sizeof(int64_t));
    for (int64_t s = 0; s < top_k; s++)
        for (int64_t t = 0; t < tokens; t++) {
            const int64_t p = s * tokens + t, row = next[experts[t * top_k + s]]++;
            order[row] = p;
            position[p] = row;
        }
    for (int64_t t = 0; t < tokens; t++) {
        int64_t *slots = by_expert + t * top_k;
        const int64_t *ids = experts + t * top_k;
        for (int64_t s = 0; s < top_k; s++) { /* insertion sort: stable, and top_k is small */
            int64_t r = s;
            for (; r > 0 && ids[slots[r - 1]] > ids[s]; r--) slots[r] = slots[r - 1];
            slots[r] = s;
        }
    }
    int64_t count = 0;
    for (int64_t e = 0; e < num_experts; e++)
        if (starts[e + 1] > starts[e]) routed[count++] = e;
    return count;
}

/* Rows of x quantized for a projection on repacked tiles (q8_gemm_quantize_row): q [rows, k / 256]
 * blocks, sums [rows, 16 k / 256]. */
typedef struct {
    block_q8_k *q;
    int32_t *sums;
} quantized_rows_t;

/* Bytes of one expert's weight [n, k]: its blocks, or its tiles where the type carries INT8_REPACKED. */
static int64_t expert_bytes(int64_t type, int64_t n, int64_t k) {
    return type & INT8_REPACKED ? q8_repacked_bytes(type & ~TYPE_FLAGS, n, k) : n * quant_row_bytes(type, k);
}

/* Each routed expert's matmul, out rows [m, n] (out_stride apart) = its x rows [m, k] times its weight
 * [n, k], then each out row times its scale where scales (one a row) are given: (expert, slice) items,
 * or whole experts where `whole`, shared out over the enclosing region's threads. A type with
 * INT8_REPACKED reads x's rows from xq, quantized already, instead of x. */
static void routed_matmul(const int64_t *routed, int64_t count, const int64_t *starts, int64_t whole, const float *x,
                          int64_t x_stride, quantized_rows_t xq, const uint8_t *weights, int64_t type,
                          const float *scales, float *out, int64_t out_stride, int64_t n, int64_t k) {
    const int64_t slice_rows = whole ? n : SLICE_ROWS, per_expert = expert_bytes(type, n, k);
    const int64_t slices = (n + slice_rows - 1) / slice_rows, row_bytes = quant_row_bytes(type, k), blocks = k / 256;
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < count * slices; item++) {
        const int64_t e = routed[item / slices], first = item % slices * slice_rows;
        const int64_t rows = n - first < slice_rows ? n - first : slice_rows;
        if (type & INT8_REPACKED) /* SLICE_ROWS is whole tiles: a slice starts a tile */
            q8_gemm_quantized_rows(xq.q + starts[e] * blocks, xq.sums + starts[e] * blocks * 16,
                                   weights + e * per_expert, type & ~TYPE_FLAGS, NULL, out + starts[e] * out_stride,
                                   out_stride, starts[e + 1] - starts[e], first, rows, n, k);
        else
#pragma omp parallel num_threads(1)
            quant_matmul_tasks(x + starts[e] * x_stride, x_stride, weights + e * per_expert + first * row_bytes, type,
                               NULL, out + starts[e] * out_stride + first, out_stride, starts[e + 1] - starts[e], rows,
                               k);
        for (int64_t i = starts[e]; scales != NULL && i < starts[e + 1]; i++) /* a multiply alone: no FMA */
            for (int64_t j = first; j < first + rows; j++) out[i * out_stride + j] *= scales[i];
    }
}

/* Q8_K rows for `rows` rows of k weights, q and sums in one allocation (NULL q where not int8). */
static quantized_rows_t quantized_rows(int int8, int64_t rows, int64_t k) {
    quantized_rows_t out = {NULL, NULL};
    if (!int8 || rows == 0) return out;
    out.q = malloc((size_t)(rows * (k / 256)) * (sizeof(block_q8_k) + 16 * sizeof(int32_t)));
    if (out.q != NULL) out.sums = (int32_t *)(out.q + rows * (k / 256));
    return out;
}

/* out [tokens, hidden] = sum over each token's top_k slots of weights[t, s] * expert(x[t]), where
 * expert e is down_e(silu(gate_e x) * up_e x). x: [tokens, hidden] rows x_stride floats apart;
 * experts, weights: [tokens, top_k] (int64 ids, fp32 weights); gate_up: [num_experts, 2 width,
 * hidden] in blocks of gate_up_type (gate rows then up rows), down: [num_experts, hidden, width] in
 * blocks of down_type, each expert's rows back to back; a type with INT8_ACTIVATIONS | INT8_REPACKED
 * (Q4_K, Q6_K): each expert's rows (a multiple of 16) in q8_repack's tiles instead, experts back to
 * back. Returns nonzero (nothing written) for a type or width the kernels do not take (int8 rows on
 * blocks not repacked among them), an expert id out of range, or buffers it could not allocate. */
int moe_experts_f32(const float *x, int64_t x_stride, const int64_t *experts, const float *weights, int64_t tokens,
                    int64_t top_k, const uint8_t *gate_up, int64_t gate_up_type, const uint8_t *down,
                    int64_t down_type, int64_t num_experts, int64_t hidden, int64_t width, float *out,
                    int num_threads) {
    if (!quant_shape_ok(gate_up_type, hidden) || !quant_shape_ok(down_type, width)) return 1;
    const int gate_up_int8 = (gate_up_type & INT8_REPACKED) != 0, down_int8 = (down_type & INT8_REPACKED) != 0;
    if ((gate_up_type & INT8_ACTIVATIONS && !gate_up_int8) || (down_type & INT8_ACTIVATIONS && !down_int8)) return 1;
    /* the call quantizes rows to Q8_K: repacked 32-block types (Q8_0, Q5_0, Q5_1) are not taken */
    if ((gate_up_int8 && !q8_k_activations(gate_up_type & ~TYPE_FLAGS)) ||
        (down_int8 && !q8_k_activations(down_type & ~TYPE_FLAGS))) return 1;
    const int64_t pairs = tokens * top_k, hidden_blocks = hidden / 256;
    if (pairs == 0) return 0;
    int64_t *indices = malloc((size_t)(3 * num_experts + 1 + 3 * pairs) * sizeof(int64_t));
    /* rows [pairs, hidden]: x's rows by expert, then the down projections' outputs in their place;
     * gate_up [pairs, 2 width]: SiLU * up overwrites the gate half; then each row's routing weight */
    float *rows = malloc((size_t)(pairs * (hidden + 2 * width + 1)) * sizeof(float));
    /* int8: x's tokens quantized, then copied to their pairs' rows by expert; SiLU * up's rows */
    quantized_rows_t token_q8 = quantized_rows(gate_up_int8, tokens, hidden);
    quantized_rows_t gate_up_q8 = quantized_rows(gate_up_int8, pairs, hidden);
    quantized_rows_t down_q8 = quantized_rows(down_int8, pairs, width);
    int failed = 1;
    if (indices == NULL || rows == NULL || (gate_up_int8 && (token_q8.q == NULL || gate_up_q8.q == NULL)) ||
        (down_int8 && down_q8.q == NULL))
        goto done;
    int64_t *starts = indices, *next = starts + num_experts + 1, *order = next + num_experts;
    int64_t *position = order + pairs, *by_expert = position + pairs, *routed = by_expert + pairs;
    const int64_t count = group_pairs(experts, tokens, top_k, num_experts, starts, next, order, position, by_expert,
                                      routed);
    if (count < 0) goto done;
    float *projected = rows + pairs * hidden, *row_weights = projected + pairs * 2 * width;
    for (int64_t i = 0; i < pairs; i++) row_weights[i] = weights[(order[i] % tokens) * top_k + order[i] / tokens];
    const int64_t whole = pairs >= WHOLE_EXPERT_ROWS * count && count >= WHOLE_EXPERT_ITEMS_PER_THREAD * num_threads;
#pragma omp parallel num_threads(num_threads)
    {
        if (gate_up_int8) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tokens; t++)
                q8_gemm_quantize_row(x + t * x_stride, gate_up_type & ~TYPE_FLAGS, hidden,
                                     token_q8.q + t * hidden_blocks, token_q8.sums + t * hidden_blocks * 16);
#pragma omp for schedule(static)
            for (int64_t i = 0; i < pairs; i++) {
                const int64_t t = order[i] % tokens;
                memcpy(gate_up_q8.q + i * hidden_blocks, token_q8.q + t * hidden_blocks,
                       (size_t)hidden_blocks * sizeof(block_q8_k));
                memcpy(gate_up_q8.sums + i * hidden_blocks * 16, token_q8.sums + t * hidden_blocks * 16,
                       (size_t)hidden_blocks * 16 * sizeof(int32_t));
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < pairs; i++)
                memcpy(rows + i * hidden, x + (order[i] % tokens) * x_stride, (size_t)hidden * sizeof(float));
        }
        routed_matmul(routed, count, starts, whole, rows, hidden, gate_up_q8, gate_up, gate_up_type, NULL, projected,
                      2 * width, 2 * width, hidden);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < pairs; i++) {
            float *row = projected + i * 2 * width;
            silu_mul_row(row, row + width, row, width);
            if (down_int8)
                q8_gemm_quantize_row(row, down_type & ~TYPE_FLAGS, width, down_q8.q + i * (width / 256),
                                     down_q8.sums + i * (width / 256) * 16);
        }
        routed_matmul(routed, count, starts, whole, projected, 2 * width, down_q8, down, down_type, row_weights, rows,
                      hidden, hidden, width);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; t++) {
            float *o = out + t * hidden;
            memset(o, 0, (size_t)hidden * sizeof(float));
            for (int64_t r = 0; r < top_k; r++) {
                const float *row = rows + position[by_expert[t * top_k + r] * tokens + t] * hidden;
                for (int64_t j = 0; j < hidden; j++) o[j] += row[j];
            }
        }
    }
    failed = 0;
done:
    free(indices);
    free(rows);
    free(token_q8.q);
    free(gate_up_q8.q);
    free(down_q8.q);
    return failed;
}
