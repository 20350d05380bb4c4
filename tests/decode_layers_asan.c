/* Runs a whole decode step through csrc/decode_layers.c (and so the norm and SiLU matmul calls of
 * csrc/packed_matmul.c and decode attention) for tests/test_asan_kernels.py, built with
 * AddressSanitizer: any read or write outside a buffer aborts with a report. Shapes with a partial
 * last weight block, a partial last row group and widths that are not whole vectors; the second
 * layer slides, soft-caps and has no rope. GGUF blocks too, and a q/k/v in parts of two types (each
 * part's rows written into its columns of the wider output). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels.h"

static float *randoms(int64_t count) {
    float *p = malloc(sizeof(float) * (size_t)count);
    for (int64_t i = 0; i < count; i++) p[i] = (float)rand() / RAND_MAX - 0.5f;
    return p;
}

/* a weight [rows, k] as the packed layout holds it (whole 64-row blocks), or for quantized as Q8_0
 * blocks (type 8: 34 bytes per 32 weights) */
static void *weight(int64_t rows, int64_t k, int quantized) {
    if (!quantized) return randoms((rows + 63) / 64 * 64 * k);
    uint8_t *blocks = malloc((size_t)(rows * k / 32 * 34));
    for (int64_t i = 0; i < rows * k / 32 * 34; i++) blocks[i] = (uint8_t)rand();
    return blocks;
}

/* a q/k/v weight in three parts, q as Q8_0 and k, v as Q4_0 (type 2: 18 bytes per 32 weights) */
static weight_part_t *qkv_parts(int64_t q_rows, int64_t kv_rows, int64_t k) {
    weight_part_t *parts = malloc(3 * sizeof(weight_part_t));
    parts[0] = (weight_part_t){weight(q_rows, k, 1), 8, q_rows};
    for (int p = 1; p < 3; p++) {
        uint8_t *blocks = malloc((size_t)(kv_rows * k / 32 * 18));
        for (int64_t i = 0; i < kv_rows * k / 32 * 18; i++) blocks[i] = (uint8_t)rand();
        parts[p] = (weight_part_t){blocks, 2, kv_rows};
    }
    return parts;
}

/* quantized: 0 packed fp32, 1 Q8_0 blocks, 2 Q8_0 blocks with q/k/v in parts */
static void run(int64_t n, int64_t hidden, int64_t intermediate, int64_t H, int64_t Hkv, int64_t D, int with_bias,
                int quantized) {
    const int64_t layers_count = 2, bs = 4, max_blocks = 5, slots = n * max_blocks * bs;
    const int64_t q_size = H * D, qkv_size = q_size + 2 * Hkv * D;
    decode_layer_t layers[2];
    for (int64_t l = 0; l < layers_count; l++) {
        const int64_t type = quantized ? 8 : 0;
        const void *qkv = quantized == 2 ? qkv_parts(q_size, Hkv * D, hidden) : weight(qkv_size, hidden, quantized);
        layers[l] = (decode_layer_t){randoms(hidden), randoms(hidden), qkv,
                                     with_bias ? randoms(qkv_size) : NULL, weight(hidden, q_size, quantized),
                                     with_bias ? randoms(hidden) : NULL, weight(2 * intermediate, hidden, quantized),
                                     weight(hidden, intermediate, quantized), randoms(slots * Hkv * D),
                                     randoms(slots * Hkv * D), quantized == 2 ? -3 : type, type, type, type,
                                     l == 0 ? 0 : 6,
                                     l == 0 ? 0.0f : 20.0f, l == 1};
    }
    float *x = randoms(n * hidden), *out = randoms(n * hidden), *rope = randoms(n * D);
    int64_t *tables = malloc(sizeof(int64_t) * (size_t)(n * max_blocks)), *lens = malloc(sizeof(int64_t) * (size_t)n);
    int64_t *new_slots = malloc(sizeof(int64_t) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        for (int64_t b = 0; b < max_blocks; b++) tables[i * max_blocks + b] = i * max_blocks + (max_blocks - 1 - b);
        lens[i] = 1 + (i * 7) % (max_blocks * bs);  /* 1 .. a full table, the new token included */
        const int64_t t = lens[i] - 1;
        new_slots[i] = tables[i * max_blocks + t / bs] * bs + t % bs;
    }
    if (decode_layers_f32(layers, layers_count, x, out, rope, new_slots, tables, lens, n, hidden, intermediate, H, Hkv,
                          D, bs, max_blocks, 1e-5f, 0.25f, 2) != 0) {
        printf("n=%ld hidden=%ld: decode_layers_f32 returned nonzero\n", (long)n, (long)hidden);
        exit(1);
    }
    for (int64_t l = 0; l < layers_count; l++) {
        for (int p = 0; quantized == 2 && p < 3; p++) free((void *)((const weight_part_t *)layers[l].qkv)[p].blocks);
        free((void *)layers[l].input_norm); free((void *)layers[l].post_norm); free((void *)layers[l].qkv);
        free((void *)layers[l].qkv_bias); free((void *)layers[l].o); free((void *)layers[l].o_bias);
        free((void *)layers[l].gate_up); free((void *)layers[l].down); free(layers[l].k_cache);
        free(layers[l].v_cache);
    }
    free(x); free(out); free(rope); free(tables); free(lens); free(new_slots);
}

int main(void) {
    run(1, 80, 100, 4, 2, 16, 0, 0);   /* one row; 80 and 100 end in partial blocks and partial vectors */
    run(7, 80, 100, 4, 2, 16, 1, 0);   /* a partial row group of 1 after one of 6, with biases */
    run(13, 96, 200, 6, 1, 16, 0, 0);  /* multi-query attention */
    run(3, 64, 96, 2, 2, 32, 1, 0);
    run(1, 64, 96, 2, 2, 32, 1, 1);    /* GGUF blocks: one row, and a partial group of 3 after one of 8 */
    run(11, 64, 96, 2, 2, 32, 0, 1);
    run(1, 64, 96, 2, 2, 32, 1, 2);    /* q/k/v in parts: one row, a partial group, and the tiles (20 rows) */
    run(11, 64, 96, 2, 2, 32, 0, 2);
    run(20, 64, 96, 2, 2, 32, 1, 2);
    printf("ok\n");
    return 0;
}
