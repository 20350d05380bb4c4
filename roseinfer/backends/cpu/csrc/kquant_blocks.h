/* The Q4_K and Q6_K block decoders (on AVX2 Q5_K's too) that csrc/kquant.c (a few rows of x, and the
 * tiles' dequantization) and csrc/kquant_row.c (one row of x on AVX2) share, on AVX-512 (with BW) and
 * AVX2; KQ_AVX512 is defined (1 or 0) where they exist. */
#ifndef ROSEINFER_KQUANT_BLOCKS_H
#define ROSEINFER_KQUANT_BLOCKS_H

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

#if !KQ_AVX512
/* A Q5_K block is a Q4_K one with qh[32] before its nibbles: weight l of sub-block s adds bit s of qh[l]
 * as its fifth bit. That bit of qh's bytes widened to 32-bit lanes, as 16 or 0. */
static inline __attribute__((always_inline)) __m256i fifth_bit(__m256i qh, const int s) {
    return _mm256_and_si256(s <= 4 ? _mm256_slli_epi32(qh, 4 - s) : _mm256_srli_epi32(qh, s - 4), _mm256_set1_epi32(16));
}

/* q4_k_pair's AVX2 form, or with five_bits Q5_K's (each nibble's fifth bit or-ed in before the
 * conversion; AVX-512 dequantizes Q5_K with the generic kernel) */
static inline __attribute__((always_inline)) void nibbles_pair(const uint8_t *b, const float sm[16], const int p,
                                                              vec_t w[PAIR_VECS], const int five_bits) {
    const uint8_t *q = b + (five_bits ? 48 : 16) + 32 * p;
    const __m256 low_scale = _mm256_set1_ps(sm[2 * p]), low_min = _mm256_set1_ps(sm[8 + 2 * p]);
    const __m256 high_scale = _mm256_set1_ps(sm[2 * p + 1]), high_min = _mm256_set1_ps(sm[9 + 2 * p]);
    for (int i = 0; i < 4; i++) {
        const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
        __m256i low_q = _mm256_and_si256(bytes, _mm256_set1_epi32(15)), high_q = _mm256_srli_epi32(bytes, 4);
        if (five_bits) {
            const __m256i qh = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + 8 * i)));
            low_q = _mm256_or_si256(low_q, fifth_bit(qh, 2 * p));
            high_q = _mm256_or_si256(high_q, fifth_bit(qh, 2 * p + 1));
        }
        w[i] = (vec_t)_mm256_fmsub_ps(_mm256_cvtepi32_ps(low_q), low_scale, low_min);
        w[4 + i] = (vec_t)_mm256_fmsub_ps(_mm256_cvtepi32_ps(high_q), high_scale, high_min);
    }
}

static inline __attribute__((always_inline)) void q5_k_pair(const uint8_t *b, const float sm[16], const int p,
                                                           vec_t w[PAIR_VECS]) {
    nibbles_pair(b, sm, p, w, 1);
}
#endif

#if KQ_AVX512
/* a Q4_K sub-block's 16 values, scale * q - min for q = 0 .. 15, as a table for q4_k_lookup */
static inline __attribute__((always_inline)) __m512 q4_k_table(float scale, float min) {
    const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmsub_ps(_mm512_set1_ps(scale), nibble_values, _mm512_set1_ps(min));
}

/* the 16 weights of 16 nibble bytes (their high nibbles where `high`), looked up in the table */
static inline __attribute__((always_inline)) vec_t q4_k_lookup(const uint8_t *bytes, const int high, __m512 table) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    if (high) q = _mm512_srli_epi32(q, 4);
    return (vec_t)_mm512_permutexvar_ps(q, table);
}
#endif

/* w = weights 64 p .. 64 p + 63 of the Q4_K block at b (sub-block 2 p from the low nibbles of its
 * 32 bytes, 2 p + 1 from the high ones), in order */
static inline __attribute__((always_inline)) void q4_k_pair(const uint8_t *b, const float sm[16], int p,
                                                           vec_t w[PAIR_VECS]) {
#if KQ_AVX512
    const uint8_t *q = b + 16 + 32 * p;
    const __m512 low_table = q4_k_table(sm[2 * p], sm[8 + 2 * p]), high_table = q4_k_table(sm[2 * p + 1], sm[9 + 2 * p]);
    for (int h = 0; h < 2; h++) {
        w[h] = q4_k_lookup(q + 16 * h, 0, low_table);
        w[2 + h] = q4_k_lookup(q + 16 * h, 1, high_table);
    }
#else
    nibbles_pair(b, sm, p, w, 0);
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

/* The 6-bit integers minus 32 of half a Q6_K block, in weight order, stored: they are assembled 64
 * (AVX2: 32) bytes at a time and widened a vector at a time from memory (a load and one shuffle, where
 * widening from a register takes up to three shuffles on AVX2) */
typedef struct { int8_t q[128] __attribute__((aligned(64))); } q6_k_half_t;

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
        _mm256_store_si256((__m256i *)(ints->q + 32 * t),
                           _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lows[t], low4),
                                                           _mm256_and_si256(tops[t], top2)), bias));
    /* a compiler barrier, so that they are widened from memory, not from the registers they came from */
    __asm__ volatile("" ::: "memory");
#endif
}

/* integers VEC_FLOATS v .. VEC_FLOATS v + VEC_FLOATS - 1 of a half, as floats */
static inline __attribute__((always_inline)) vec_t q6_k_ints(const q6_k_half_t *ints, int v) {
#if KQ_AVX512
    return (vec_t)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)(ints->q + 16 * v))));
#else
    return (vec_t)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(ints->q + 8 * v))));
#endif
}

/* weights 128 half + VEC_FLOATS v .. + VEC_FLOATS - 1 of a Q6_K block, from its half's integers and
 * its scales ds (one a 16 weights) */
static inline __attribute__((always_inline)) vec_t q6_k_vector(const q6_k_half_t *ints, const float ds[16], int half,
                                                              int v) {
    return ds[8 * half + VEC_FLOATS * v / 16] * q6_k_ints(ints, v);
}

/* Consecutive halves of Q6_K blocks, each half's integers stored two halves before they are read:
 * widened right after their store, the loads waited on it (docs/profiling.md section 15) */
typedef struct {
    q6_k_half_t ints[4];
    const uint8_t *blocks;
    int64_t halves;
} q6_k_halves_t;

static inline __attribute__((always_inline)) void q6_k_halves_start(q6_k_halves_t *run, const uint8_t *blocks,
                                                                   int64_t halves) {
    run->blocks = blocks, run->halves = halves;
    for (int64_t h = 0; h < 2 && h < halves; h++) q6_k_half_ints(blocks + h / 2 * 210, (int)(h % 2), &run->ints[h]);
}

/* half h's integers (h counts up from 0), half h + 2's stored on the way */
static inline __attribute__((always_inline)) const q6_k_half_t *q6_k_halves_next(q6_k_halves_t *run, int64_t h) {
    const int64_t ahead = h + 2;
    if (ahead < run->halves) q6_k_half_ints(run->blocks + ahead / 2 * 210, (int)(ahead % 2), &run->ints[ahead % 4]);
    return &run->ints[h % 4];
}

#if !KQ_AVX512
/* out[j] = x (one row) times Q4_K, Q5_K or Q6_K weight row j, bias added (csrc/kquant_row.c) */
void kquant_row_tasks(int64_t type, const float *x, const uint8_t *weight, const float *bias, float *out,
                      int64_t n, int64_t k);
#endif

#endif

#endif
