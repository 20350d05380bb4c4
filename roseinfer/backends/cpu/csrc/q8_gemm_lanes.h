/* csrc/q8_gemm.c's lane operations on a tile's 16 rows, one 32-bit lane a row, per target: AVX-512
 * VNNI (one register, vpdpbusd), AVX2 (two registers, vpmaddubsw + vpmaddwd) or plain C. Each gives
 * the same integers and the same fp32 operations (a fused multiply-add a lane), so every build's
 * outputs are the same bits. GEMM_COLS: the rows of x a tile's weights are multiplied into at once. */
#ifndef ROSEINFER_Q8_GEMM_LANES_H
#define ROSEINFER_Q8_GEMM_LANES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "q8_activations.h"
#include "quants.h"

#define GEMM_ROWS 16

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GEMM_COLS 4 /* rows of x a tile's weights are multiplied into at once: 12 accumulators in registers */

typedef __m512i lanes_i;
typedef __m512 lanes_f;

static inline lanes_i zeros_i(void) { return _mm512_setzero_si512(); }
static inline lanes_i broadcast_i(int32_t v) { return _mm512_set1_epi32(v); }
static inline lanes_i load_bytes(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline lanes_i low_nibbles(lanes_i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline lanes_i high_nibbles(lanes_i v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)); }
static inline lanes_i shift_left(lanes_i v, int bits) { return _mm512_slli_epi16(v, bits); }
static inline lanes_i shift_right(lanes_i v, int bits) { return _mm512_srli_epi16(v, bits); }
/* each byte's bits 0-3 from low, 4-5 from high: a Q6_K value 0..63 */
static inline lanes_i six_bits(lanes_i low, lanes_i high) {
    return _mm512_or_si512(_mm512_and_si512(low, _mm512_set1_epi8(0x0f)), _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
}
/* acc + the sum of 4 products of unsigned bytes w and x's 4 signed bytes, in each lane */
static inline lanes_i dot4(lanes_i acc, lanes_i w, const int8_t *x) {
    int32_t x4;
    memcpy(&x4, x, sizeof x4);
    return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
}
/* dot4 for unsigned bytes up to 255 (Q8_0's u = q + 128): vpdpbusd's sums never saturate; the
 * products carry 128 x above q x, which the chain takes back (WIDE_OFFSET) */
#define WIDE_OFFSET 128
static inline lanes_i dot4_wide(lanes_i acc, lanes_i w, const int8_t *x) { return dot4(acc, w, x); }
/* each byte's bit 4 (a Q5 weight's fifth bit, moved there), the rest cleared */
static inline lanes_i bit4(lanes_i v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x10)); }
static inline lanes_i or_i(lanes_i a, lanes_i b) { return _mm512_or_si512(a, b); }
static inline lanes_i widen_u8(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline lanes_i widen_i8(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline lanes_i add_i(lanes_i a, lanes_i b) { return _mm512_add_epi32(a, b); }
static inline lanes_i add_product(lanes_i acc, lanes_i a, lanes_i b) { return _mm512_add_epi32(acc, _mm512_mullo_epi32(a, b)); }
/* 16 pairs of unsigned bytes as pairs of 16-bit integers, one pair a lane */
static inline lanes_i widen_pairs(const uint8_t *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
/* acc + each lane's pair times the pair of 16-bit integers `pair` */
static inline lanes_i dot2(lanes_i acc, lanes_i pairs, int32_t pair) {
    return _mm512_dpwssd_epi32(acc, pairs, _mm512_set1_epi32(pair));
}
static inline lanes_f halves(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline lanes_f times(lanes_f v, float s) { return _mm512_mul_ps(v, _mm512_set1_ps(s)); }
static inline lanes_f zeros_f(void) { return _mm512_setzero_ps(); }
static inline lanes_f fma_lanes(lanes_i i, lanes_f scale, lanes_f acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), scale, acc);
}
static inline void store_f(float *out, lanes_f v) { _mm512_storeu_ps(out, v); }

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GEMM_COLS 2 /* 16 lanes are two registers here: more rows of x spill */
/* Q4_K and Q6_K tiles: one chain of 16-bit sums a row of x (2 registers) leaves room for 4 rows, and
 * the nibbles cut from a weight load then feed 4 */
#define K_GEMM_COLS 4
#define ONE_DOT_CHAIN 1

typedef struct { __m256i lo, hi; } lanes_i; /* rows 0-7, 8-15 */
typedef struct { __m256 lo, hi; } lanes_f;

static inline lanes_i zeros_i(void) { return (lanes_i){_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline lanes_i broadcast_i(int32_t v) { return (lanes_i){_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
static inline lanes_i load_bytes(const uint8_t *p) {
    return (lanes_i){_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))};
}
static inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline lanes_i low_nibbles(lanes_i v) { return (lanes_i){low4(v.lo), low4(v.hi)}; }
static inline lanes_i high_nibbles(lanes_i v) {
    return (lanes_i){low4(_mm256_srli_epi16(v.lo, 4)), low4(_mm256_srli_epi16(v.hi, 4))};
}
static inline lanes_i shift_left(lanes_i v, int bits) {
    return (lanes_i){_mm256_slli_epi16(v.lo, bits), _mm256_slli_epi16(v.hi, bits)};
}
static inline lanes_i shift_right(lanes_i v, int bits) {
    return (lanes_i){_mm256_srli_epi16(v.lo, bits), _mm256_srli_epi16(v.hi, bits)};
}
static inline __m256i six_bits_half(__m256i low, __m256i high) {
    return _mm256_or_si256(low4(low), _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
}
static inline lanes_i six_bits(lanes_i low, lanes_i high) {
    return (lanes_i){six_bits_half(low.lo, high.lo), six_bits_half(low.hi, high.hi)};
}
/* the byte products summed in pairs to 16 bits (at most 2 * 63 * 128: no saturation), then in fours */
static inline __m256i dot4_half(__m256i acc, __m256i w, __m256i x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
static inline lanes_i dot4(lanes_i acc, lanes_i w, const int8_t *x) {
    int32_t x4;
    memcpy(&x4, x, sizeof x4);
    const __m256i xv = _mm256_set1_epi32(x4);
    return (lanes_i){dot4_half(acc.lo, w.lo, xv), dot4_half(acc.hi, w.hi, xv)};
}
/* dot4 for Q8_0's unsigned bytes u = q + 128, where vpmaddubsw's pairs would saturate: q itself
 * (its magnitude unsigned, its sign moved onto x) times x, so no offset to take back (WIDE_OFFSET) */
#define WIDE_OFFSET 0
static inline __m256i dot4_wide_half(__m256i acc, __m256i w, __m256i x) {
    const __m256i s = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return dot4_half(acc, _mm256_abs_epi8(s), _mm256_sign_epi8(x, s));
}
static inline lanes_i dot4_wide(lanes_i acc, lanes_i w, const int8_t *x) {
    int32_t x4;
    memcpy(&x4, x, sizeof x4);
    const __m256i xv = _mm256_set1_epi32(x4);
    return (lanes_i){dot4_wide_half(acc.lo, w.lo, xv), dot4_wide_half(acc.hi, w.hi, xv)};
}
static inline lanes_i bit4(lanes_i v) {
    const __m256i bit = _mm256_set1_epi8(0x10);
    return (lanes_i){_mm256_and_si256(v.lo, bit), _mm256_and_si256(v.hi, bit)};
}
static inline lanes_i or_i(lanes_i a, lanes_i b) { return (lanes_i){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
static inline lanes_i widen_u8(const uint8_t *p) {
    return (lanes_i){_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                     _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline lanes_i widen_i8(const uint8_t *p) {
    return (lanes_i){_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                     _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))};
}
static inline lanes_i add_i(lanes_i a, lanes_i b) {
    return (lanes_i){_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)};
}
static inline lanes_i add_product(lanes_i acc, lanes_i a, lanes_i b) {
    return (lanes_i){_mm256_add_epi32(acc.lo, _mm256_mullo_epi32(a.lo, b.lo)),
                     _mm256_add_epi32(acc.hi, _mm256_mullo_epi32(a.hi, b.hi))};
}
static inline lanes_i widen_pairs(const uint8_t *p) {
    return (lanes_i){_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)),
                     _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline lanes_i dot2(lanes_i acc, lanes_i pairs, int32_t pair) {
    const __m256i pv = _mm256_set1_epi32(pair);
    return (lanes_i){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(pairs.lo, pv)),
                     _mm256_add_epi32(acc.hi, _mm256_madd_epi16(pairs.hi, pv))};
}
static inline lanes_f halves(const uint8_t *p) {
    return (lanes_f){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                     _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
static inline lanes_f times(lanes_f v, float s) {
    const __m256 sv = _mm256_set1_ps(s);
    return (lanes_f){_mm256_mul_ps(v.lo, sv), _mm256_mul_ps(v.hi, sv)};
}
static inline lanes_f zeros_f(void) { return (lanes_f){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline lanes_f fma_lanes(lanes_i i, lanes_f scale, lanes_f acc) {
    return (lanes_f){_mm256_fmadd_ps(_mm256_cvtepi32_ps(i.lo), scale.lo, acc.lo),
                     _mm256_fmadd_ps(_mm256_cvtepi32_ps(i.hi), scale.hi, acc.hi)};
}
static inline void store_f(float *out, lanes_f v) {
    _mm256_storeu_ps(out, v.lo);
    _mm256_storeu_ps(out + 8, v.hi);
}
/* a few dot4 sums before a sub-block's scale multiplies them (lanes_s): vpmaddubsw's two 16-bit sums
 * a lane, added with vpaddw, and vpmaddwd only once a sub-block, by the scale (in place of a vpmaddwd
 * by 1 a dot4 and a vpmulld a sub-block). A pair is at most 2 * 63 * 127 = 16002 for 6-bit weights
 * and 3810 for 4-bit ones, so 16 bits hold 2 dot4s of 6-bit weights, 8 of 4-bit ones (a Q4_K sub-block). */
typedef lanes_i lanes_s;
#define SIX_BIT_DOTS 2
#define FIVE_BIT_DOTS 4 /* 2 * 31 * 127 a pair: 4 dot4s of Q5_K's 5-bit weights */
/* a Q6_K sub-block's -32 * (x's 16-value sum) as a lanes_s add_scaled takes: -16 * sum in both halves
 * (|16 * sum| <= 16 * 16 * 127 fits 16 bits; -32 * sum may not) */
static inline int32_t six_bit_offset(int bsum) {
    const uint16_t half = (uint16_t)(int16_t)(-16 * bsum);
    return (int32_t)((uint32_t)half | (uint32_t)half << 16);
}
static inline lanes_s zeros_s(void) { return zeros_i(); }
static inline lanes_s dot4_s(lanes_s acc, lanes_i w, const int8_t *x) {
    int32_t x4;
    memcpy(&x4, x, sizeof x4);
    const __m256i xv = _mm256_set1_epi32(x4);
    lanes_s out = {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, xv)),
                   _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, xv))};
    /* keeps the chain a chain: GCC otherwise reassociates a tile's 64 products into a tree whose
     * leaves all go through the stack */
    __asm__("" : "+x"(out.lo), "+x"(out.hi));
    return out;
}
static inline lanes_s add_s(lanes_s a, lanes_s b) {
    return (lanes_s){_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)};
}
/* each lane's scale in both its 16-bit halves, for vpmaddwd */
static inline __m256i twice16(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}
static inline lanes_i scales_u8(const uint8_t *p) {
    const lanes_i v = widen_u8(p);
    return (lanes_i){twice16(v.lo), twice16(v.hi)};
}
static inline lanes_i scales_i8(const uint8_t *p) {
    const lanes_i v = widen_i8(p);
    return (lanes_i){twice16(v.lo), twice16(v.hi)};
}
static inline lanes_i add_scaled(lanes_i acc, lanes_s sums, lanes_i scales) {
    return (lanes_i){_mm256_add_epi32(acc.lo, _mm256_madd_epi16(sums.lo, scales.lo)),
                     _mm256_add_epi32(acc.hi, _mm256_madd_epi16(sums.hi, scales.hi))};
}

#else
#define GEMM_COLS 4

typedef struct { int32_t v[GEMM_ROWS]; } lanes_i;
typedef struct { float v[GEMM_ROWS]; } lanes_f;

static inline lanes_i zeros_i(void) { return (lanes_i){{0}}; }
static inline lanes_i broadcast_i(int32_t v) {
    lanes_i out;
    for (int r = 0; r < GEMM_ROWS; r++) out.v[r] = v;
    return out;
}
static inline lanes_i load_bytes(const uint8_t *p) {
    lanes_i out;
    memcpy(out.v, p, sizeof out.v);
    return out;
}
static inline lanes_i low_nibbles(lanes_i v) {
    for (int r = 0; r < GEMM_ROWS; r++) v.v[r] &= 0x0f0f0f0f;
    return v;
}
static inline lanes_i high_nibbles(lanes_i v) {
    for (int r = 0; r < GEMM_ROWS; r++) v.v[r] = (int32_t)(((uint32_t)v.v[r] >> 4) & 0x0f0f0f0fu);
    return v;
}
static inline lanes_i shift_left(lanes_i v, int bits) {
    for (int r = 0; r < GEMM_ROWS; r++) v.v[r] = (int32_t)((uint32_t)v.v[r] << bits);
    return v;
}
static inline lanes_i shift_right(lanes_i v, int bits) {
    for (int r = 0; r < GEMM_ROWS; r++) v.v[r] = (int32_t)((uint32_t)v.v[r] >> bits);
    return v;
}
static inline lanes_i six_bits(lanes_i low, lanes_i high) {
    for (int r = 0; r < GEMM_ROWS; r++) low.v[r] = (int32_t)(((uint32_t)low.v[r] & 0x0f0f0f0fu) | ((uint32_t)high.v[r] & 0x30303030u));
    return low;
}
static inline lanes_i dot4(lanes_i acc, lanes_i w, const int8_t *x) {
    for (int r = 0; r < GEMM_ROWS; r++) {
        const uint32_t u = (uint32_t)w.v[r];
        for (int i = 0; i < 4; i++) acc.v[r] += (int32_t)((u >> (8 * i)) & 0xff) * x[i];
    }
    return acc;
}
#define WIDE_OFFSET 128 /* as AVX-512's */
static inline lanes_i dot4_wide(lanes_i acc, lanes_i w, const int8_t *x) { return dot4(acc, w, x); }
static inline lanes_i bit4(lanes_i v) {
    for (int r = 0; r < GEMM_ROWS; r++) v.v[r] &= 0x10101010;
    return v;
}
static inline lanes_i or_i(lanes_i a, lanes_i b) {
    for (int r = 0; r < GEMM_ROWS; r++) a.v[r] |= b.v[r];
    return a;
}
static inline lanes_i widen_u8(const uint8_t *p) {
    lanes_i out;
    for (int r = 0; r < GEMM_ROWS; r++) out.v[r] = p[r];
    return out;
}
static inline lanes_i widen_i8(const uint8_t *p) {
    lanes_i out;
    for (int r = 0; r < GEMM_ROWS; r++) out.v[r] = (int8_t)p[r];
    return out;
}
static inline lanes_i add_i(lanes_i a, lanes_i b) {
    for (int r = 0; r < GEMM_ROWS; r++) a.v[r] += b.v[r];
    return a;
}
static inline lanes_i add_product(lanes_i acc, lanes_i a, lanes_i b) {
    for (int r = 0; r < GEMM_ROWS; r++) acc.v[r] += a.v[r] * b.v[r];
    return acc;
}
/* each lane's pair of 16-bit integers, low half first */
static inline lanes_i widen_pairs(const uint8_t *p) {
    lanes_i out;
    for (int r = 0; r < GEMM_ROWS; r++) out.v[r] = (int32_t)((uint32_t)p[2 * r] | (uint32_t)p[2 * r + 1] << 16);
    return out;
}
static inline lanes_i dot2(lanes_i acc, lanes_i pairs, int32_t pair) {
    for (int r = 0; r < GEMM_ROWS; r++)
        acc.v[r] += (int16_t)(pairs.v[r] & 0xffff) * (int16_t)(pair & 0xffff)
                    + (int16_t)((uint32_t)pairs.v[r] >> 16) * (int16_t)((uint32_t)pair >> 16);
    return acc;
}
static inline lanes_f halves(const uint8_t *p) {
    lanes_f out;
    for (int r = 0; r < GEMM_ROWS; r++) out.v[r] = fp16_to_f32(p + 2 * r);
    return out;
}
static inline lanes_f times(lanes_f v, float s) {
    for (int r = 0; r < GEMM_ROWS; r++) v.v[r] *= s;
    return v;
}
static inline lanes_f zeros_f(void) { return (lanes_f){{0}}; }
static inline lanes_f fma_lanes(lanes_i i, lanes_f scale, lanes_f acc) {
    for (int r = 0; r < GEMM_ROWS; r++) acc.v[r] = fmaf((float)i.v[r], scale.v[r], acc.v[r]);
    return acc;
}
static inline void store_f(float *out, lanes_f v) { memcpy(out, v.v, sizeof v.v); }
#endif

#ifndef SIX_BIT_DOTS /* AVX-512 and plain C: the sub-block sums (lanes_s) in 32-bit lanes, as lanes_i */
#define K_GEMM_COLS GEMM_COLS /* rows of x a Q4_K or Q6_K tile's weights are multiplied into at once */
#define ONE_DOT_CHAIN 0 /* each row of x keeps two chains of sums a sub-block, so more are in flight */
typedef lanes_i lanes_s;
#define SIX_BIT_DOTS 4 /* dot4s of 6-bit weights a lanes_s holds: a whole Q6_K sub-block */
#define FIVE_BIT_DOTS 8 /* and of 5-bit ones: a whole Q5_K sub-block */
/* a Q6_K sub-block's -32 * (x's 16-value sum), as a lanes_s it starts from */
static inline int32_t six_bit_offset(int bsum) { return -32 * bsum; }
static inline lanes_s zeros_s(void) { return zeros_i(); }
static inline lanes_s dot4_s(lanes_s acc, lanes_i w, const int8_t *x) { return dot4(acc, w, x); }
static inline lanes_s add_s(lanes_s a, lanes_s b) { return add_i(a, b); }
/* a sub-block's 16 scales (unsigned, signed) in the form add_scaled multiplies by */
static inline lanes_i scales_u8(const uint8_t *p) { return widen_u8(p); }
static inline lanes_i scales_i8(const uint8_t *p) { return widen_i8(p); }
static inline lanes_i add_scaled(lanes_i acc, lanes_s sums, lanes_i scales) { return add_product(acc, sums, scales); }
#endif

/* csrc/q8_gemm_blocks32.c's part of the GEMM (32-weight blocks: Q8_0, Q5_0, Q5_1), which
 * csrc/q8_gemm.c's entry points hand those types to: a tile-block record's bytes, one record from
 * the blocks of rows[0..count) (out zeroed), and a tile's 16 outputs for rows of x c < cols (acc[c]) */
int64_t blocks32_record_bytes(int64_t type);
void repack_blocks32(int64_t type, const uint8_t *const *rows, int count, uint8_t *out);
void blocks32_tile_times_rows(int64_t type, const uint8_t *tile, const block_q8_0 *x, int64_t blocks, int cols,
                              lanes_f *acc);

#endif
