/* Q4_K and Q6_K weight rows times Q8_K activation rows (q8_activations.h), a few rows of x a weight
 * row: each 256-weight block is decoded once into unsigned bytes (Q4_K's nibbles, Q6_K's 6-bit
 * values + 32) and multiplied into every row of the group with integer dot products:
 *   AVX-512 VNNI: vpmaddubsw (unsigned weight bytes times signed x bytes, pairs summed to 16 bits, no
 *     overflow: at most 2 * 63 * 127) then vpdpwssd, which multiplies those pairs by the sub-block's
 *     scale and adds them into 32-bit lanes in one instruction;
 *   AVX2: vpmaddubsw then vpmaddwd by the scale and an add;
 *   elsewhere the same integer sums in plain C.
 * The sub-block minimum (Q4_K) and the -32 offset (Q6_K) come from x's 16-value sums (bsums), one
 * vpmaddwd a block. A block's integer sums become floats once, times d and x's scale. */
#include <stdint.h>

#include "q8_activations.h"
#include "quants.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

static inline __m512i halves16(int low, int high) {
    return _mm512_inserti64x4(_mm512_set1_epi16((short)low), _mm256_set1_epi16((short)high), 1);
}

static inline __attribute__((always_inline)) void q4_k_rows(const uint8_t *w, const block_q8_k *x, int64_t blocks,
                                                           const int rows, float *sums) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m256i min_pairs = _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
    __m512 acc[Q8_GROUP];
    __m256 acc_min[Q8_GROUP];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps(), acc_min[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * 144;
        const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
        uint8_t scales_mins[16];
        q4_k_unpack_scales(blk + 4, scales_mins);
        const __m256i sm16 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)scales_mins));
        const __m256i mins16 = _mm256_permutexvar_epi16(min_pairs, sm16);
        const __m512i sm512 = _mm512_castsi256_si512(sm16);
        __m512i wv[4], sc[4];
        for (int h = 0; h < 2; h++) {
            /* bytes 64h..64h+63: low nibbles are sub-blocks 4h and 4h+2, high ones 4h+1 and 4h+3 */
            const __m512i q = _mm512_loadu_si512((const void *)(blk + 16 + 64 * h));
            const __m512i lo = _mm512_and_si512(q, low4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
            wv[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);     /* values 128h + 0..63 */
            wv[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xee); /* values 128h + 64..127 */
        }
        for (int i = 0; i < 4; i++) sc[i] = _mm512_permutexvar_epi16(halves16(2 * i, 2 * i + 1), sm512);
        for (int r = 0; r < rows; r++) {
            const block_q8_k *xb = x + r * blocks + b;
            __m512i isum = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(wv[i], _mm512_loadu_si512((const void *)(xb->qs + 64 * i))),
                                           sc[i]);
            const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), mins16);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * xb->d), acc[r]);
            acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-dmin * xb->d), acc_min[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], _mm512_zextps256_ps512(acc_min[r])));
}

static inline __attribute__((always_inline)) void q6_k_rows(const uint8_t *w, const block_q8_k *x, int64_t blocks,
                                                           const int rows, float *sums) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    /* the 2 high bits of the first and second 32 bytes' values sit at qh bits 0-1 and 2-3 (shifted up
     * to 4-5), and at bits 4-5 and 6-7 for the high nibbles */
    const __m512i up01 = halves16(4, 2), down23 = halves16(0, 2);
    __m512 acc[Q8_GROUP];
    __m256 acc_offset[Q8_GROUP];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps(), acc_offset[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * 210;
        const float d = fp16_to_f32(blk + 208);
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m512i scales512 = _mm512_castsi256_si512(scales16);
        __m512i wv[4], sc[4];
        for (int h = 0; h < 2; h++) {
            const __m512i ql = _mm512_loadu_si512((const void *)(blk + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
            wv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, up01), top2));
            wv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                            _mm512_and_si512(_mm512_srlv_epi16(qh, down23), top2));
        }
        /* register i holds values 64i..64i+63: its 16-bit lane j pairs values 64i + 2j, + 1, scale 4i + j / 8 */
        for (int i = 0; i < 4; i++) {
            const __m512i index = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * i)), _mm512_setr_epi32(
                0, 0, 0, 0, 0x00010001, 0x00010001, 0x00010001, 0x00010001, 0x00020002, 0x00020002, 0x00020002,
                0x00020002, 0x00030003, 0x00030003, 0x00030003, 0x00030003));
            sc[i] = _mm512_permutexvar_epi16(index, scales512);
        }
        for (int r = 0; r < rows; r++) {
            const block_q8_k *xb = x + r * blocks + b;
            __m512i isum = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)
                isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(wv[i], _mm512_loadu_si512((const void *)(xb->qs + 64 * i))),
                                           sc[i]);
            const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), scales16);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(d * xb->d), acc[r]);
            acc_offset[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset), _mm256_set1_ps(-32.0f * d * xb->d), acc_offset[r]);
        }
    }
    for (int r = 0; r < rows; r++)
        sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], _mm512_zextps256_ps512(acc_offset[r])));
}

#elif defined(__AVX2__)
#include <immintrin.h>

static inline float hsum256(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

static inline __m256i scale_pair(int low, int high) {
    return _mm256_set_m128i(_mm_set1_epi16((short)high), _mm_set1_epi16((short)low));
}

static inline __attribute__((always_inline)) void q4_k_rows(const uint8_t *w, const block_q8_k *x, int64_t blocks,
                                                           const int rows, float *sums) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    __m256 acc[Q8_GROUP];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * 144;
        const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
        uint8_t sm[16];
        q4_k_unpack_scales(blk + 4, sm);
        const __m256i mins16 = _mm256_cvtepu8_epi16(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)(sm + 8)), dup));
        __m256i wv[8];
        for (int p = 0; p < 4; p++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * p));
            wv[2 * p] = _mm256_and_si256(q, low4);
            wv[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        }
        for (int r = 0; r < rows; r++) {
            const block_q8_k *xb = x + r * blocks + b;
            __m256i isum = _mm256_setzero_si256();
            for (int s = 0; s < 8; s++) {
                const __m256i p16 = _mm256_maddubs_epi16(wv[s], _mm256_loadu_si256((const __m256i *)(xb->qs + 32 * s)));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, _mm256_set1_epi16(sm[s])));
            }
            const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), mins16);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * xb->d), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(-dmin * xb->d), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) sums[r] = hsum256(acc[r]);
}

static inline __attribute__((always_inline)) void q6_k_rows(const uint8_t *w, const block_q8_k *x, int64_t blocks,
                                                           const int rows, float *sums) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    __m256 acc[Q8_GROUP];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * 210;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = fp16_to_f32(blk + 208);
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scales));
        __m256i wv[8];
        for (int h = 0; h < 2; h++) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            wv[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2));
            wv[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2));
            wv[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, top2));
            wv[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2));
        }
        for (int r = 0; r < rows; r++) {
            const block_q8_k *xb = x + r * blocks + b;
            __m256i isum = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i p16 = _mm256_maddubs_epi16(wv[c], _mm256_loadu_si256((const __m256i *)(xb->qs + 32 * c)));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, scale_pair(scales[2 * c], scales[2 * c + 1])));
            }
            const __m256i offset = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), scales16);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * xb->d), acc[r]);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offset), _mm256_set1_ps(-32.0f * d * xb->d), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) sums[r] = hsum256(acc[r]);
}

#else

static inline void q4_k_rows(const uint8_t *w, const block_q8_k *x, int64_t blocks, const int rows, float *sums) {
    for (int r = 0; r < rows; r++) sums[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * 144;
        const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
        uint8_t sm[16];
        q4_k_unpack_scales(blk + 4, sm);
        for (int r = 0; r < rows; r++) {
            const block_q8_k *xb = x + r * blocks + b;
            int32_t isum = 0, msum = 0;
            for (int s = 0; s < 8; s++) {
                const uint8_t *q = blk + 16 + 32 * (s / 2);
                int32_t sub = 0;
                for (int l = 0; l < 32; l++) sub += ((q[l] >> (4 * (s & 1))) & 15) * xb->qs[32 * s + l];
                isum += sm[s] * sub;
                msum += sm[8 + s] * (xb->bsums[2 * s] + xb->bsums[2 * s + 1]);
            }
            sums[r] += d * xb->d * (float)isum - dmin * xb->d * (float)msum;
        }
    }
}

static inline void q6_k_rows(const uint8_t *w, const block_q8_k *x, int64_t blocks, const int rows, float *sums) {
    for (int r = 0; r < rows; r++) sums[r] = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *blk = w + b * 210;
        const int8_t *scales = (const int8_t *)(blk + 192);
        const float d = fp16_to_f32(blk + 208);
        for (int r = 0; r < rows; r++) {
            const block_q8_k *xb = x + r * blocks + b;
            int32_t isum = 0;
            for (int s = 0; s < 8; s++) {
                const int h = s / 4, t = s % 4;
                const uint8_t *ql = blk + 64 * h + 32 * (t & 1), *qh = blk + 128 + 32 * h;
                for (int half = 0; half < 2; half++) {
                    int32_t sub = 0;
                    for (int l = 16 * half; l < 16 * half + 16; l++) {
                        const int q = ((ql[l] >> (4 * (t >> 1))) & 15) | ((qh[l] >> (2 * t)) & 3) << 4;
                        sub += (q - 32) * xb->qs[32 * s + l];
                    }
                    isum += scales[2 * s + half] * sub;
                }
            }
            sums[r] += d * xb->d * (float)isum;
        }
    }
}

#endif

void q8_k_dots(int64_t type, const uint8_t *w, const block_q8_k *x, int64_t blocks, int rows, float *sums) {
    /* constant row counts, so the accumulators stay in registers */
#define Q8_K_ROWS(kernel)                                                   \
    switch (rows) {                                                         \
    case 1: kernel(w, x, blocks, 1, sums); break;                           \
    case 2: kernel(w, x, blocks, 2, sums); break;                           \
    case 3: kernel(w, x, blocks, 3, sums); break;                           \
    default: kernel(w, x, blocks, Q8_GROUP, sums); break;                   \
    }
    if (type == Q4_K) {
        Q8_K_ROWS(q4_k_rows)
    } else {
        Q8_K_ROWS(q6_k_rows)
    }
#undef Q8_K_ROWS
}
