/* Q4_K and Q6_K times a few rows of x on AVX-512: each weight row is read once, its 16-weight
 * vectors dequantized once per group of up to KQ_GROUP rows of x and multiplied into every row of the
 * group from a register. Same weights as quants.h's dequant_chunk and fp32 sums (another order).
 *
 * What the generic kernel spent its instructions on, and what replaces it:
 *   Q4_K: a nibble to a float was a widen, an and (or a shift), an int-to-float conversion and a
 *         multiply-add with the sub-block's scale and min. Here each sub-block's 16 possible weights
 *         (d sc q - dmin mn, q = 0..15) are one vector computed once, and vpermps looks a nibble up
 *         in it directly: vpermps reads only an index's low 4 bits, so the low nibble needs no mask
 *         and the high one only a shift. Half a widen, half a shift and a lookup per 16 weights; a
 *         block's 8 scales and 8 mins are decoded and converted in one vector.
 *   Q6_K: the 6-bit integers are assembled 64 bytes at a time in byte vectors (nibbles and the
 *         2 high bits with masks and 16-bit-lane shifts, minus 32) instead of in 64-bit words,
 *         then widened, converted and scaled 16 at a time, with the block's 16 scales converted
 *         together once.
 * The entry takes one 2-D weight (rows back to back), so a 3-D tensor runs one slice at a time. The
 * same vectors, stored, dequantize the tiles of csrc/quant_tiled_matmul.c. */
#include <stdint.h>
#include <string.h>

#include "quants.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

/* __m512 indexed as acc[row][chain]: independent FMA chains per row, so one or two rows do not wait
 * on the FMA latency; from three rows two chains each */
#define KQ_CHAINS 4
/* rows of x a weight row is multiplied into at once: four rows of x (k = 2048) stay in L1, where
 * eight ran slower than the generic kernel at 16 rows */
#define KQ_GROUP 4
#define CHAINS(rows) ((rows) <= 2 ? 4 : 2)

/* A Q4_K block's 8 scales (lanes 0-7, times d) and 8 mins (lanes 8-15, times dmin) as floats: the
 * 6-bit fields of its 12 scale bytes regrouped with 32-bit masks into 8 scale bytes then 8 min bytes,
 * and converted together (one at a time, they were most of a block's instructions) */
static inline __m512 q4_k_scales_mins(const uint8_t *b) {
    uint32_t packed[3], fields[4];
    memcpy(packed, b + 4, sizeof packed);
    fields[0] = packed[0] & 0x3f3f3f3fu;
    fields[1] = (packed[2] & 0x0f0f0f0fu) | ((packed[0] >> 6) & 0x03030303u) << 4;
    fields[2] = packed[1] & 0x3f3f3f3fu;
    fields[3] = ((packed[2] >> 4) & 0x0f0f0f0fu) | ((packed[1] >> 6) & 0x03030303u) << 4;
    const __m512 ints = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)fields)));
    const __m512 factors = _mm512_insertf32x8(_mm512_set1_ps(fp16_to_f32(b)), _mm256_set1_ps(fp16_to_f32(b + 2)), 1);
    return _mm512_mul_ps(ints, factors);
}

/* the 16 weights a nibble can stand for (scale * q - min, q = 0..15) in sub-blocks 2p (low nibbles)
 * and 2p + 1 (high nibbles) */
static inline void q4_k_tables(__m512 scales_mins, int p, __m512 *low_table, __m512 *high_table) {
    const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    *low_table = _mm512_fmsub_ps(_mm512_permutexvar_ps(_mm512_set1_epi32(2 * p), scales_mins), nibble_values,
                                 _mm512_permutexvar_ps(_mm512_set1_epi32(8 + 2 * p), scales_mins));
    *high_table = _mm512_fmsub_ps(_mm512_permutexvar_ps(_mm512_set1_epi32(2 * p + 1), scales_mins), nibble_values,
                                  _mm512_permutexvar_ps(_mm512_set1_epi32(9 + 2 * p), scales_mins));
}

/* weights 64 p + 16 h .. + 15 (low) and 64 p + 32 + 16 h .. + 15 (high) of the Q4_K block at b */
static inline void q4_k_vectors(const uint8_t *b, int p, int h, __m512 low_table, __m512 high_table, __m512 *low,
                                __m512 *high) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 + 32 * p + 16 * h)));
    *low = _mm512_permutexvar_ps(bytes, low_table);
    *high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), high_table);
}

/* acc[r][*] += dequantized weight row `w` (Q4_K, k weights) times row r of x, r < rows */
static inline __attribute__((always_inline)) void q4_k_rows(const uint8_t *w, const float *x, int64_t x_stride,
                                                           int64_t k, const int rows, __m512 acc[][KQ_CHAINS]) {
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 144;
        const __m512 scales_mins = q4_k_scales_mins(b);
        for (int p = 0; p < 4; p++) {
            __m512 low_table, high_table;
            q4_k_tables(scales_mins, p, &low_table, &high_table);
            for (int h = 0; h < 2; h++) {
                __m512 low, high;
                q4_k_vectors(b, p, h, low_table, high_table, &low, &high);
                const int64_t col = 256 * blk + 64 * p + 16 * h;
                for (int r = 0; r < rows; r++) {
                    const float *xr = x + r * x_stride + col;
                    const int c = (2 * h) % CHAINS(rows);
                    acc[r][c] = _mm512_fmadd_ps(low, _mm512_loadu_ps(xr), acc[r][c]);
                    acc[r][c + 1] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xr + 32), acc[r][c + 1]);
                }
            }
        }
    }
}

/* A Q6_K block's 16 scales times d, as floats */
static inline __m512 q6_k_scales(const uint8_t *b) {
    return _mm512_mul_ps(_mm512_set1_ps(fp16_to_f32(b + 208)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 192)))));
}

/* q[0..128) = the 6-bit integers minus 32 of half `half` of the Q6_K block at b, in weight order */
static inline void q6_k_half_ints(const uint8_t *b, int half, int8_t q[128]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    /* the 2 high bits of t = 0, 1 (first, second 32 bytes) sit at bits 0-1, 2-3 of qh: shifted up to
     * bits 4-5; those of t = 2, 3 at bits 4-5, 6-7 */
    const __m512i up01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down23 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i ql = _mm512_loadu_si512((const void *)(b + 64 * half));
    const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half)));
    const __m512i q01 = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, up01), top2));
    const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                        _mm512_and_si512(_mm512_srlv_epi16(qh, down23), top2));
    _mm512_store_si512((void *)q, _mm512_sub_epi8(q01, bias));
    _mm512_store_si512((void *)(q + 64), _mm512_sub_epi8(q23, bias));
}

/* weights 128 half + 16 i .. + 15 of a Q6_K block, from its half's integers q and its scales */
static inline __m512 q6_k_vector(const int8_t q[128], __m512 scales, int half, int i) {
    const __m512 scale = _mm512_permutexvar_ps(_mm512_set1_epi32(8 * half + i), scales);
    return _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(q + 16 * i)))));
}

/* acc[r][*] += dequantized weight row `w` (Q6_K, k weights) times row r of x, r < rows */
static inline __attribute__((always_inline)) void q6_k_rows(const uint8_t *w, const float *x, int64_t x_stride,
                                                           int64_t k, const int rows, __m512 acc[][KQ_CHAINS]) {
    int8_t q[128] __attribute__((aligned(64)));
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 210;
        const __m512 scales = q6_k_scales(b);
        for (int half = 0; half < 2; half++) {
            q6_k_half_ints(b, half, q);
            for (int i = 0; i < 8; i++) {
                const __m512 wv = q6_k_vector(q, scales, half, i);
                const int64_t col = 256 * blk + 128 * half + 16 * i;
                for (int r = 0; r < rows; r++)
                    acc[r][i % CHAINS(rows)] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * x_stride + col),
                                                               acc[r][i % CHAINS(rows)]);
            }
        }
    }
}

/* out[0..256 blocks) = blocks first .. first + blocks - 1 of a Q4_K or Q6_K row, dequantized: the
 * vectors the matmul above multiplies, the values of quants.h's dequant_chunk */
static void kquant_dequantize(int64_t type, const uint8_t *row, int64_t first, int64_t blocks, float *out) {
    int8_t q[128] __attribute__((aligned(64)));
    for (int64_t blk = 0; blk < blocks; blk++) {
        float *o = out + 256 * blk;
        if (type == Q4_K) {
            const uint8_t *b = row + (first + blk) * 144;
            const __m512 scales_mins = q4_k_scales_mins(b);
            for (int p = 0; p < 4; p++) {
                __m512 low_table, high_table;
                q4_k_tables(scales_mins, p, &low_table, &high_table);
                for (int h = 0; h < 2; h++) {
                    __m512 low, high;
                    q4_k_vectors(b, p, h, low_table, high_table, &low, &high);
                    _mm512_storeu_ps(o + 64 * p + 16 * h, low);
                    _mm512_storeu_ps(o + 64 * p + 32 + 16 * h, high);
                }
            }
            continue;
        }
        const uint8_t *b = row + (first + blk) * 210;
        const __m512 scales = q6_k_scales(b);
        for (int half = 0; half < 2; half++) {
            q6_k_half_ints(b, half, q);
            for (int i = 0; i < 8; i++) _mm512_storeu_ps(o + 128 * half + 16 * i, q6_k_vector(q, scales, half, i));
        }
    }
}

static inline __attribute__((always_inline)) void kquant_group(int type, const uint8_t *w, const float *x,
                                                              int64_t x_stride, int64_t k, const int rows,
                                                              float sums[KQ_GROUP]) {
    __m512 acc[KQ_GROUP][KQ_CHAINS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < CHAINS(rows); c++) acc[r][c] = _mm512_setzero_ps();
    if (type == Q4_K)
        q4_k_rows(w, x, x_stride, k, rows, acc);
    else
        q6_k_rows(w, x, x_stride, k, rows, acc);
    for (int r = 0; r < rows; r++) {
        for (int c = 2; c < CHAINS(rows); c++) acc[r][c % 2] = _mm512_add_ps(acc[r][c % 2], acc[r][c]);
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
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
    if (type == Q4_K)
        kquant_tasks(Q4_K, x, x_stride, weight, bias, out, out_stride, m, n, k);
    else if (type == Q6_K)
        kquant_tasks(Q6_K, x, x_stride, weight, bias, out, out_stride, m, n, k);
    else
        return 0;
    return 1;
}

int kquant_dequantize_chunks(int64_t type, const uint8_t *row, int64_t first, int64_t count, float *out) {
    if ((type != Q4_K && type != Q6_K) || first % 8 != 0 || count % 8 != 0) return 0;
    kquant_dequantize(type, row, first / 8, count / 8, out);
    return 1;
}

#else

/* Without AVX-512 (with BW) the generic kernels in quant_matmul.c run every type. */
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
