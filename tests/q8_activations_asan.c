/* Runs the 8-bit activation matmul (csrc/q8_activations.c through quant_matmul_f32, the weight type
 * carrying INT8_ACTIVATIONS) for tests/test_asan_kernels.py, built with AddressSanitizer: any read or
 * write outside a buffer aborts with a report. Every type it takes, one block per row and three, row
 * counts that leave partial groups of rows, and an output width that leaves a partial tile; also
 * through the norm prologue, as the one-call decode stack calls it (Q5_K's unrepacked blocks take the
 * fp32 path); the K-quants, Q8_0, Q5_0 and Q5_1 also repacked into csrc/q8_gemm.c's tiles of 16 rows (37: a partial tile) and run through its GEMM, alone
 * and as the parts of one weight (x's rows quantized once into every form they read). The blocks are
 * random bytes with small fp16 scales (values do not matter here). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "asan_blocks.h"
#include "kernels.h"

#define INT8_ACTIVATIONS 0x100 /* csrc/quants.h's */
#define INT8_REPACKED 0x200

static const int64_t TYPES[][3] = {{2, 18, 32},    {3, 20, 32},    {6, 22, 32},    {7, 24, 32},
                                   {8, 34, 32},    {12, 144, 256}, {13, 176, 256}, {14, 210, 256}};

int main(void) {
    for (int t = 0; t < (int)(sizeof TYPES / sizeof TYPES[0]); t++) {
        const int64_t type = TYPES[t][0] | INT8_ACTIVATIONS, bytes = TYPES[t][1], per_block = TYPES[t][2];
        for (int64_t blocks_per_row = 1; blocks_per_row <= 3; blocks_per_row += 2) {
            const int64_t k = blocks_per_row * per_block, n = 37;
            uint8_t *w = blocks(n * blocks_per_row, bytes), *packed = NULL;
            int64_t gemm_type = 0;
            const int64_t base = TYPES[t][0];
            /* Q5_0, Q5_1, Q8_0 and the K-quants: the repacked copy, exactly as long as q8_repacked_bytes says */
            if (base == 6 || base == 7 || base == 8 || per_block == 256) {
                packed = malloc((size_t)q8_repacked_bytes(TYPES[t][0], n, k));
                gemm_type = type | INT8_REPACKED;
                if (q8_repack(w, TYPES[t][0], n, k, packed, 2) != 0) {
                    printf("type %ld: repacking failed\n", (long)type);
                    return 1;
                }
            }
            for (int64_t m = 1; m <= 11; m += 5) {
                float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * n));
                float *norm = malloc(sizeof(float) * (size_t)k), *bias = malloc(sizeof(float) * (size_t)n);
                for (int64_t i = 0; i < m * k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
                for (int64_t i = 0; i < k; i++) norm[i] = 1.0f;
                for (int64_t i = 0; i < n; i++) bias[i] = 0.5f;
                if (quant_matmul_f32(x, k, w, type, bias, out, m, n, k, 2) != 0 ||
                    rms_norm_packed_matmul_f32(x, k, NULL, norm, 1e-5f, w, type, NULL, out, m, n, k, 2) != 0) {
                    printf("type %ld: a matmul returned nonzero\n", (long)type);
                    return 1;
                }
                if (packed != NULL && (quant_matmul_f32(x, k, packed, gemm_type, bias, out, m, n, k, 2) != 0 ||
                                       rms_norm_packed_matmul_f32(x, k, NULL, norm, 1e-5f, packed, gemm_type, NULL, out,
                                                                  m, n, k, 2) != 0)) {
                    printf("type %ld: a repacked matmul returned nonzero\n", (long)gemm_type);
                    return 1;
                }
                free(x); free(out); free(norm); free(bias);
            }
            free(w);
            free(packed);
        }
    }
    /* a weight in Q4_K, Q6_K and Q8_0 parts of 37 rows each, every part repacked */
    const int64_t part_types[3][3] = {{12, 144, 256}, {14, 210, 256}, {8, 34, 32}}, k = 512, n = 37;
    weight_part_t parts[3];
    for (int p = 0; p < 3; p++) {
        uint8_t *w = blocks(n * k / part_types[p][2], part_types[p][1]);
        uint8_t *packed = malloc((size_t)q8_repacked_bytes(part_types[p][0], n, k));
        if (q8_repack(w, part_types[p][0], n, k, packed, 2) != 0) {
            printf("part %d: repacking failed\n", p);
            return 1;
        }
        parts[p] = (weight_part_t){packed, part_types[p][0] | INT8_ACTIVATIONS | INT8_REPACKED, n};
        free(w);
    }
    for (int64_t m = 1; m <= 11; m += 5) {
        float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * 3 * n));
        float *norm = malloc(sizeof(float) * (size_t)k);
        for (int64_t i = 0; i < m * k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
        for (int64_t i = 0; i < k; i++) norm[i] = 1.0f;
        if (weight_matmul_f32(x, k, parts, -3, NULL, out, m, 3 * n, k, 2) != 0 ||
            rms_norm_packed_matmul_f32(x, k, NULL, norm, 1e-5f, parts, -3, NULL, out, m, 3 * n, k, 2) != 0) {
            printf("parts: a matmul returned nonzero\n");
            return 1;
        }
        free(x); free(out); free(norm);
    }
    for (int p = 0; p < 3; p++) free((void *)parts[p].blocks);
    printf("ok\n");
    return 0;
}
