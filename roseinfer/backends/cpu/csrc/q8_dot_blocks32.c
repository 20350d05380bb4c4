/* Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 weight rows times Q8_0 activation rows (q8_activations.h), a few
 * rows of x a weight row, each 32-weight block's integers decoded once for the group:
 *   Q8_0: signed times signed, as unsigned |w| times x with w's sign (vpsignb), then vpdpbusd
 *         (AVX-512 VNNI on 256-bit vectors) or vpmaddubsw + vpmaddwd (AVX2);
 *   Q4_0, Q4_1: the nibbles 0..15 unsigned times x, the same instructions; Q4_0's -8 and Q4_1's
 *         minimum come from x's block sum: w = d q + m gives d dx sum(q qx) + m dx sum(qx);
 *   Q5_0, Q5_1: as Q4_0 and Q4_1 with each weight's fifth bit (qh) set into its byte as 16: 0..31
 *         unsigned, Q5_0's offset -16.
 * Elsewhere the same integer sums in plain C. */
#include <stdint.h>
#include <string.h>

#include "q8_activations.h"
#include "quants.h"

#if defined(__AVX2__)
#include <immintrin.h>

/* the block's 32 integer products summed into 8 lanes: unsigned u times signed s */
static inline __m256i dot_u8_s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* byte l = 16 where bit l of the 32-bit word qh is set, else 0 */
static inline __m256i fifth_bits(uint32_t qh) {
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                               _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll,
                                                                  0x0303030303030303ll));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

static inline float hsum256(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

static inline __attribute__((always_inline)) void blocks32_rows(int type, const uint8_t *w, const block_q8_0 *x,
                                                               int64_t blocks, const int rows, float *sums) {
    const int64_t bytes = quant_block_bytes(type);
    __m256 acc[Q8_GROUP];
    float offsets[Q8_GROUP];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps(), offsets[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * bytes;
        float d, m = 0.0f;
        __m256i u, sign = _mm256_setzero_si256();
        if (type == Q8_0) {
            d = fp16_to_f32(blk);
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
            u = _mm256_sign_epi8(q, q);
            sign = q;
        } else {
            const int five = type == Q5_0 || type == Q5_1, pair = type == Q4_1 || type == Q5_1;
            if (pair)
                fp16_pair_to_f32(blk, &d, &m);
            else
                d = fp16_to_f32(blk), m = (five ? -16.0f : -8.0f) * d;
            const uint8_t *nibbles = blk + (pair ? 4 : 2) + (five ? 4 : 0);
            const __m128i q = _mm_loadu_si128((const __m128i *)nibbles);
            const __m128i low4 = _mm_set1_epi8(0x0f);
            u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), low4), _mm_and_si128(q, low4));
            if (five) {
                uint32_t qh;
                memcpy(&qh, nibbles - 4, sizeof qh);
                u = _mm256_or_si256(u, fifth_bits(qh));
            }
        }
        for (int r = 0; r < rows; r++) {
            const block_q8_0 *xb = x + r * blocks + b;
            __m256i s = _mm256_loadu_si256((const __m256i *)xb->qs);
            if (type == Q8_0) s = _mm256_sign_epi8(s, sign);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_s8(u, s)), _mm256_set1_ps(d * xb->d), acc[r]);
            if (type != Q8_0) offsets[r] += m * xb->d * (float)xb->sum;
        }
    }
    for (int r = 0; r < rows; r++) sums[r] = hsum256(acc[r]) + offsets[r];
}

#else

static inline void blocks32_rows(int type, const uint8_t *w, const block_q8_0 *x, int64_t blocks, const int rows,
                                 float *sums) {
    const int64_t bytes = quant_block_bytes(type);
    for (int r = 0; r < rows; r++) sums[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * bytes;
        float d, m = 0.0f;
        int q[32];
        if (type == Q8_0) {
            d = fp16_to_f32(blk);
            for (int l = 0; l < 32; l++) q[l] = (int8_t)blk[2 + l];
        } else {
            const int five = type == Q5_0 || type == Q5_1, pair = type == Q4_1 || type == Q5_1;
            if (pair)
                fp16_pair_to_f32(blk, &d, &m);
            else
                d = fp16_to_f32(blk), m = (five ? -16.0f : -8.0f) * d;
            const uint8_t *nibbles = blk + (pair ? 4 : 2) + (five ? 4 : 0);
            uint32_t qh = 0;
            if (five) memcpy(&qh, nibbles - 4, sizeof qh);
            for (int l = 0; l < 16; l++) q[l] = nibbles[l] & 15, q[l + 16] = nibbles[l] >> 4;
            for (int l = 0; l < 32; l++) q[l] |= (int)(qh >> l & 1) << 4;
        }
        for (int r = 0; r < rows; r++) {
            const block_q8_0 *xb = x + r * blocks + b;
            int32_t isum = 0;
            for (int l = 0; l < 32; l++) isum += q[l] * xb->qs[l];
            sums[r] += d * xb->d * (float)isum + m * xb->d * (float)xb->sum;
        }
    }
}

#endif

void q8_0_dots(int64_t type, const uint8_t *w, const block_q8_0 *x, int64_t blocks, int rows, float *sums) {
    /* constant types and row counts, so the accumulators stay in registers */
#define BLOCKS32_ROWS(t)                                                     \
    switch (rows) {                                                          \
    case 1: blocks32_rows(t, w, x, blocks, 1, sums); break;                  \
    case 2: blocks32_rows(t, w, x, blocks, 2, sums); break;                  \
    case 3: blocks32_rows(t, w, x, blocks, 3, sums); break;                  \
    default: blocks32_rows(t, w, x, blocks, Q8_GROUP, sums); break;          \
    }
    if (type == Q8_0) {
        BLOCKS32_ROWS(Q8_0)
    } else if (type == Q4_0) {
        BLOCKS32_ROWS(Q4_0)
    } else if (type == Q5_0) {
        BLOCKS32_ROWS(Q5_0)
    } else if (type == Q5_1) {
        BLOCKS32_ROWS(Q5_1)
    } else {
        BLOCKS32_ROWS(Q4_1)
    }
#undef BLOCKS32_ROWS
}
