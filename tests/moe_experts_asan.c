/* Runs csrc/moe_experts.c's one-call routed experts for tests/test_asan_kernels.py, built with
 * AddressSanitizer: any read or write outside a buffer aborts with a report. Every type (gate/up and
 * down of the same type, and of two types), 1, 7 and 48 tokens (partial row groups, the tiled
 * kernel's rows; on one thread, whole experts as work items), an expert no token routes to, rows of x
 * wider than hidden (a stride); and with int8 activations, Q4_K and Q6_K repacked into exactly sized
 * buffers of tiles (gate/up and down, and gate/up beside exact Q8_0 down). The blocks
 * are random bytes with small fp16 scales (values do not matter here). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "asan_blocks.h"
#include "kernels.h"

static const int64_t TYPES[][3] = {{2, 18, 32}, {3, 20, 32}, {8, 34, 32}, {12, 144, 256}, {13, 176, 256}, {14, 210, 256}};
#define EXPERTS 5
#define TOP_K 3

#define INT8_REPACKED_TYPE 0x300 /* quants.h's INT8_ACTIVATIONS | INT8_REPACKED */

/* A weight [n, k] of TYPES[t] as random blocks, or with int8 (Q4_K, Q6_K) repacked into a buffer of
 * exactly its tiles' bytes; its type (flags included) at *type. */
static uint8_t *weight(int t, int64_t n, int64_t k, int int8, int64_t *type) {
    uint8_t *w = blocks(n * k / TYPES[t][2], TYPES[t][1]);
    *type = TYPES[t][0];
    if (!int8) return w;
    uint8_t *tiles = malloc((size_t)q8_repacked_bytes(*type, n, k));
    if (q8_repack(w, *type, n, k, tiles, 2) != 0) abort();
    free(w);
    *type |= INT8_REPACKED_TYPE;
    return tiles;
}

/* one call; returns its result */
static int run_with(int gate_up_t, int down_t, int64_t tokens, int threads, int gate_up_int8, int down_int8) {
    const int64_t hidden = 256, width = 256, stride = hidden + 16;
    int64_t gu_type, down_type;
    uint8_t *gate_up = weight(gate_up_t, EXPERTS * 2 * width, hidden, gate_up_int8, &gu_type);
    uint8_t *down = weight(down_t, EXPERTS * hidden, width, down_int8, &down_type);
    float *x = malloc(sizeof(float) * (size_t)(tokens * stride)), *out = malloc(sizeof(float) * (size_t)(tokens * hidden));
    float *weights = malloc(sizeof(float) * (size_t)(tokens * TOP_K));
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)(tokens * TOP_K));
    for (int64_t i = 0; i < tokens * stride; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t s = 0; s < TOP_K; s++) { /* experts 0..3, distinct per token; expert 4 gets none */
            ids[t * TOP_K + s] = (t + s) % 4;
            weights[t * TOP_K + s] = 0.25f;
        }
    const int failed = moe_experts_f32(x, stride, ids, weights, tokens, TOP_K, gate_up, gu_type, down, down_type,
                                       EXPERTS, hidden, width, out, threads);
    free(gate_up); free(down); free(x); free(out); free(weights); free(ids);
    return failed;
}

static int run(int gate_up_t, int down_t, int64_t tokens, int threads) {
    return run_with(gate_up_t, down_t, tokens, threads, 0, 0);
}

int main(void) {
    for (int t = 0; t < 6; t++)
        for (int64_t tokens = 1; tokens <= 48; tokens = tokens == 1 ? 7 : tokens == 7 ? 48 : 49)
            if (run(t, t, tokens, 2) != 0 || run(t, (t + 3) % 6, tokens, 2) != 0 || run(t, t, tokens, 1) != 0) {
                printf("types %d: moe_experts_f32 returned nonzero\n", t);
                return 1;
            }
    for (int64_t tokens = 1; tokens <= 48; tokens = tokens == 1 ? 7 : tokens == 7 ? 48 : 49) /* Q4_K 3, Q6_K 5, Q8_0 2 */
        if (run_with(3, 5, tokens, 2, 1, 1) != 0 || run_with(5, 3, tokens, 1, 1, 1) != 0 ||
            run_with(3, 2, tokens, 2, 1, 0) != 0) {
            printf("int8: moe_experts_f32 returned nonzero\n");
            return 1;
        }
    /* an expert id out of range and a width that is not whole blocks are refused */
    const int64_t bad_ids[2] = {0, EXPERTS};
    const float weights[2] = {0.5f, 0.5f};
    float x[32] = {0}, out[32];
    if (moe_experts_f32(x, 32, bad_ids, weights, 1, 2, NULL, 8, NULL, 8, EXPERTS, 32, 32, out, 2) == 0 ||
        moe_experts_f32(x, 32, bad_ids, weights, 1, 2, NULL, 12, NULL, 8, EXPERTS, 32, 32, out, 2) == 0) {
        printf("an expert id out of range or a width that is not whole blocks was accepted\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
