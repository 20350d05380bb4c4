/* Runs csrc/quant_matmul.c's matmul and row lookup for tests/test_quantized.py, built with
 * AddressSanitizer: any read or write outside a buffer aborts with a report. Every type, a single
 * block per row and several, row counts that leave a partial row group, output widths that leave a
 * partial tile. The blocks are random bytes with small fp16 scales (values do not matter here). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "asan_blocks.h"
#include "kernels.h"

static const int64_t TYPES[][3] = {{2, 18, 32},   {3, 20, 32},    {6, 22, 32},    {7, 24, 32},   {8, 34, 32},
                                   {12, 144, 256}, {13, 176, 256}, {14, 210, 256}, {39, 17, 32}};

int main(void) {
    for (int t = 0; t < (int)(sizeof TYPES / sizeof TYPES[0]); t++) {
        const int64_t type = TYPES[t][0], bytes = TYPES[t][1], per_block = TYPES[t][2];
        for (int64_t blocks_per_row = 1; blocks_per_row <= 3; blocks_per_row += 2) {
            const int64_t k = blocks_per_row * per_block, n = 37;
            uint8_t *w = blocks(n * blocks_per_row, bytes);
            /* 13: the K-quants' pipelined tiles; 37 and 73: partial vectors of x^T in the tiles; 300:
             * the tiles panel by panel */
            for (int r = 0; r < 7; r++) {
                const int64_t m = (const int64_t[]){1, 13, 19, 37, 55, 73, 300}[r];
                float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * n));
                float *bias = malloc(sizeof(float) * (size_t)n);
                for (int64_t i = 0; i < m * k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
                for (int64_t i = 0; i < n; i++) bias[i] = 0.5f;
                if (quant_matmul_f32(x, k, w, type, bias, out, m, n, k, 2) != 0) {
                    printf("type %ld: quant_matmul_f32 returned nonzero\n", (long)type);
                    return 1;
                }
                free(x); free(out); free(bias);
            }
            const int64_t ids[3] = {n - 1, 0, n / 2};
            float *rows = malloc(sizeof(float) * (size_t)(3 * k));
            if (dequantize_rows_f32(w, type, ids, 3, k, rows, 2) != 0) {
                printf("type %ld: dequantize_rows_f32 returned nonzero\n", (long)type);
                return 1;
            }
            free(rows);
            free(w);
        }
    }
    /* Q4_K panel by panel: over two bands of tiles (46 tiles of 48 rows by 512 rows of x: past 4 MB),
     * then in three chunks of rows (368, 368 and 364 of 1100), then in chunks of 512 and 488 rows
     * whose band sums differ the other way (43 tiles: two bands at 512 rows, one larger band at 488) */
    for (int c = 0; c < 3; c++) {
        const int64_t m = (const int64_t[]){512, 1100, 1000}[c], n = (const int64_t[]){2200, 150, 2048}[c], k = 256;
        uint8_t *w = blocks(n, 144);
        float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * n));
        for (int64_t i = 0; i < m * k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
        if (quant_matmul_f32(x, k, w, 12, NULL, out, m, n, k, 2) != 0) {
            printf("bands and chunks: quant_matmul_f32 returned nonzero\n");
            return 1;
        }
        free(x); free(out); free(w);
    }
    /* Q4_K and Q6_K pipelined over several tiles a thread, the last partial (150 rows of W), at 1 to 4
     * vectors of x^T, three blocks a row (six panels a tile) */
    for (int t = 0; t < 8; t++) {
        const int64_t type = t % 2 == 0 ? 12 : 14, bytes = t % 2 == 0 ? 144 : 210, n = 150, k = 768;
        const int64_t m = (const int64_t[]){16, 24, 40, 64}[t / 2];
        uint8_t *w = blocks(n * 3, bytes);
        float *x = malloc(sizeof(float) * (size_t)(m * k)), *out = malloc(sizeof(float) * (size_t)(m * n));
        for (int64_t i = 0; i < m * k; i++) x[i] = (float)rand() / RAND_MAX - 0.5f;
        if (quant_matmul_f32(x, k, w, type, NULL, out, m, n, k, 2) != 0) {
            printf("pipelined: quant_matmul_f32 returned nonzero\n");
            return 1;
        }
        free(x); free(out); free(w);
    }
    /* a type not handled and a row that is not whole blocks are refused */
    if (quant_matmul_f32(NULL, 0, NULL, 10, NULL, NULL, 1, 1, 32, 1) == 0 ||
        quant_matmul_f32(NULL, 0, NULL, 12, NULL, NULL, 1, 1, 32, 1) == 0) {
        printf("an unsupported type or width was accepted\n");
        return 1;
    }
    printf("ok\n");
    return 0;
}
