/* Causal attention for prompt chunks over the paged KV cache (fp32, CPU): whole prompts, later
 * chunks of a chunked prefill and prompts behind a prefix-cache hit alike, each at its own length.
 *
 * The torch path pads every chunk of a step to the longest, gathers the cache into that padded
 * shape (or, for whole prompts, copies q/k/v into it) and runs SDPA, which on CPU works through
 * small per-head blocks: for 64 prompts of 32 tokens it took ~5 ms a layer, padding included, for
 * ~75 MFLOP. Here the work is split into tasks of (sequence, tile of query rows, KV head). A task
 * puts the tile's queries for that KV head (rows x the query heads sharing it, up to LANES of them)
 * side by side, so that the scores are a small matrix product with the keys read in place, the
 * causal mask is a comparison per lane and the softmax runs across lanes; then each lane's
 * weighted sum of V goes straight to its output row. K/V are read where they lie in the cache,
 * which the caller has already written this chunk's rows into.
 * Called by the CPU backend's attention (backends/cpu/attention.py).
 *
 * q:                 [rows, num_heads, head_dim], rows q_row_stride floats apart (heads contiguous)
 * out:               [rows, num_heads, head_dim], contiguous; only the rows of the sequences given
 * k_cache, v_cache:  [slots, num_kv_heads, head_dim], as in paged_attention.c
 * block_tables:      [n, max_blocks]
 * q_starts, q_lens:  [n]; sequence i's queries are rows q_starts[i] .. q_starts[i] + q_lens[i] - 1
 * kv_lens:           [n]; its cached tokens, this chunk included: query j of sequence i is at
 *                    position kv_lens[i] - q_lens[i] + j and attends to tokens 0 .. that position, or
 *                    with a sliding_window W > 0 to the last W of them (p - W < t <= p); keys before
 *                    any of a tile's windows are never read
 * logit_softcap:     > 0: scores become cap * tanh(scores / cap) after the scale (Gemma 2); 0: none
 * sinks:             [num_heads] or NULL: head h's softmax has one more logit, sinks[h], in its
 *                    denominator and none in the output (gpt-oss)
 * Query head h reads KV head h / (num_heads / num_kv_heads), as HF's repeat_kv does.
 * Returns 0, or 1 when a thread could not allocate its scratch (out is then incomplete).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "simd.h"

/* A task holds up to LANES query vectors side by side (at least one row's query heads:
 * backends/cpu/ops.py (PREFILL_LANES) refuses more per KV head). The scores go PASS_LANES lanes and
 * KEYS_AT_ONCE keys at a time, from registers: on AVX-512 all 64 lanes (4 vectors) by six keys, 24
 * accumulators of 32 registers, 24 FMAs a step over head_dim for 4 loads and 6 broadcasts (four keys
 * ran 4-16 % slower, more at longer prompts); with AVX2's 16 registers, 32 lanes by three keys, 12
 * accumulators, in two passes. */
#define LANES 64
#if defined(__AVX512F__)
#define PASS_LANES 64
#define KEYS_AT_ONCE 6
#else
#define PASS_LANES 32
#define KEYS_AT_ONCE 3
#endif
#define PASS_VECS (PASS_LANES / VEC_FLOATS)

/* scores[t][lane] = q_lane . k_t for the task's keys 0 .. len - 1; qt: [head_dim][LANES], the
 * queries transposed (and already scaled) so that a lane's products accumulate in a vector lane. */
static inline __attribute__((always_inline)) void score_keys(const float *qt, const float *k_cache,
                                                             const int64_t *rows, int64_t len, int64_t head_dim,
                                                             float *scores) {
    for (int pass = 0; pass < LANES; pass += PASS_LANES) {
        const float *qp = qt + pass;
        float *sp = scores + pass;
        int64_t t = 0;
        for (; t + KEYS_AT_ONCE <= len; t += KEYS_AT_ONCE) {
            const float *k[KEYS_AT_ONCE];
            for (int j = 0; j < KEYS_AT_ONCE; j++) k[j] = k_cache + rows[t + j];
            vec_t acc[KEYS_AT_ONCE][PASS_VECS] = {{{0}}};
            for (int64_t d = 0; d < head_dim; d++) {
                vec_t qd[PASS_VECS];
                for (int c = 0; c < PASS_VECS; c++) qd[c] = load_vec(qp + d * LANES + c * VEC_FLOATS);
                for (int j = 0; j < KEYS_AT_ONCE; j++) {
                    const float kd = k[j][d];
                    for (int c = 0; c < PASS_VECS; c++) acc[j][c] += qd[c] * kd;
                }
            }
            for (int j = 0; j < KEYS_AT_ONCE; j++)
                for (int c = 0; c < PASS_VECS; c++) store_vec(sp + (t + j) * LANES + c * VEC_FLOATS, acc[j][c]);
        }
        for (; t < len; t++) {
            const float *k = k_cache + rows[t];
            vec_t acc[PASS_VECS] = {0};
            for (int64_t d = 0; d < head_dim; d++)
                for (int c = 0; c < PASS_VECS; c++) acc[c] += load_vec(qp + d * LANES + c * VEC_FLOATS) * k[d];
            for (int c = 0; c < PASS_VECS; c++) store_vec(sp + t * LANES + c * VEC_FLOATS, acc[c]);
        }
    }
}

/* Causal softmax down each lane: key t counts for a lane when first[lane] <= t <= last[lane] (first
 * NULL: from key 0). Masked scores become 0; inv[lane] gets 1 / the lane's sum (applied to the output,
 * once per value, not per key); a lane's sink (sink NULL: none) counts in that sum only. Inlined, so
 * that a NULL `first` costs the loops nothing. */
static inline __attribute__((always_inline)) void softmax_lanes(float *scores, int64_t len, const int64_t *first,
                                                                const int64_t *last, const float *sink, float *inv) {
    float peak[LANES], total[LANES];
    for (int l = 0; l < LANES; l++) peak[l] = sink == NULL ? -INFINITY : sink[l], total[l] = 0.0f;
    for (int64_t t = 0; t < len; t++) {
        const float *s = scores + t * LANES;
#pragma omp simd
        for (int l = 0; l < LANES; l++)
            peak[l] = ((first == NULL || t >= first[l]) && t <= last[l] && s[l] > peak[l]) ? s[l] : peak[l];
    }
    for (int64_t t = 0; t < len; t++) {
        float *s = scores + t * LANES;
#pragma omp simd
        for (int l = 0; l < LANES; l++) {
            const float p = (first == NULL || t >= first[l]) && t <= last[l] ? exp_f32(s[l] - peak[l]) : 0.0f;
            s[l] = p;
            total[l] += p;
        }
    }
    if (sink != NULL)
        for (int l = 0; l < LANES; l++) total[l] += exp_f32(sink[l] - peak[l]);
    for (int l = 0; l < LANES; l++) inv[l] = 1.0f / total[l];
}

/* Floats [first, first + chunks * VEC_FLOATS) of out_rows[i] = inv[lane0 + i] * sum_t p[t][lane0 + i] * v_t,
 * for `block` lanes at once (block x chunks accumulators, at most 6 x 8). */
static inline __attribute__((always_inline)) void weigh_values(const float *p, const float *v_cache,
                                                               const int64_t *rows, int64_t len, int lane0,
                                                               const int block, int64_t first, const int64_t chunks,
                                                               const float *inv, float *const *out_rows) {
    vec_t acc[6][8] = {{{0}}};
    for (int64_t t = 0; t < len; t++) {
        const float *v = v_cache + rows[t] + first;
        const float *pt = p + t * LANES + lane0;
        for (int64_t c = 0; c < chunks; c++) {
            const vec_t vc = load_vec(v + c * VEC_FLOATS);
            for (int i = 0; i < block; i++) acc[i][c] += pt[i] * vc;
        }
    }
    for (int i = 0; i < block; i++)
        if (out_rows[i] != NULL)
            for (int64_t c = 0; c < chunks; c++)
                store_vec(out_rows[i] + first + c * VEC_FLOATS, acc[i][c] * inv[lane0 + i]);
}

/* weigh_values over lanes lane_from .. lane_to - 1 and all of head_dim (a multiple of 16, at most
 * 128: backends/cpu/ops.py checks), in blocks of `block` lanes by `chunks` vectors; a last block may
 * reach past lane_to (those lanes have no output row). */
static inline __attribute__((always_inline)) void weigh_lanes(const float *p, const float *v_cache, const int64_t *rows,
                                                              int64_t len, int64_t lane_from, int64_t lane_to,
                                                              const int block, const int64_t chunks, int64_t head_dim,
                                                              const float *inv, float *const *out_rows) {
    for (int64_t first = 0; first < head_dim; first += chunks * VEC_FLOATS)
        for (int64_t lane0 = lane_from; lane0 < lane_to; lane0 += block)
            weigh_values(p, v_cache, rows, len, (int)lane0, block, first, chunks, inv, out_rows + lane0);
}

/* One task: query rows row0 .. row0 + n_rows - 1 of a sequence (positions from pos0), the query
 * heads of KV head kv. `rows` holds the offset of the cache row of every key from rows_first on. */
static void attend_tile(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                        float *out, const int64_t *rows, int64_t rows_first, int64_t row0, int64_t n_rows, int64_t pos0,
                        int64_t kv, int64_t group, int64_t num_heads, int64_t head_dim, float scale,
                        int64_t sliding_window, float logit_softcap, const float *sinks, float *qt, float *scores) {
    /* the tile's keys from key0 (the first in its first row's window) to its last row's position;
     * first/last: each lane's window, counted from key0 */
    const int64_t key0 = sliding_window > 0 && pos0 >= sliding_window ? pos0 - sliding_window + 1 : 0;
    int64_t first[LANES], last[LANES];
    float sink[LANES];
    /* a last block of lanes may reach past LANES: those lanes have no output row */
    float inv[LANES + 8];
    float *out_rows[LANES + 8] = {NULL};
    const int64_t lanes = n_rows * group, len = pos0 + n_rows - key0;
    for (int64_t l = 0; l < LANES; l++) {
        const int64_t r = l < lanes ? l / group : n_rows - 1; /* spare lanes repeat the last query */
        const int64_t h = kv * group + (l < lanes ? l % group : group - 1);
        const float *ql = q + (row0 + r) * q_row_stride + h * head_dim;
        for (int64_t d = 0; d < head_dim; d++) qt[d * LANES + l] = ql[d] * scale;
        last[l] = pos0 + r - key0;
        first[l] = sliding_window > 0 && last[l] >= sliding_window ? last[l] - sliding_window + 1 : 0;
        out_rows[l] = l < lanes ? out + ((row0 + r) * num_heads + h) * head_dim : NULL;
        sink[l] = sinks == NULL ? 0.0f : sinks[h];
    }
    rows += key0 - rows_first;
    score_keys(qt, k_cache + kv * head_dim, rows, len, head_dim, scores);
    if (logit_softcap > 0.0f) soft_cap(scores, len * LANES, logit_softcap);
    const float *lane_sinks = sinks == NULL ? NULL : sink;
    if (sliding_window > 0)
        softmax_lanes(scores, len, first, last, lane_sinks, inv);
    else
        softmax_lanes(scores, len, NULL, last, lane_sinks, inv);
    const float *v_base = v_cache + kv * head_dim;
    /* 24 sums in registers on AVX-512: six lanes of head_dim 64 (5-7 % faster than four at 256-2048
     * tokens), three of 128; on AVX2 12: three lanes by 32 floats */
#if defined(__AVX512F__)
    if (head_dim == 64) {
        weigh_lanes(scores, v_base, rows, len, 0, lanes / 6 * 6, 6, 4, 64, inv, out_rows);
        weigh_lanes(scores, v_base, rows, len, lanes / 6 * 6, lanes, 4, 4, 64, inv, out_rows);
    } else if (head_dim == 128) {
        weigh_lanes(scores, v_base, rows, len, 0, lanes / 3 * 3, 3, 8, 128, inv, out_rows);
        weigh_lanes(scores, v_base, rows, len, lanes / 3 * 3, lanes, 2, 8, 128, inv, out_rows);
    } else {
        weigh_lanes(scores, v_base, rows, len, 0, lanes, 2, head_dim / 16, head_dim, inv, out_rows);
    }
#else
    if (head_dim % 32 == 0)
        weigh_lanes(scores, v_base, rows, len, 0, lanes, 3, 4, head_dim, inv, out_rows);
    else
        weigh_lanes(scores, v_base, rows, len, 0, lanes, 3, 2, head_dim, inv, out_rows);
#endif
}

int paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                                float *out, const int64_t *block_tables, const int64_t *q_starts,
                                const int64_t *q_lens, const int64_t *kv_lens, int64_t n, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                float scale, int64_t sliding_window, float logit_softcap, const float *sinks,
                                int num_threads) {
    const int64_t group = num_heads / num_kv_heads, tile_rows = group < LANES ? LANES / group : 1;
    const int64_t slot_floats = num_kv_heads * head_dim, max_len = max_blocks * block_size;
    /* tasks in order of sequence, then tile, then KV head: neighbours share a sequence's keys */
    int64_t *task_starts = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (task_starts == NULL) return 1;
    task_starts[0] = 0;
    for (int64_t i = 0; i < n; i++)
        task_starts[i + 1] = task_starts[i] + (q_lens[i] + tile_rows - 1) / tile_rows * num_kv_heads;
    const int64_t num_tasks = task_starts[n];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *qt = malloc(sizeof(float) * (size_t)(head_dim * LANES));
        /* + 8: a last block of lanes in weigh_values reads up to two lanes past the last key's row */
        float *scores = malloc(sizeof(float) * (size_t)(max_len * LANES + 8));
        int64_t *rows = malloc(sizeof(int64_t) * (size_t)max_len);
        int64_t rows_of = -1; /* the sequence whose key offsets `rows` holds */
        failed = qt == NULL || scores == NULL || rows == NULL;
        int64_t seq = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_tasks; task++) {
            if (failed) continue;
            while (task_starts[seq + 1] <= task) seq++;
            while (task_starts[seq] > task) seq--;
            const int64_t local = task - task_starts[seq], tile = local / num_kv_heads, kv = local % num_kv_heads;
            const int64_t pos0 = kv_lens[seq] - q_lens[seq], first = tile * tile_rows;
            const int64_t n_rows = q_lens[seq] - first < tile_rows ? q_lens[seq] - first : tile_rows;
            /* the first key any of the sequence's queries sees */
            const int64_t rows_first = sliding_window > 0 && pos0 >= sliding_window ? pos0 - sliding_window + 1 : 0;
            if (rows_of != seq) {
                token_row_offsets(block_tables + seq * max_blocks, rows_first, kv_lens[seq], block_size, slot_floats,
                                  rows);
                rows_of = seq;
            }
            attend_tile(q, q_row_stride, k_cache, v_cache, out, rows, rows_first, q_starts[seq] + first, n_rows,
                        pos0 + first, kv, group, num_heads, head_dim, scale, sliding_window, logit_softcap, sinks, qt,
                        scores);
        }
        free(qt);
        free(scores);
        free(rows);
    }
    free(task_starts);
    return failed;
}
