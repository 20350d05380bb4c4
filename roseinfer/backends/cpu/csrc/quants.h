/* GGUF block formats, dequantized 32 weights at a time into four 8-float vectors: the one copy of
 * each type's math, which the quantized matmul keeps in registers and the row lookup stores.
 *
 * Layouts as llama.cpp's ggml-quants.c and gguf-py's gguf/quants.py define them (fp16 little-endian):
 *   Q8_0  34 B / 32:  d, int8 q[32]                        w = d * q
 *   Q4_0  18 B / 32:  d, q[16] (low nibbles: 0-15, high: 16-31)   w = d * (q - 8)
 *   Q4_1  20 B / 32:  d, m, q[16] as Q4_0                  w = d * q + m
 *   Q5_0  22 B / 32:  d, qh[4], q[16] as Q4_0; bit l of qh (a little-endian 32-bit word) is weight l's
 *         fifth bit                                         w = d * (q + 16 h - 16)
 *   Q5_1  24 B / 32:  d, m, qh[4], q[16] as Q5_0           w = d * (q + 16 h) + m
 *   Q4_K  144 B / 256: d, dmin, 12 B of 6-bit scales/mins, q[128]; chunk s of 32 reads bytes
 *         32 (s / 2) .. + 31, low nibbles for even s, high for odd   w = (d * sc[s]) * q - dmin * mn[s]
 *   Q5_K  176 B / 256: d, dmin, 12 B of scales/mins as Q4_K, qh[32], q[128] as Q4_K's; weight l of chunk
 *         s takes bit s of qh[l] as its fifth bit      w = (d * sc[s]) * (q + 16 h) - dmin * mn[s]
 *   Q6_K  210 B / 256: ql[128], qh[64], int8 scales[16], d; chunk s of half h = s / 4, t = s % 4:
 *         ql[64 h + 32 (t & 1) + l] nibble t / 2, qh[32 h + l] bits 2t, 2t+1 on top; 16 values a scale
 *         w = (d * scale) * (q - 32)
 *   MXFP4  17 B / 32:  e, q[16] as Q4_0's nibbles, each an E2M1 code: gguf-py's kvalues (the E2M1 values
 *         doubled, integers from -12 to 12) times d = 2^(e - 128), half the E8M0 scale   w = d * kv[q]
 * Every product here is exact in fp32 (an 11-bit fp16 significand times integers of at most 7 and 6
 * bits), so the only rounding is the final add, and a fused multiply-add gives the same bits: the
 * weights equal gguf.quants.dequantize's exactly. An MXFP4 weight is an integer times a power of two,
 * so d * (q . x) rounds as (d q) . x does wherever d's products stay normal floats. */
#ifndef ROSEINFER_QUANTS_H
#define ROSEINFER_QUANTS_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

/* GGML type ids (gguf.GGMLQuantizationType) */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

/* A weight type with this bit set: the same blocks, multiplied by rows of x quantized to 8 bits
 * (--cpu-activations int8: csrc/q8_activations.c) instead of by fp32 rows */
#define INT8_ACTIVATIONS 0x100
/* With INT8_ACTIVATIONS on Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 or Q5_1: the blocks repacked into csrc/q8_gemm.c's tiles of 16 rows */
#define INT8_REPACKED 0x200
#define TYPE_FLAGS ((int64_t)(INT8_ACTIVATIONS | INT8_REPACKED))

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Bytes per block and weights per block of a type; 0 for a type not handled here. */
static inline int64_t quant_block_bytes(int64_t type) {
    switch (type & ~TYPE_FLAGS) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case MXFP4: return 17;
    default: return 0;
    }
}

static inline int64_t quant_block_weights(int64_t type) {
    type &= ~TYPE_FLAGS;
    return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32;
}

/* Whether `type` is handled and k is a whole number of its blocks. */
static inline int quant_shape_ok(int64_t type, int64_t k) {
    const int64_t base = type & ~TYPE_FLAGS;
    const int repacked = base == Q4_K || base == Q5_K || base == Q6_K || base == Q8_0 || base == Q5_0 || base == Q5_1;
    if ((type & INT8_REPACKED) && (!(type & INT8_ACTIVATIONS) || !repacked)) return 0;
    return quant_block_bytes(type) != 0 && k > 0 && k % quant_block_weights(type) == 0;
}

/* Bytes of one row of k weights (quant_shape_ok(type, k) holds). */
static inline int64_t quant_row_bytes(int64_t type, int64_t k) {
    return k / quant_block_weights(type) * quant_block_bytes(type);
}

/* quant_matmul_f32's tasks, shared over the threads of an enclosing parallel region (the callers
 * check quant_shape_ok first); csrc/packed_matmul.c runs them after its row prologues. out: [m, n]
 * in rows out_stride floats apart (a weight in parts writes each part's columns of wider rows) */
void quant_matmul_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                        float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k);

/* The same tasks through fp32 tiles of W dequantized once (csrc/quant_tiled_matmul.c), for many rows of x;
 * returns 0 (nothing done) where its buffers could not be allocated */
int quant_tiled_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                      float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k);

/* The same tasks for the types (and row counts) csrc/kquant.c has a kernel for on this target; returns
 * 0 (nothing done) for the others, which quant_matmul_tasks then runs itself */
int kquant_matmul_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                        float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k);

/* out[0..32 count) = 32-weight chunks first .. first + count - 1 of a Q4_K or Q6_K row, dequantized by
 * csrc/kquant.c where this target has it and the chunks are whole blocks; returns 0 (nothing
 * done) otherwise */
int kquant_dequantize_chunks(int64_t type, const uint8_t *row, int64_t first, int64_t count, float *out);

/* Q4_K (up to 4 vectors of rows of x) and Q6_K (up to 2) on AVX-512 (csrc/kquant_pipelined_tiles.c),
 * called by every thread of a parallel region with x^T ([vectors][k][VEC_FLOATS]) and a buffer of
 * KQUANT_PIPELINED_FLOATS floats of its own; returns 0 (nothing done) for other types, other row
 * counts and other targets, else 1 once every thread's outputs are written */
#define KQUANT_PIPELINED_ROWS 24
#define KQUANT_PIPELINED_COLUMNS 128
/* two panels, rows a cache line longer than their columns, and the running sums of one vector */
#define KQUANT_PIPELINED_FLOATS (KQUANT_PIPELINED_ROWS * (2 * (KQUANT_PIPELINED_COLUMNS + 16) + 16))
int kquant_pipelined_tiles(const float *xt, const uint8_t *weight, int64_t type, const float *bias, float *out,
                           int64_t out_stride, int64_t m, int64_t n, int64_t k, float *buffers);

static inline float fp16_to_f32(const uint8_t *p) {
#if defined(__F16C__)
    return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
#else
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    union { uint32_t u; float f; } v;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        v.f = (float)mantissa * 5.9604644775390625e-08f;
        v.u |= sign;
    } else if (exponent == 31) {
        v.u = sign | 0x7f800000u | mantissa << 13;
    } else {
        v.u = sign | (exponent + 112) << 23 | mantissa << 13;
    }
    return v.f;
#endif
}

/* The two fp16 values at p (Q4_1's d and m) as floats, converted together where F16C has it. */
static inline void fp16_pair_to_f32(const uint8_t *p, float *first, float *second) {
#if defined(__F16C__)
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m128 pair = _mm_cvtph_ps(_mm_cvtsi32_si128((int)bits));
    *first = _mm_cvtss_f32(pair);
    *second = _mm_cvtss_f32(_mm_movehdup_ps(pair));
#else
    *first = fp16_to_f32(p);
    *second = fp16_to_f32(p + 2);
#endif
}

/* 8 bytes as floats (unsigned, or signed for bytes8). The bit fields are cut out of a 64-bit word
 * first, and on AVX2 the widening is written out: GCC 12 shifted byte vectors and widened them one
 * lane at a time (a third of the instructions of a Q4_1 chunk). */
static inline vec8 u8_lanes(uint64_t v) {
#if defined(__AVX2__)
    return (vec8)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v)));
#else
    vec8 out;
    for (int i = 0; i < 8; i++) out[i] = (float)(uint8_t)(v >> (8 * i));
    return out;
#endif
}

static inline vec8 bytes8(const uint8_t *q) {
#if defined(__AVX2__)
    return (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#else
    vec8 out;
    for (int i = 0; i < 8; i++) out[i] = (float)(int8_t)q[i];
    return out;
#endif
}

static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define NIBBLES 0x0f0f0f0f0f0f0f0full

/* 8 nibbles of q[0..7], the low or the high ones, as floats. On AVX2 the bytes are widened straight
 * from memory and the nibble cut out of each 32-bit lane (an and or a shift): half the instructions
 * of cutting them out of a 64-bit word first, and a chunk's dequantization is what bounds the matmul. */
static inline vec8 nibbles8(const uint8_t *q, int high) {
#if defined(__AVX2__)
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    return (vec8)_mm256_cvtepi32_ps(high ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(15)));
#else
    return u8_lanes(load64(q) >> (4 * high) & NIBBLES);
#endif
}

/* 8 weights of a Q5_0/Q5_1 block as floats: the low or high nibbles of q[0..7] with the 8 bits of
 * `fifth` (one a weight, lowest first) on top as 16s. On AVX2 each bit is shifted into its lane's
 * bit 4 before the one conversion, as nibbles8 cuts the nibbles. */
static inline vec8 nibbles8_fifth(const uint8_t *q, int high, uint8_t fifth) {
#if defined(__AVX2__)
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i low = high ? _mm256_srli_epi32(bytes, 4) : _mm256_and_si256(bytes, _mm256_set1_epi32(15));
    const __m256i bits = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(fifth << 4),
                                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                          _mm256_set1_epi32(16));
    return (vec8)_mm256_cvtepi32_ps(_mm256_or_si256(low, bits));
#else
    uint64_t bits = 0;
    for (int i = 0; i < 8; i++) bits |= (uint64_t)(fifth >> i & 1) << (8 * i + 4);
    return u8_lanes((load64(q) >> (4 * high) & NIBBLES) | bits);
#endif
}

/* (sc, mn) of chunk s of a Q4_K block's 12 scale bytes: 6 bits each, the top two of chunks 4-7
 * kept in the high bits of bytes 0-7 */
static inline void q4_k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Whether a type's chunk is one block of the form w = d * q + m with q integers (Q8_0, Q4_0, Q4_1,
 * Q5_0, Q5_1, MXFP4). */
static inline int scaled_chunk_type(int type) {
    return type == Q8_0 || type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == MXFP4;
}

/* Whether such a type's m is always 0 (w = d * q) */
static inline int scaled_chunk_unshifted(int type) { return type == Q8_0 || type == MXFP4; }

/* MXFP4's d: half the E8M0 scale e, 2^(e - 128), as gguf-py's e8m0_to_fp32_half builds its bits (a
 * subnormal for e < 2) */
static inline float e8m0_half_to_f32(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

/* The 32 integers an MXFP4 block's 16 bytes of E2M1 codes stand for (low nibbles: weights 0-15,
 * high: 16-31), as floats. AVX-512 looks each code up in a 16-float table with vpermps, which reads
 * only an index's low 4 bits (the low nibble needs no mask); AVX2 looks 16 codes up at once in a
 * 16-byte table with pshufb and widens the bytes. */
static inline void mxfp4_ints(const uint8_t *codes, vec8 q[4]) {
#if defined(__AVX512F__)
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    const __m512 low = _mm512_permutexvar_ps(bytes, table), high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    memcpy(q, &low, sizeof low);
    memcpy(q + 2, &high, sizeof high);
#elif defined(__AVX2__)
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)codes), nibble = _mm_set1_epi8(15);
    const __m128i halves[2] = {_mm_shuffle_epi8(table, _mm_and_si128(bytes, nibble)),
                               _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble))};
    for (int h = 0; h < 2; h++) {
        q[2 * h] = (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(halves[h]));
        q[2 * h + 1] = (vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(halves[h], halves[h])));
    }
#else
    static const int8_t values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    for (int i = 0; i < 16; i++) {
        q[i / 8][i % 8] = (float)values[codes[i] & 15];
        q[2 + i / 8][i % 8] = (float)values[codes[i] >> 4];
    }
#endif
}

/* Chunk c of a row of such blocks: its integers q as floats (exact), with the block's d and m (0 for
 * Q8_0 and MXFP4, -8 d for Q4_0, -16 d for Q5_0). `type` is a constant where this is inlined. */
static inline __attribute__((always_inline)) void scaled_chunk(int type, const uint8_t *row, int64_t c, vec8 q[4],
                                                               float *d, float *m) {
    const uint8_t *b = row + c * quant_block_bytes(type);
    if (type == MXFP4) {
        *d = e8m0_half_to_f32(b[0]);
        *m = 0.0f;
        mxfp4_ints(b + 1, q);
        return;
    }
    if (type == Q8_0) {
        *d = fp16_to_f32(b);
        *m = 0.0f;
        for (int i = 0; i < 4; i++) q[i] = bytes8(b + 2 + 8 * i);
        return;
    }
    if (type == Q4_1 || type == Q5_1) {
        fp16_pair_to_f32(b, d, m);
    } else {
        *d = fp16_to_f32(b);
        *m = (type == Q5_0 ? -16.0f : -8.0f) * *d;
    }
    if (type == Q5_0 || type == Q5_1) {
        const uint8_t *qh = b + (type == Q5_1 ? 4 : 2), *nibbles = qh + 4;
        /* chunk i's 8 weights are 8 i .. 8 i + 7: byte i of qh holds their fifth bits */
        for (int i = 0; i < 4; i++) q[i] = nibbles8_fifth(nibbles + 8 * (i & 1), i >> 1, qh[i]);
        return;
    }
    const uint8_t *nibbles = b + (type == Q4_1 ? 4 : 2);
    for (int i = 0; i < 4; i++) q[i] = nibbles8(nibbles + 8 * (i & 1), i >> 1);
}

/* w[0..3] = weights 32 c .. 32 c + 31 of a row of blocks (c counts 32-weight chunks along the row).
 * `type` is a constant where this is inlined, so the switch folds away. */
static inline __attribute__((always_inline)) void dequant_chunk(int type, const uint8_t *row, int64_t c, vec8 w[4]) {
    if (scaled_chunk_type(type)) {
        float d, m;
        scaled_chunk(type, row, c, w, &d, &m);
        for (int i = 0; i < 4; i++) w[i] = scaled_chunk_unshifted(type) ? d * w[i] : d * w[i] + m;
        return;
    }
    const uint8_t *b = row + (c / 8) * quant_block_bytes(type);
    const int s = (int)(c % 8);
    if (type == Q4_K) {
        int sc, mn;
        q4_k_scale_min(b + 4, s, &sc, &mn);
        const float scale = fp16_to_f32(b) * (float)sc, min = fp16_to_f32(b + 2) * (float)mn;
        const uint8_t *q = b + 16 + 32 * (s / 2);
        for (int i = 0; i < 4; i++) w[i] = scale * nibbles8(q + 8 * i, s & 1) - min;
        return;
    }
    if (type == Q5_K) {
        int sc, mn;
        q4_k_scale_min(b + 4, s, &sc, &mn);
        const float scale = fp16_to_f32(b) * (float)sc, min = fp16_to_f32(b + 2) * (float)mn;
        const uint8_t *q = b + 48 + 32 * (s / 2), *qh = b + 16;
        for (int i = 0; i < 4; i++) {
            const vec8 fifth = u8_lanes(load64(qh + 8 * i) >> s & 0x0101010101010101ull);
            w[i] = scale * (nibbles8(q + 8 * i, s & 1) + 16.0f * fifth) - min;
        }
        return;
    }
    /* Q6_K */
    const int h = s / 4, t = s % 4;
    const uint8_t *ql = b + 64 * h + 32 * (t & 1), *qh = b + 128 + 32 * h;
    const int8_t *scales = (const int8_t *)(b + 192) + 8 * h + 2 * t;
    const float d = fp16_to_f32(b + 208);
    for (int i = 0; i < 4; i++) {
        const uint64_t q = (load64(ql + 8 * i) >> (4 * (t >> 1)) & NIBBLES)
                           | (load64(qh + 8 * i) >> (2 * t) & 0x0303030303030303ull) << 4;
        w[i] = (d * (float)scales[i >> 1]) * (u8_lanes(q) - 32.0f);
    }
}

#define MAX_SCALED_CHUNKS 2048 /* the one-row paths' x chunk sums live on the stack: k <= 65536 */

/* sx[c] = x's 32-wide chunk c summed, c < k / 32: what the one-row kernels multiply a chunk's offset by */
static inline void chunk_sums(const float *x, int64_t k, float *sx) {
    for (int64_t c = 0; c < k / 32; c++) {
        const float *xc = x + 32 * c;
        sx[c] = hsum8((load8(xc) + load8(xc + 8)) + (load8(xc + 16) + load8(xc + 24)));
    }
}

/* out[0..32 count) = weights 32 first .. 32 (first + count) - 1 of a row of a type, dequantized (the
 * switch outside the loop) */
static inline void dequantize_chunks(int64_t type, const uint8_t *row, int64_t first, int64_t count, float *out) {
    for (int64_t c = first; c < first + count; c++) {
        vec8 w[4];
        switch (type) {
        case Q4_0: dequant_chunk(Q4_0, row, c, w); break;
        case Q4_1: dequant_chunk(Q4_1, row, c, w); break;
        case Q5_0: dequant_chunk(Q5_0, row, c, w); break;
        case Q5_1: dequant_chunk(Q5_1, row, c, w); break;
        case Q8_0: dequant_chunk(Q8_0, row, c, w); break;
        case MXFP4: dequant_chunk(MXFP4, row, c, w); break;
        case Q4_K: dequant_chunk(Q4_K, row, c, w); break;
        case Q5_K: dequant_chunk(Q5_K, row, c, w); break;
        default: dequant_chunk(Q6_K, row, c, w); break;
        }
        memcpy(out + 32 * (c - first), w, sizeof w);
    }
}

/* out[0..k) = a row of k weights of a type, dequantized */
static inline void dequantize_row(int64_t type, const uint8_t *row, int64_t k, float *out) {
    dequantize_chunks(type, row, 0, k / 32, out);
}

#endif
