/* The 8-bit activation path's blocks and dot products (--cpu-activations int8): rows of x quantized
 * to 8-bit integers with one scale a block, multiplied by GGUF weight blocks with integer dot
 * products, as llama.cpp computes (its numerics, not its code):
 *   Q8_K (for Q4_K, Q5_K, Q6_K weights): 256 values, d = max / -127 of the value largest in magnitude,
 *        q = round-to-nearest-even(x / d) capped at 127, and the 16 sums of 16 q's (bsums), which
 *        carry a K-quant's per-sub-block minimum (Q4_K) or its -32 offset (Q6_K) in 16 products.
 *   Q8_0 (for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 weights): 32 values, d = amax / 127 the same way, and the
 *        sum of the 32 q's (Q4_0's -8 and Q5_0's -16 offsets, Q4_1's and Q5_1's minimum).
 * Every integer sum is exact; a block's sum becomes a float once, times the weight's and x's scales. */
#ifndef ROSEINFER_Q8_ACTIVATIONS_H
#define ROSEINFER_Q8_ACTIVATIONS_H

#include <stddef.h>
#include <stdint.h>

#define Q8_GROUP 4 /* rows of x a weight row is multiplied into at once, decoded once for them */

typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
} block_q8_k;

typedef struct {
    float d;
    int32_t sum;
    int8_t qs[32];
} block_q8_0;

/* Whether the int8 path multiplies weights of this GGML type by Q8_K (else Q8_0) rows. */
int q8_k_activations(int64_t type);

/* sums[r] = weight row w (GGML type `type`, blocks blocks of it) times activation row r of x,
 * r < rows <= Q8_GROUP; x's rows are `blocks` activation blocks each, back to back */
void q8_k_dots(int64_t type, const uint8_t *w, const block_q8_k *x, int64_t blocks, int rows, float *sums);
void q8_0_dots(int64_t type, const uint8_t *w, const block_q8_0 *x, int64_t blocks, int rows, float *sums);

/* quant_matmul_tasks for a weight of a type q8_handles, x quantized to 8 bits a row first (shared over
 * the threads of the enclosing parallel region); returns 0 (nothing done) where the rows' buffer
 * could not be allocated */
int q8_matmul_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                    float *out, int64_t m, int64_t n, int64_t k);

/* x[0..k) (k a multiple of 256) as k / 256 Q8_K blocks */
void quantize_row_q8_k(const float *x, int64_t k, block_q8_k *out);

/* x[0..k) (k a multiple of 32) as k / 32 Q8_0 blocks */
void quantize_row_q8_0(const float *x, int64_t k, block_q8_0 *out);

/* quant_matmul_tasks for a Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 or Q5_1 weight repacked by q8_repack (csrc/q8_gemm.c),
 * x quantized to Q8_K (Q8_0 for the 32-weight blocks) a row first; out: [m, n] in rows out_stride floats apart (NaN where the rows' buffer could
 * not be allocated) */
void q8_gemm_tasks(const float *x, int64_t x_stride, const uint8_t *packed, int64_t type, const float *bias,
                   float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k);

/* x's rows quantized once for every repacked part of one weight (a fused q/k/v reads them once, not
 * once a part): the forms its parts' types read (q8_rows_forms) in one buffer of q8_rows_bytes */
#define Q8_ROWS_Q4_K 1u /* Q8_K blocks and Q4_K's sums */
#define Q8_ROWS_Q6_K 2u /* Q8_K blocks and Q6_K's sums */
#define Q8_ROWS_32 4u   /* Q8_0 blocks */
typedef struct {
    unsigned forms;
    int64_t k;
    block_q8_k *k_rows;
    int32_t *sums[2]; /* Q4_K's, Q6_K's: 16 a block */
    block_q8_0 *rows32;
} q8_rows_t;

unsigned q8_rows_forms(int64_t type);
size_t q8_rows_bytes(unsigned forms, int64_t m, int64_t k);
q8_rows_t q8_rows_at(void *buffer, unsigned forms, int64_t m, int64_t k);
/* row i of x, k floats, into every form of rows */
void q8_rows_quantize(const q8_rows_t *rows, const float *x, int64_t i);
/* q8_gemm_tasks' tiles on rows quantized already, shared over the enclosing parallel region with no
 * barrier after them: a weight's parts run back to back, each thread on its share of each */
void q8_gemm_part_tasks(const q8_rows_t *rows, const uint8_t *packed, int64_t type, const float *bias, float *out,
                        int64_t out_stride, int64_t m, int64_t n);

/* Row i of x quantized as q8_gemm_tasks quantizes it: k / 256 Q8_K blocks at out and the 16 integer
 * sums a block that a `type` (Q4_K, Q5_K or Q6_K) tile reads besides the q's, at sums */
void q8_gemm_quantize_row(const float *x, int64_t type, int64_t k, block_q8_k *out, int32_t *sums);

/* q8_gemm_tasks' output rows [first_row, first_row + rows) (first_row a multiple of 16; clipped at n)
 * for m rows of x already quantized by q8_gemm_quantize_row (rows k / 256 blocks and 16 k / 256 sums
 * apart), on the calling thread alone; the same bits as q8_gemm_tasks gives those outputs */
void q8_gemm_quantized_rows(const block_q8_k *x, const int32_t *sums, const uint8_t *packed, int64_t type,
                            const float *bias, float *out, int64_t out_stride, int64_t m, int64_t first_row,
                            int64_t rows, int64_t n, int64_t k);

/* Unpacks a Q4_K block's 12 scale bytes into 8 6-bit scales (out[0..7]) and 8 mins (out[8..15]). */
static inline void q4_k_unpack_scales(const uint8_t *packed, uint8_t out[16]) {
    uint32_t in[3], fields[4];
    __builtin_memcpy(in, packed, sizeof in);
    fields[0] = in[0] & 0x3f3f3f3fu;
    fields[1] = (in[2] & 0x0f0f0f0fu) | ((in[0] >> 6) & 0x03030303u) << 4;
    fields[2] = in[1] & 0x3f3f3f3fu;
    fields[3] = ((in[2] >> 4) & 0x0f0f0f0fu) | ((in[1] >> 6) & 0x03030303u) << 4;
    __builtin_memcpy(out, fields, sizeof fields);
}

#endif
