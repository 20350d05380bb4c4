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
 * same vectors, stored, dequantize the tiles of csrc/quant_tiled_matmul.c. */
#include <stdint.h>
#include <string.h>

#include "quants.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KQ_AVX512 1
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define KQ_AVX512 0
#endif

#ifdef KQ_AVX512
#include <immintrin.h>

/* vec_t indexed as acc[row][chain]: independent FMA chains per row, so one or two rows do not wait
 * on the FMA latency; from three rows two chains each */
#define KQ_CHAINS 4
/* rows of x a weight row is multiplied into at once: four rows of x (k = 2048) stay in L1, where
 * eight ran slower than the generic kernel at 16 rows on AVX-512 */
#define KQ_GROUP 4
#define CHAINS(rows) ((rows) <= 2 ? 4 : 2)
#define PAIR_VECS (64 / VEC_FLOATS)   /* vectors in a pair of Q4_K sub-blocks */
#define HALF_VECS (128 / VEC_FLOATS)  /* vectors in half a Q6_K block */

/* After a block's scales are stored: a compiler barrier, so that each is read back with a broadcast
 * from memory (a load) and not shuffled out of the vector it was stored from (two shuffles each, on
 * the pipes that widen the weights) */
#define SCALES_STORED() __asm__ volatile("" ::: "memory")

/* sm[0..8) = a Q4_K block's 8 scales times d, sm[8..16) = its 8 mins times dmin */
static inline void q4_k_scales_mins(const uint8_t *b, float sm[16]) {
    uint32_t packed[3], fields[4];
    memcpy(packed, b + 4, sizeof packed);
    fields[0] = packed[0] & 0x3f3f3f3fu;
    fields[1] = (packed[2] & 0x0f0f0f0fu) | ((packed[0] >> 6) & 0x03030303u) << 4;
    fields[2] = packed[1] & 0x3f3f3f3fu;
    fields[3] = ((packed[2] >> 4) & 0x0f0f0f0fu) | ((packed[1] >> 6) & 0x03030303u) << 4;
    const __m128i bytes = _mm_loadu_si128((const __m128i *)fields);
    const float d = fp16_to_f32(b), dmin = fp16_to_f32(b + 2);
#if KQ_AVX512
    const __m512 factors = _mm512_insertf32x8(_mm512_set1_ps(d), _mm256_set1_ps(dmin), 1);
    _mm512_storeu_ps(sm, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes)), factors));
#else
    _mm256_storeu_ps(sm, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), _mm256_set1_ps(d)));
    _mm256_storeu_ps(sm + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))),
                                           _mm256_set1_ps(dmin)));
#endif
    SCALES_STORED();
}

/* w = weights 64 p .. 64 p + 63 of the Q4_K block at b (sub-block 2 p from the low nibbles of its
 * 32 bytes, 2 p + 1 from the high ones), in order */
static inline __attribute__((always_inline)) void q4_k_pair(const uint8_t *b, const float sm[16], int p,
                                                           vec_t w[PAIR_VECS]) {
    const uint8_t *q = b + 16 + 32 * p;
#if KQ_AVX512
    const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 low_table = _mm512_fmsub_ps(_mm512_set1_ps(sm[2 * p]), nibble_values, _mm512_set1_ps(sm[8 + 2 * p]));
    const __m512 high_table = _mm512_fmsub_ps(_mm512_set1_ps(sm[2 * p + 1]), nibble_values,
                                              _mm512_set1_ps(sm[9 + 2 * p]));
    for (int h = 0; h < 2; h++) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
        w[h] = (vec_t)_mm512_permutexvar_ps(bytes, low_table);
        w[2 + h] = (vec_t)_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), high_table);
    }
#else
    const __m256 low_scale = _mm256_set1_ps(sm[2 * p]), low_min = _mm256_set1_ps(sm[8 + 2 * p]);
    const __m256 high_scale = _mm256_set1_ps(sm[2 * p + 1]), high_min = _mm256_set1_ps(sm[9 + 2 * p]);
    for (int i = 0; i < 4; i++) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
        const __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
        const __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
        w[i] = (vec_t)_mm256_fmsub_ps(low, low_scale, low_min);
        w[4 + i] = (vec_t)_mm256_fmsub_ps(high, high_scale, high_min);
    }
#endif
}

/* ds[0..16) = a Q6_K block's 16 scales times d */
static inline void q6_k_scales(const uint8_t *b, float ds[16]) {
    const __m128i scales = _mm_loadu_si128((const __m128i *)(b + 192));
    const float d = fp16_to_f32(b + 208);
#if KQ_AVX512
    _mm512_storeu_ps(ds, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(scales))));
#else
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(scales))));
    _mm256_storeu_ps(ds + 8, _mm256_mul_ps(_mm256_set1_ps(d),
                                           _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(scales, 8)))));
#endif
    SCALES_STORED();
}

/* The 6-bit integers minus 32 of half a Q6_K block, in weight order: stored (AVX-512, where they
 * are widened 16 at a time from memory) or in four registers of 32 (AVX2, widened 8 at a time from
 * them) */
#if KQ_AVX512
typedef struct { int8_t q[128] __attribute__((aligned(64))); } q6_k_half_t;
#else
typedef struct { __m256i q[4]; } q6_k_half_t;
#endif

/* half `half` of the Q6_K block at b: weight 32 t + l takes nibble t / 2 of ql[32 (t & 1) + l] and
 * bits 2t, 2t + 1 of qh[l] on top */
static inline __attribute__((always_inline)) void q6_k_half_ints(const uint8_t *b, int half, q6_k_half_t *ints) {
    const uint8_t *ql = b + 64 * half, *qh = b + 128 + 32 * half;
#if KQ_AVX512
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    /* the 2 high bits of t = 0, 1 (first, second 32 bytes) sit at bits 0-1, 2-3 of qh: shifted up to
     * bits 4-5; those of t = 2, 3 at bits 4-5, 6-7 */
    const __m512i up01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down23 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    const __m512i low = _mm512_loadu_si512((const void *)ql);
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
    const __m512i q01 = _mm512_or_si512(_mm512_and_si512(low, low4), _mm512_and_si512(_mm512_sllv_epi16(high, up01), top2));
    const __m512i q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low, 4), low4),
                                        _mm512_and_si512(_mm512_srlv_epi16(high, down23), top2));
    _mm512_store_si512((void *)ints->q, _mm512_sub_epi8(q01, bias));
    _mm512_store_si512((void *)(ints->q + 64), _mm512_sub_epi8(q23, bias));
#else
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30), bias = _mm256_set1_epi8(32);
    const __m256i ql0 = _mm256_loadu_si256((const __m256i *)ql), ql1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i high = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i tops[4] = {_mm256_slli_epi16(high, 4), _mm256_slli_epi16(high, 2), high, _mm256_srli_epi16(high, 2)};
    const __m256i lows[4] = {ql0, ql1, _mm256_srli_epi16(ql0, 4), _mm256_srli_epi16(ql1, 4)};
    for (int t = 0; t < 4; t++)
        ints->q[t] = _mm256_sub_epi8(
            _mm256_or_si256(_mm256_and_si256(lows[t], low4), _mm256_and_si256(tops[t], top2)), bias);
#endif
}

/* integers VEC_FLOATS v .. VEC_FLOATS v + VEC_FLOATS - 1 of a half, as floats */
#if KQ_AVX512
static inline __attribute__((always_inline)) vec_t q6_k_ints(const q6_k_half_t *ints, int v) {
    return (vec_t)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(ints->q + 16 * v))));
}
#else
static inline __attribute__((always_inline)) vec_t q6_k_ints(const q6_k_half_t *ints, int v) {
    const __m256i quarter = ints->q[v / 4];
    const __m128i lane = v % 4 < 2 ? _mm256_castsi256_si128(quarter) : _mm256_extracti128_si256(quarter, 1);
    return (vec_t)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v % 2 ? _mm_unpackhi_epi64(lane, lane) : lane));
}
#endif

/* weights 128 half + VEC_FLOATS v .. + VEC_FLOATS - 1 of a Q6_K block, from its half's integers and
 * its scales ds (one a 16 weights) */
static inline __attribute__((always_inline)) vec_t q6_k_vector(const q6_k_half_t *ints, const float ds[16], int half,
                                                              int v) {
    return ds[8 * half + VEC_FLOATS * v / 16] * q6_k_ints(ints, v);
}

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

#if !KQ_AVX512
/* One row of x on AVX2: each sub-block's scale times the sum of its integers times x, minus its min
 * times x's sum over it (sx: chunk_sums), the form quant_matmul.c's one-row path gives the 32-weight
 * types. A weight then costs no multiply-add of its own: the kernel is bound by its instruction
 * count (docs/profiling.md section 12). */
static float q4_k_row(const uint8_t *w, const float *x, const float *sx, int64_t k) {
    float sm[16] __attribute__((aligned(32)));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 144;
        q4_k_scales_mins(b, sm);
        mins = _mm256_fmadd_ps(_mm256_load_ps(sm + 8), _mm256_loadu_ps(sx + 8 * blk), mins);
        for (int p = 0; p < 4; p++) {
            const uint8_t *q = b + 16 + 32 * p;
            const float *xp = x + 256 * blk + 64 * p;
            __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
                low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15))),
                                      _mm256_loadu_ps(xp + 8 * i), low);
                high = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)),
                                       _mm256_loadu_ps(xp + 32 + 8 * i), high);
            }
            acc0 = _mm256_fmadd_ps(low, _mm256_set1_ps(sm[2 * p]), acc0);
            acc1 = _mm256_fmadd_ps(high, _mm256_set1_ps(sm[2 * p + 1]), acc1);
        }
    }
    return hsum8((vec8)_mm256_add_ps(acc0, acc1)) - hsum8((vec8)mins);
}

/* The same for Q6_K: each 16 weights' scale times the sum of their integers (minus 32) times x */
static float q6_k_row(const uint8_t *w, const float *x, int64_t k) {
    float ds[16] __attribute__((aligned(32)));
    vec8 acc[2] = {{0}, {0}};
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * 210;
        q6_k_scales(b, ds);
        for (int half = 0; half < 2; half++) {
            q6_k_half_t ints;
            q6_k_half_ints(b, half, &ints);
            const float *xh = x + 256 * blk + 128 * half;
            for (int g = 0; g < 8; g++) {
                const vec8 sum = q6_k_ints(&ints, 2 * g) * load8(xh + 16 * g)
                                 + q6_k_ints(&ints, 2 * g + 1) * load8(xh + 16 * g + 8);
                acc[g % 2] += sum * ds[8 * half + g];
            }
        }
    }
    return hsum8(acc[0] + acc[1]);
}
#endif

/* out[0..256 blocks) = blocks first .. first + blocks - 1 of a Q4_K or Q6_K row, dequantized: the
 * vectors the matmul above multiplies, the values of quants.h's dequant_chunk */
static void kquant_dequantize(int64_t type, const uint8_t *row, int64_t first, int64_t blocks, float *out) {
    float scales[16] __attribute__((aligned(64)));
    for (int64_t blk = 0; blk < blocks; blk++) {
        float *o = out + 256 * blk;
        if (type == Q4_K) {
            const uint8_t *b = row + (first + blk) * 144;
            q4_k_scales_mins(b, scales);
            for (int p = 0; p < 4; p++) {
                vec_t wv[PAIR_VECS];
                q4_k_pair(b, scales, p, wv);
                for (int v = 0; v < PAIR_VECS; v++) store_vec(o + 64 * p + VEC_FLOATS * v, wv[v]);
            }
            continue;
        }
        const uint8_t *b = row + (first + blk) * 210;
        q6_k_scales(b, scales);
        for (int half = 0; half < 2; half++) {
            q6_k_half_t ints;
            q6_k_half_ints(b, half, &ints);
            for (int v = 0; v < HALF_VECS; v++)
                store_vec(o + 128 * half + VEC_FLOATS * v, q6_k_vector(&ints, scales, half, v));
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

#if !KQ_AVX512
/* out[j] = x (one row) times weight row j, in the one-row form above */
static void kquant_row_tasks(int64_t type, const float *x, const uint8_t *weight, const float *bias, float *out,
                             int64_t n, int64_t k) {
    const int64_t row_bytes = quant_row_bytes(type, k);
    float sx[MAX_SCALED_CHUNKS];
    if (type == Q4_K) chunk_sums(x, k, sx);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++)
        out[j] = (type == Q4_K ? q4_k_row(weight + j * row_bytes, x, sx, k) : q6_k_row(weight + j * row_bytes, x, k))
                 + (bias != NULL ? bias[j] : 0.0f);
}
#endif

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
     * two rows only: so one row, and two of Q4_K */
    if (m == 1 && (type == Q6_K || (type == Q4_K && k / 32 <= MAX_SCALED_CHUNKS)))
        kquant_row_tasks(type, x, weight, bias, out, n, k);
    else if (type == Q4_K && m <= 2)
        kquant_tasks(Q4_K, x, x_stride, weight, bias, out, out_stride, m, n, k);
    else
        return 0;
#endif
    return 1;
}

int kquant_dequantize_chunks(int64_t type, const uint8_t *row, int64_t first, int64_t count, float *out) {
    if ((type != Q4_K && type != Q6_K) || first % 8 != 0 || count % 8 != 0) return 0;
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
