/* Helpers shared by roseinfer's C kernels: 16-float vectors, a vectorizable exp, one row of RMSNorm
 * and of SiLU * up, the rotary pair rotation, a sequence's row offsets in the paged cache, and the
 * attention logit soft-cap. */
#ifndef ROSEINFER_SIMD_H
#define ROSEINFER_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* 16 floats: dot's accumulator, so that its sums go in the same order on every target (loops tiled
 * for the register file take vec_t below) */
typedef float vec16 __attribute__((vector_size(64)));

static inline vec16 load16(const float *p) {
    vec16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

typedef float vec8 __attribute__((vector_size(32)));
typedef float vec4 __attribute__((vector_size(16)));

static inline vec8 load8(const float *p) {
    vec8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The widest float vector the target keeps in registers: 16 floats with AVX-512, else 8 (AVX2; the
 * portable build lowers it to what it has). Kernels tiled for the register file use it: GCC builds a
 * vector wider than the target's through the stack, where a scalar times one became sixteen scalar
 * stores and a reload. */
#if defined(__AVX512F__)
typedef vec16 vec_t;
#else
typedef vec8 vec_t;
#endif
#define VEC_FLOATS ((int)(sizeof(vec_t) / sizeof(float)))

static inline vec_t load_vec(const float *p) {
    vec_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_vec(float *p, vec_t v) { memcpy(p, &v, sizeof v); }

/* Halves added pairwise: summing the 16 lanes in order was a chain of 16 dependent adds, and with
 * one sum per head and cached token it was the slowest part of decode attention. The halves are
 * built from lanes, not copied out with memcpy: a copy out of `v` made GCC keep a loop's
 * accumulator on the stack, a store and a reload every iteration (RMSNorm over 64 rows of 576 took
 * 13 us, now 5-6). */
static inline float hsum16(vec16 v) {
    const vec8 s8 = (vec8){v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]}
                    + (vec8){v[8], v[9], v[10], v[11], v[12], v[13], v[14], v[15]};
    const vec4 s4 = (vec4){s8[0], s8[1], s8[2], s8[3]} + (vec4){s8[4], s8[5], s8[6], s8[7]};
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static inline float hsum8(vec8 v) {
    const vec4 s4 = (vec4){v[0], v[1], v[2], v[3]} + (vec4){v[4], v[5], v[6], v[7]};
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

/* a vec_t's lanes summed */
static inline float hsum_vec(vec_t v) {
#if defined(__AVX512F__)
    return hsum16(v);
#else
    return hsum8(v);
#endif
}

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    vec16 acc = {0};
    for (; d + 16 <= n; d += 16) acc += load16(a + d) * load16(b + d);
    float sum = hsum16(acc);
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

/* e^x in a form the compiler vectorizes (glibc's expf is a scalar call, and took a third of the
 * attention kernel): x = n ln2 + r with |r| <= ln2/2, e^r by its degree-6 Taylor polynomial
 * (relative error < 2e-7), 2^n written into the exponent bits. x is clamped to [-87, 88], where
 * 2^n stays a normal float: e^-87 ~ 1.6e-38 is as good as 0 next to the terms it is summed with. */
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

/* out = weight * row / sqrt(mean(row^2) + eps), as LlamaRMSNorm computes it. With a residual row,
 * row + residual is written back to residual first and that sum is normalised (vLLM's fused add).
 * One copy for the norm kernel and the matmul that normalises its input rows, so both round alike. */
static inline void rms_norm_row(const float *row, float *residual, const float *weight, float *out, int64_t dim,
                                float eps) {
    if (residual != NULL) {
        for (int64_t d = 0; d < dim; d++) residual[d] += row[d];
        row = residual;
    }
    const float inv = 1.0f / sqrtf(dot(row, row, dim) / (float)dim + eps);
    for (int64_t d = 0; d < dim; d++) out[d] = weight[d] * (row[d] * inv);
}

/* out = silu(gate) * up over `width` floats each */
static inline void silu_mul_row(const float *gate, const float *up, float *out, int64_t width) {
#pragma omp simd
    for (int64_t d = 0; d < width; d++) out[d] = gate[d] / (1.0f + exp_f32(-gate[d])) * up[d];
}

/* Rotates one token's heads in place: pairs (x[2i], x[2i+1]) times angle[i] = (cos, sin), a complex
 * multiply. The compiler fuses a product and a sum into an FMA here, so results differ from
 * transformers' rotary by one rounding (< 1e-6 relative). */
static inline void rotate_heads(float *x, const float *angle, int64_t heads, int64_t head_dim) {
    for (int64_t h = 0; h < heads; h++) {
        float *pair = x + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < head_dim / 2; i++) {
            const float re = pair[2 * i], im = pair[2 * i + 1], c = angle[2 * i], s = angle[2 * i + 1];
            pair[2 * i] = re * c - im * s;
            pair[2 * i + 1] = im * c + re * s;
        }
    }
}

/* Offsets, in floats, of a sequence's token rows first .. len - 1 in a paged cache whose slots lie
 * slot_floats apart (offsets[t - first] for token t): token t is in slot
 * table[t / block_size] * block_size + t % block_size. Walked block by block, because a 64-bit
 * division per token was ~10 % of decode attention. */
static inline void token_row_offsets(const int64_t *table, int64_t first, int64_t len, int64_t block_size,
                                     int64_t slot_floats, int64_t *offsets) {
    for (int64_t t = first, block = first / block_size, offset = first % block_size; t < len; t++) {
        offsets[t - first] = (table[block] * block_size + offset) * slot_floats;
        if (++offset == block_size) offset = 0, block++;
    }
}

/* A layer's attention logit soft-cap, in place: s = cap * tanh(s / cap) (transformers' Gemma 2). */
static inline void soft_cap(float *s, int64_t n, float cap) {
    const float inv = 1.0f / cap;
    for (int64_t i = 0; i < n; i++) s[i] = cap * tanhf(s[i] * inv);
}

#endif
