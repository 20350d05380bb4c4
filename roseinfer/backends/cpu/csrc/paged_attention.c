/* Decode attention that reads K/V where they lie in the paged pool (fp32, CPU).
 *
 * The torch path first gathers every sequence's blocks into a padded copy for SDPA, which writes
 * and re-reads the whole context (46 KB per token for the default model) on every step. Here one
 * task per sequence walks its block table and reads each cached token's K and V rows once, in
 * place: a token's rows for all KV heads are adjacent, so a block is one contiguous stretch.
 * Called by the CPU backend's attention (backends/cpu/attention.py).
 *
 * q:                 [n, num_heads, head_dim], rows q_row_stride floats apart (heads contiguous); with
 *                    rope set, each row is a whole qkv row: q, then the new token's K, then its V
 * out:               [n, num_heads, head_dim], contiguous
 * k_cache, v_cache:  [slots, num_kv_heads, head_dim]; token t of sequence i lies in slot
 *                    block_tables[i][t / block_size] * block_size + t % block_size
 * block_tables:      [n, max_blocks]
 * kv_lens:           [n]; sequence i's one query attends to its tokens 0 .. kv_lens[i] - 1, or with a
 *                    sliding_window W > 0 to the last W of them (transformers' window: the query at
 *                    position p sees p - W < t <= p); blocks before those are never read
 * logit_softcap:     > 0: scores become cap * tanh(scores / cap) after the scale (Gemma 2); 0: none
 * sinks:             [num_heads] or NULL: head h's softmax has one more logit, sinks[h], in its
 *                    denominator and none in the output (gpt-oss)
 * Query head h reads KV head h / (num_heads / num_kv_heads), as HF's repeat_kv does.
 * Returns 0, or 1 when a thread could not allocate its scratch (out is then incomplete).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "simd.h"

static inline void axpy(float *y, float a, const float *x, int64_t n) {
#pragma omp simd
    for (int64_t d = 0; d < n; d++) y[d] += a * x[d];
}

/* Rows this many tokens ahead are prefetched into L2 (prefetcht1): blocks lie anywhere in the pool,
 * so the hardware prefetcher loses the stream at every block edge. Measured with the pool out of
 * cache (B=64, 81 cached tokens, 30 layers, one process): 4 tokens into L1 16.5 ms, into L2 12.2;
 * 8 into L2 10.7, 16 11.7, 32 13.3; non-temporal 15.0. Into L1, four tokens are already 48 lines
 * in flight per core (12 a token), which is presumably more than L1 can track. The
 * first rows of each pass are requested before it starts (another 3-4 %). */
#define PREFETCH_TOKENS 8

static inline void prefetch_floats(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 1); /* 16 floats: one 64-byte line */
}

/* sink: NULL, or one more logit counted in the denominator only */
static void softmax_inplace(float *s, int64_t len, const float *sink) {
    float peak = s[0], total = 0.0f;
    for (int64_t t = 1; t < len; t++) peak = s[t] > peak ? s[t] : peak;
    if (sink != NULL) {
        peak = *sink > peak ? *sink : peak;
        total = exp_f32(*sink - peak);
    }
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < len; t++) {
        s[t] = exp_f32(s[t] - peak);
        total += s[t];
    }
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < len; t++) s[t] *= inv;
}

/* One sequence, query heads h0 .. h1 - 1: scores over its `len` tokens from `first`, softmax, then
 * the weighted sum of V. The loops go KV head by KV head and then over the query heads that share it, because
 * `h / group` per head and `t / block_size` per token were 64-bit divisions in the inner loops (~10 %
 * of the kernel with the cache warm). slots: scratch for the tokens' row offsets (token_row_offsets).
 * Always inlined, and called with head_dim a literal for the common head sizes: dot and axpy then
 * unroll into registers, with no tail loop. */
static inline __attribute__((always_inline)) void attend_heads(
    const float *qs, const float *k_cache, const float *v_cache, float *o, float *scores, int64_t *slots,
    const int64_t *table, int64_t first, int64_t len, int64_t num_kv_heads, int64_t group, int64_t h0, int64_t h1,
    const int64_t head_dim, int64_t block_size, float scale, float logit_softcap, const float *sinks) {
    const int64_t slot_stride = num_kv_heads * head_dim, kv0 = h0 / group, kv1 = (h1 - 1) / group + 1;
    const int64_t row_floats = (kv1 - kv0) * head_dim; /* of a token's row, the KV heads read here */
    k_cache += kv0 * head_dim;
    v_cache += kv0 * head_dim;
    token_row_offsets(table, first, first + len, block_size, slot_stride, slots);
    for (int64_t t = 0; t < len && t < PREFETCH_TOKENS; t++) prefetch_floats(k_cache + slots[t], row_floats);
    for (int64_t t = 0; t < len; t++) {
        const float *k = k_cache + slots[t];
        if (t + PREFETCH_TOKENS < len) prefetch_floats(k_cache + slots[t + PREFETCH_TOKENS], row_floats);
        for (int64_t kv = kv0, h = h0; kv < kv1; kv++)
            for (; h < h1 && h < (kv + 1) * group; h++)
                scores[h * len + t] = dot(qs + h * head_dim, k + (kv - kv0) * head_dim, head_dim) * scale;
    }
    for (int64_t t = 0; t < len && t < PREFETCH_TOKENS; t++) prefetch_floats(v_cache + slots[t], row_floats);
    if (logit_softcap > 0.0f) soft_cap(scores + h0 * len, (h1 - h0) * len, logit_softcap);
    for (int64_t h = h0; h < h1; h++) softmax_inplace(scores + h * len, len, sinks == NULL ? NULL : sinks + h);
    memset(o + h0 * head_dim, 0, sizeof(float) * (size_t)((h1 - h0) * head_dim));
    for (int64_t t = 0; t < len; t++) {
        const float *v = v_cache + slots[t];
        if (t + PREFETCH_TOKENS < len) prefetch_floats(v_cache + slots[t + PREFETCH_TOKENS], row_floats);
        for (int64_t kv = kv0, h = h0; kv < kv1; kv++)
            for (; h < h1 && h < (kv + 1) * group; h++)
                axpy(o + h * head_dim, scores[h * len + t], v + (kv - kv0) * head_dim, head_dim);
    }
}

/* One query per row. A row is a sequence's decode, or one row of a short chunk of a sequence (a
 * speculative verification): row i attends to the first kv_lens[i] tokens of its block table.
 * With fewer rows than threads each row's query heads are split between them (one sequence
 * decoding has every thread's share of its heads): a head's sums are the same whichever thread
 * runs it, so the results do not depend on the split.
 * With `rope` set, q/k/v have just left the qkv projection: every row's q and k heads are rotated in
 * place (rotate_heads) and its new K and V rows written to `new_slots[row]`, all before any row
 * attends, so a chunk's rows see the rows before them. That is three ctypes calls and their tensor
 * views a layer in one.
 * rope: [n, head_dim / 2, 2] (cos, sin), or NULL for attention alone over a cache the caller has
 * already written (q is then only read). */
int paged_decode_attention_f32(float *q, int64_t q_row_stride, const float *rope, const int64_t *new_slots,
                               float *k_cache, float *v_cache, float *out, const int64_t *block_tables,
                               const int64_t *kv_lens, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                               int64_t sliding_window, float logit_softcap, const float *sinks, int num_threads) {
    const int64_t group = num_heads / num_kv_heads, kv_floats = num_kv_heads * head_dim;
    const int64_t max_len = max_blocks * block_size;
    /* tasks a row: enough for every thread, whole heads each; a thread with no task is not woken */
    const int64_t wanted = n > 0 && n < num_threads ? (num_threads + n - 1) / n : 1;
    const int64_t parts = wanted < num_heads ? wanted : num_heads;
    if (n > 0 && n * parts < num_threads) num_threads = (int)(n * parts);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len)); /* [head][token] */
        int64_t *slots = malloc(sizeof(int64_t) * (size_t)max_len);
        failed = scores == NULL || slots == NULL;
        if (rope != NULL) {
#pragma omp for schedule(static)
            for (int64_t seq = 0; seq < n; seq++) {
                float *qs = q + seq * q_row_stride;
                const float *k = qs + num_heads * head_dim;
                rotate_heads(qs, rope + seq * head_dim, num_heads + num_kv_heads, head_dim);
                memcpy(k_cache + new_slots[seq] * kv_floats, k, sizeof(float) * (size_t)kv_floats);
                memcpy(v_cache + new_slots[seq] * kv_floats, k + kv_floats, sizeof(float) * (size_t)kv_floats);
            }
        } /* the loop's barrier: every new row is in the cache before any row attends */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n * parts; task++) {
            if (failed) continue;
            const int64_t seq = task / parts, part = task % parts;
            const int64_t h0 = part * num_heads / parts, h1 = (part + 1) * num_heads / parts;
            float *qs = q + seq * q_row_stride;
            float *o = out + seq * num_heads * head_dim;
            const int64_t *table = block_tables + seq * max_blocks;
            const int64_t first = sliding_window > 0 && kv_lens[seq] > sliding_window ? kv_lens[seq] - sliding_window : 0;
#define ATTEND(dim) \
    attend_heads(qs, k_cache, v_cache, o, scores, slots, table, first, kv_lens[seq] - first, num_kv_heads, group, h0, \
                 h1, dim, block_size, scale, logit_softcap, sinks)
            if (head_dim == 64)
                ATTEND(64);
            else if (head_dim == 128)
                ATTEND(128);
            else
                ATTEND(head_dim);
#undef ATTEND
        }
        free(scores);
        free(slots);
    }
    return failed;
}

/* Write each token's new K and V rows into its cache slot (index_copy_ cost ~90 us a layer for
 * 16 rows: more than the copy itself by two orders of magnitude). k and v: [n, num_kv_heads,
 * head_dim] with rows k_row_stride / v_row_stride floats apart; slots: [n]. */
void store_kv_f32(const float *k, int64_t k_row_stride, const float *v, int64_t v_row_stride,
                  const int64_t *slots, int64_t n, int64_t row_floats, float *k_cache, float *v_cache) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_cache + slots[i] * row_floats, k + i * k_row_stride, sizeof(float) * (size_t)row_floats);
        memcpy(v_cache + slots[i] * row_floats, v + i * v_row_stride, sizeof(float) * (size_t)row_floats);
    }
}
