/* The gated delta rule's decode step (Gated DeltaNet, layers/gated_delta_rule.py recurrent_step),
 * in place on the state pool: torch reads and writes each [k_dim, v_dim] state about six times a step
 * (gather, decay, predict, update, read out, scatter back); here each (sequence, head) state is read
 * and written once, in two passes over its rows while it sits in cache. Sequences and heads are
 * split over threads. */
#include <math.h>
#include <stdint.h>

#include "kernels.h"

/* q, k [n, heads, k_dim] (k normalised, q normalised and scaled), v [n, heads, v_dim], g, beta
 * [n, heads]; states [slots, heads, k_dim, v_dim], sequence i's at slots[i], multiplied by keep[i]
 * first (0: it starts at position 0 from zeros); out [n, heads, v_dim]. Per head:
 *   S <- exp(g) S;  S <- S + k (beta (v - k^T S))^T;  o = q^T S */
void gated_delta_decode_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            float *states, const int64_t *slots, const float *keep, float *out, int64_t n,
                            int64_t heads, int64_t k_dim, int64_t v_dim, int num_threads) {
#pragma omp parallel for collapse(2) num_threads(num_threads) if (n * heads * k_dim * v_dim >= 65536)
    for (int64_t i = 0; i < n; i++) {
        for (int64_t h = 0; h < heads; h++) {
            float *s = states + (slots[i] * heads + h) * k_dim * v_dim;
            const float *qh = q + (i * heads + h) * k_dim, *kh = k + (i * heads + h) * k_dim;
            const float *vh = v + (i * heads + h) * v_dim;
            float *o = out + (i * heads + h) * v_dim;
            const float decay = expf(g[i * heads + h]) * keep[i], b = beta[i * heads + h];
            float delta[v_dim];
            for (int64_t c = 0; c < v_dim; c++) delta[c] = 0.0f;
            for (int64_t r = 0; r < k_dim; r++) { /* decay the state and predict v from it */
                float *row = s + r * v_dim;
                const float kr = kh[r];
#pragma omp simd
                for (int64_t c = 0; c < v_dim; c++) {
                    row[c] *= decay;
                    delta[c] += kr * row[c];
                }
            }
#pragma omp simd
            for (int64_t c = 0; c < v_dim; c++) {
                delta[c] = b * (vh[c] - delta[c]);
                o[c] = 0.0f;
            }
            for (int64_t r = 0; r < k_dim; r++) { /* the update, and the read-out by q */
                float *row = s + r * v_dim;
                const float kr = kh[r], qr = qh[r];
#pragma omp simd
                for (int64_t c = 0; c < v_dim; c++) {
                    row[c] += kr * delta[c];
                    o[c] += qr * row[c];
                }
            }
        }
    }
}
