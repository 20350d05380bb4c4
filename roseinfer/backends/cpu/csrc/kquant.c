/* Q4_K and Q6_K times a few rows of x on AVX-512 (with BW) and AVX2: each weight row is read once, its
 * vectors dequantized once per group of up to KQ_GROUP rows of x and multiplied into every row of the
 * group from a register. Same weights as quants.h's dequant_chunk and fp32 sums (another order).
 *
 * What the generic kernel spent its instructions on, and what replaces it:
 *   Both: each 32 weights decoded their sub-block's 6-bit scale and min and converted d and dmin one at
 *         a time; here a Q4_K block's 8 scales and 8 mins (Q6_K: 16 scales) are regrouped with 32-bit
 *         masks, converted and multiplied by d together, once a block.
 *   Q4_K: on AVX-512 each sub-block's 16 possible weights (d sc q - dmin mn, q = 0..15) are one vector
 *         computed once, and vpermps looks a nibble up in it directly: vpermps reads only an index's
 *         low 4 bits, so the low nibble needs no mask and the high one only a shift. On AVX2 (no
 *         16-entry lookup) 8 bytes widened once give both sub-blocks of a pair their nibbles (an and,
 *         a shift), where the generic kernel widened them once for each.
 *   Q6_K: the 6-bit integers are assembled 64 (AVX2: 32) bytes at a time in byte vectors (nibbles and
 *         the 2 high bits with masks and 16-bit-lane shifts, minus 32) instead of 8 at a time in 64-bit
 *         words, then widened, converted and scaled a vector at a time.
 * The entry takes one 2-D weight (rows back to back), so a 3-D tensor runs one slice at a time. The
 * same vectors, stored, dequantize the tiles of csrc/quant_tiled_matmul.c. On AVX2 one row of x (and
 * Q5_K's one row) takes csrc/kquant_row.c's kernels. */
#include "kquant_blocks.h"

#ifdef KQ_AVX512

/* vec_t indexed as acc[row][chain]: independent FMA chains per row, so one or two rows do not wait
 * on the FMA latency; from three rows two chains each */
#define KQ_CHAINS 4
/* rows of x a weight row is multiplied into at once: four rows of x (k = 2048) stay in L1, where
 * eight ran slower than the generic kernel at 16 rows on AVX-512 */
#define KQ_GROUP 4
#define CHAINS(rows) ((rows) <= 2 ? 4 : 2)

/* acc[r][*] += dequantized weight row `w` (Q4_K, k weights) times row r of x, r < rows */
static inline __attribute__((always_inline)) void q4_k_rows(const uint8_t *w, const float *x, int64_t x_stride,
                                                           int64_t k, const int rows, vec_t acc[][KQ_CHAINS]) {
    float sm[16] __attribute__((aligned(64)));
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 144;
        q4_k_scales_mins(b, sm);
        for (int p = 0; p < 4; p++) {
            vec_t wv[PAIR_VECS];
            q4_k_pair(b, sm, p, wv);
            for (int v = 0; v < PAIR_VECS; v++) {
                const int64_t col = 256 * blk + 64 * p + VEC_FLOATS * v;
                for (int r = 0; r < rows; r++)
                    acc[r][v % CHAINS(rows)] += wv[v] * load_vec(x + r * x_stride + col);
            }
        }
    }
}

/* acc[r][*] += dequantized weight row `w` (Q6_K, k weights) times row r of x, r < rows */
static inline __attribute__((always_inline)) void q6_k_rows(const uint8_t *w, const float *x, int64_t x_stride,
                                                           int64_t k, const int rows, vec_t acc[][KQ_CHAINS]) {
    float ds[16] __attribute__((aligned(64)));
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 210;
        q6_k_scales(b, ds);
        for (int half = 0; half < 2; half++) {
            q6_k_half_t ints;
            q6_k_half_ints(b, half, &ints);
            for (int v = 0; v < HALF_VECS; v++) {
                const vec_t wv = q6_k_vector(&ints, ds, half, v);
                const int64_t col = 256 * blk + 128 * half + VEC_FLOATS * v;
                for (int r = 0; r < rows; r++)
                    acc[r][v % CHAINS(rows)] += wv * load_vec(x + r * x_stride + col);
            }
        }
    }
}

/* out[0..256 blocks) = blocks first .. first + blocks - 1 of a Q4_K or Q6_K row (on AVX2 Q5_K too),
 * dequantized: the vectors the matmul above multiplies, the values of quants.h's dequant_chunk */
static void kquant_dequantize(int64_t type, const uint8_t *row, int64_t first, int64_t blocks, float *out) {
    float scales[16] __attribute__((aligned(64)));
    if (type == Q6_K) {
        q6_k_halves_t run;
        q6_k_halves_start(&run, row + first * 210, 2 * blocks);
        for (int64_t h = 0; h < 2 * blocks; h++) {
            const q6_k_half_t *ints = q6_k_halves_next(&run, h);
            if (h % 2 == 0) q6_k_scales(row + (first + h / 2) * 210, scales);
            for (int v = 0; v < HALF_VECS; v++)
                store_vec(out + 128 * h + VEC_FLOATS * v, q6_k_vector(ints, scales, (int)(h % 2), v));
        }
        return;
    }
    for (int64_t blk = 0; blk < blocks; blk++) {
        float *o = out + 256 * blk;
#if !KQ_AVX512
        if (type == Q5_K) {
            const uint8_t *b = row + (first + blk) * 176;
            q4_k_scales_mins(b, scales);
#pragma GCC unroll 4 /* constant shift counts for q5_k_pair (and Q4_K's loop left as it was: unrolled, it ran slower) */
            for (int p = 0; p < 4; p++) {
                vec_t wv[PAIR_VECS];
                q5_k_pair(b, scales, p, wv);
                for (int v = 0; v < PAIR_VECS; v++) store_vec(o + 64 * p + VEC_FLOATS * v, wv[v]);
            }
            continue;
        }
#endif
        /* always Q4_K by now; the test stays: gcc's tiles ran slower without it (docs/profiling.md section 17) */
        if (type == Q4_K) {
            const uint8_t *b = row + (first + blk) * 144;
            q4_k_scales_mins(b, scales);
            for (int p = 0; p < 4; p++) {
                vec_t wv[PAIR_VECS];
                q4_k_pair(b, scales, p, wv);
                for (int v = 0; v < PAIR_VECS; v++) store_vec(o + 64 * p + VEC_FLOATS * v, wv[v]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void kquant_group(int type, const uint8_t *w, const float *x,
                                                              int64_t x_stride, int64_t k, const int rows,
                                                              float sums[KQ_GROUP]) {
    vec_t acc[KQ_GROUP][KQ_CHAINS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHAINS(rows); c++) acc[r][c] = (vec_t){0};
    if (type == Q4_K)
        q4_k_rows(w, x, x_stride, k, rows, acc);
    else
        q6_k_rows(w, x, x_stride, k, rows, acc);
    for (int r = 0; r < rows; r++) {
        for (int c = 2; c < CHAINS(rows); c++) acc[r][c % 2] += acc[r][c];
        sums[r] = hsum_vec(acc[r][0] + acc[r][1]);
    }
}

static inline __attribute__((always_inline)) void kquant_tasks(int type, const float *x, int64_t x_stride,
                                                              const uint8_t *weight, const float *bias, float *out,
                                                              int64_t out_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t row_bytes = quant_row_bytes(type, k);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *w = weight + j * row_bytes;
        const float b = bias != NULL ? bias[j] : 0.0f;
        /* the row stays in L1 for the later groups: it is read from memory once */
        for (int64_t g = 0; g < m; g += KQ_GROUP) {
            const int rows = m - g < KQ_GROUP ? (int)(m - g) : KQ_GROUP;
            const float *xg = x + g * x_stride;
            float sums[KQ_GROUP];
            /* constant row counts, so the accumulators stay in registers */
            switch (rows) {
            case 1: kquant_group(type, w, xg, x_stride, k, 1, sums); break;
            case 2: kquant_group(type, w, xg, x_stride, k, 2, sums); break;
            case 3: kquant_group(type, w, xg, x_stride, k, 3, sums); break;
            default: kquant_group(type, w, xg, x_stride, k, KQ_GROUP, sums); break;
            }
            for (int r = 0; r < rows; r++) out[(g + r) * out_stride + j] = sums[r] + b;
        }
    }
}

int kquant_matmul_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                        float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k) {
#if KQ_AVX512
    if (type == Q4_K)
        kquant_tasks(Q4_K, x, x_stride, weight, bias, out, out_stride, m, n, k);
    else if (type == Q6_K)
        kquant_tasks(Q6_K, x, x_stride, weight, bias, out, out_stride, m, n, k);
    else
        return 0;
#else
    /* against the generic kernel on AVX2, Q6_K's groups ran slower from two rows, Q4_K's faster at
     * two rows only: so one row (Q5_K's too), and two of Q4_K */
    if (m == 1 && (type == Q6_K || ((type == Q4_K || type == Q5_K) && k / 32 <= MAX_SCALED_CHUNKS)))
        kquant_row_tasks(type, x, weight, bias, out, n, k);
    else if (type == Q4_K && m <= 2)
        kquant_tasks(Q4_K, x, x_stride, weight, bias, out, out_stride, m, n, k);
    else
        return 0;
#endif
    return 1;
}

int kquant_dequantize_chunks(int64_t type, const uint8_t *row, int64_t first, int64_t count, float *out) {
    if ((type != Q4_K && type != Q6_K && (type != Q5_K || KQ_AVX512)) || first % 8 != 0 || count % 8 != 0) return 0;
    kquant_dequantize(type, row, first / 8, count / 8, out);
    return 1;
}

#else

/* Without AVX-512 (with BW) or AVX2 the generic kernels in quant_matmul.c run every type. */
int kquant_matmul_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                        float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k) {
    (void)x, (void)x_stride, (void)weight, (void)type, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k;
    return 0;
}

int kquant_dequantize_chunks(int64_t type, const uint8_t *row, int64_t first, int64_t count, float *out) {
    (void)type, (void)row, (void)first, (void)count, (void)out;
    return 0;
}

#endif
