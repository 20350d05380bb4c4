/* One row of x (a sequence decoding alone) times Q4_K, Q5_K and Q6_K weights on AVX2, in the form
 * quant_matmul.c's one-row path gives the 32-weight types: each sub-block's scale times the sum of its
 * integers times x, minus its min times x's sum over it. A weight then costs no multiply-add of its
 * own: the kernels are bound by their instruction count (docs/profiling.md section 12). */
#include "kquant_blocks.h"

#if defined(KQ_AVX512) && !KQ_AVX512
/* x times a Q4_K weight row (sx: x's 32-value sums, chunk_sums), or with five_bits a Q5_K row (each
 * nibble's fifth bit, fifth_bit, or-ed in before the conversion) */
static inline __attribute__((always_inline)) float nibbles_row(const uint8_t *w, const float *x, const float *sx,
                                                              int64_t k, const int five_bits) {
    const int64_t block_bytes = five_bits ? 176 : 144, nibbles = five_bits ? 48 : 16;
    float sm[16] __attribute__((aligned(32)));
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t blk = 0; blk < k / 256; blk++) {
        const uint8_t *b = w + blk * block_bytes;
        q4_k_scales_mins(b, sm);
        mins = _mm256_fmadd_ps(_mm256_load_ps(sm + 8), _mm256_loadu_ps(sx + 8 * blk), mins);
        __m256i qh[4];
        for (int i = 0; i < 4 && five_bits; i++)
            qh[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 + 8 * i)));
        /* unrolled, so that fifth_bit's shifts take constant counts */
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const uint8_t *q = b + nibbles + 32 * p;
            const float *xp = x + 256 * blk + 64 * p;
            __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)));
                __m256i low_q = _mm256_and_si256(bytes, _mm256_set1_epi32(15)), high_q = _mm256_srli_epi32(bytes, 4);
                if (five_bits) {
                    low_q = _mm256_or_si256(low_q, fifth_bit(qh[i], 2 * p));
                    high_q = _mm256_or_si256(high_q, fifth_bit(qh[i], 2 * p + 1));
                }
                low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low_q), _mm256_loadu_ps(xp + 8 * i), low);
                high = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high_q), _mm256_loadu_ps(xp + 32 + 8 * i), high);
            }
            acc0 = _mm256_fmadd_ps(low, _mm256_set1_ps(sm[2 * p]), acc0);
            acc1 = _mm256_fmadd_ps(high, _mm256_set1_ps(sm[2 * p + 1]), acc1);
        }
    }
    return hsum8((vec8)_mm256_add_ps(acc0, acc1)) - hsum8((vec8)mins);
}

/* Each its own function: inlined into one loop beside Q5_K's, Q4_K's one-row kernel ran ~10 % slower */
static __attribute__((noinline)) float q4_k_row(const uint8_t *w, const float *x, const float *sx, int64_t k) {
    return nibbles_row(w, x, sx, k, 0);
}

static __attribute__((noinline)) float q5_k_row(const uint8_t *w, const float *x, const float *sx, int64_t k) {
    return nibbles_row(w, x, sx, k, 1);
}

/* The same for Q6_K: each 16 weights' scale times the sum of their integers (minus 32) times x */
static float q6_k_row(const uint8_t *w, const float *x, int64_t k) {
    float ds[16] __attribute__((aligned(32)));
    vec8 acc[2] = {{0}, {0}};
    q6_k_halves_t run;
    q6_k_halves_start(&run, w, k / 128);
    for (int64_t h = 0; h < k / 128; h++) {
        const q6_k_half_t *ints = q6_k_halves_next(&run, h);
        if (h % 2 == 0) q6_k_scales(w + h / 2 * 210, ds);
        const float *xh = x + 128 * h;
        for (int g = 0; g < 8; g++) {
            const vec8 sum = q6_k_ints(ints, 2 * g) * load8(xh + 16 * g)
                             + q6_k_ints(ints, 2 * g + 1) * load8(xh + 16 * g + 8);
            acc[g % 2] += sum * ds[8 * (h % 2) + g];
        }
    }
    return hsum8(acc[0] + acc[1]);
}

void kquant_row_tasks(int64_t type, const float *x, const uint8_t *weight, const float *bias, float *out,
                      int64_t n, int64_t k) {
    const int64_t row_bytes = quant_row_bytes(type, k);
    float sx[MAX_SCALED_CHUNKS];
    if (type != Q6_K) chunk_sums(x, k, sx);
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *w = weight + j * row_bytes;
        const float dot = type == Q4_K ? q4_k_row(w, x, sx, k) : type == Q5_K ? q5_k_row(w, x, sx, k) : q6_k_row(w, x, k);
        out[j] = dot + (bias != NULL ? bias[j] : 0.0f);
    }
}

#endif
