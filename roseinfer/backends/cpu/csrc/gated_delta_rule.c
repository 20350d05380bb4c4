/* The gated delta rule (Gated DeltaNet, layers/gated_delta_rule.py), in place on the state pool.
 * Decode: torch reads and writes each [k_dim, v_dim] state about six times a step (gather, decay,
 * predict, update, read out, scatter back); here each (sequence, head) state is read and written
 * once, in two passes over its rows while it sits in cache. Prefill: the recurrence token by token
 * instead of the chunked form, which in torch makes a dozen passes over [chunk, chunk] and
 * [chunk, dim] tensors per chunk. A state's columns never mix (each value column has its own
 * prediction, update and read-out), so prefill keeps a slab of COLUMNS columns in L1 across all of a
 * sequence's tokens. Work is split over threads by sequence, head and (prefill) column slab. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

#define COLUMNS 16 /* one AVX-512 vector of fp32: a 128-row slab is 8 KiB */

/* One token on columns [0, width) of a state s (rows of `stride` floats):
 *   S <- decay S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S */
static inline void delta_rule_token(float *s, int64_t stride, int64_t width, int64_t k_dim, const float *q,
                                    const float *k, const float *v, float decay, float beta, float *o) {
    float delta[width];
    for (int64_t c = 0; c < width; c++) delta[c] = 0.0f;
    for (int64_t r = 0; r < k_dim; r++) { /* decay the state and predict v from it */
        float *row = s + r * stride;
        const float kr = k[r];
#pragma omp simd
        for (int64_t c = 0; c < width; c++) {
            row[c] *= decay;
            delta[c] += kr * row[c];
        }
    }
#pragma omp simd
    for (int64_t c = 0; c < width; c++) {
        delta[c] = beta * (v[c] - delta[c]);
        o[c] = 0.0f;
    }
    for (int64_t r = 0; r < k_dim; r++) { /* the update, and the read-out by q */
        float *row = s + r * stride;
        const float kr = k[r], qr = q[r];
#pragma omp simd
        for (int64_t c = 0; c < width; c++) {
            row[c] += kr * delta[c];
            o[c] += qr * row[c];
        }
    }
}

/* q, k [n, heads, k_dim] (k normalised, q normalised and scaled), v [n, heads, v_dim], g, beta
 * [n, heads]; states [slots, heads, k_dim, v_dim], sequence i's at slots[i], multiplied by keep[i]
 * first (0: it starts at position 0 from zeros); out [n, heads, v_dim]. */
void gated_delta_decode_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            float *states, const int64_t *slots, const float *keep, float *out, int64_t n,
                            int64_t heads, int64_t k_dim, int64_t v_dim, int num_threads) {
#pragma omp parallel for collapse(2) num_threads(num_threads) if (n * heads * k_dim * v_dim >= 65536)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = i * heads + h;
            delta_rule_token(states + (slots[i] * heads + h) * k_dim * v_dim, v_dim, v_dim, k_dim, q + at * k_dim,
                             k + at * k_dim, v + at * v_dim, expf(g[at]) * keep[i], beta[at], out + at * v_dim);
        }
    }
}

/* Sequences of several tokens, right-padded to `length`: q, k [n, length, heads, k_dim], v, out
 * [n, length, heads, v_dim], g, beta [n, length, heads]; sequence i's first lens[i] tokens continue
 * the state at slots[i] (zeroed first where keep[i] is 0); out's padding rows are left unwritten. */
void gated_delta_prefill_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                             float *states, const int64_t *slots, const float *keep, const int64_t *lens, float *out,
                             int64_t n, int64_t length, int64_t heads, int64_t k_dim, int64_t v_dim,
                             int num_threads) {
    const int64_t slabs = (v_dim + COLUMNS - 1) / COLUMNS;
#pragma omp parallel for collapse(3) num_threads(num_threads)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < heads; h++) {
            for (int64_t slab = 0; slab < slabs; slab++) {
                const int64_t c0 = slab * COLUMNS, width = v_dim - c0 < COLUMNS ? v_dim - c0 : COLUMNS;
                float *s = states + (slots[i] * heads + h) * k_dim * v_dim + c0;
                if (keep[i] == 0.0f) {
                    for (int64_t r = 0; r < k_dim; r++)
                        for (int64_t c = 0; c < width; c++) s[r * v_dim + c] = 0.0f;
                }
                for (int64_t t = 0; t < lens[i]; t++) {
                    const int64_t at = (i * length + t) * heads + h;
                    const float *qt = q + at * k_dim, *kt = k + at * k_dim, *vt = v + at * v_dim + c0;
                    float *ot = out + at * v_dim + c0;
                    if (width == COLUMNS) /* a constant width: the slab's prediction stays in registers */
                        delta_rule_token(s, v_dim, COLUMNS, k_dim, qt, kt, vt, expf(g[at]), beta[at], ot);
                    else
                        delta_rule_token(s, v_dim, width, k_dim, qt, kt, vt, expf(g[at]), beta[at], ot);
                }
            }
        }
    }
}
