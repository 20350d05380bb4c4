/* Runs the attention kernels (csrc/prefill_attention.c, csrc/paged_attention.c) on assorted shapes for
 * tests/test_asan_kernels.py, built with AddressSanitizer: any read or write outside the buffers
 * aborts with a report. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels.h"

/* per query head (up to 16): the sinks the windowed runs read, so a sink past H would show */
static const float sinks[16] = {0.5f, -1.0f, 2.0f, 0.0f, 1.5f, -0.5f, 3.0f, -2.0f,
                                0.25f, 1.0f, -3.0f, 0.75f, 2.5f, -1.5f, 0.1f, -0.1f};

/* window > 0: a sliding window, with a soft-cap and sinks too */
static void run(int64_t H, int64_t Hkv, int64_t D, int64_t qlen, int64_t ctx, int64_t window) {
    int64_t bs = 4, kv = ctx + qlen, nb = (kv + bs - 1) / bs;
    float *q = malloc(sizeof(float) * qlen * H * D), *out = malloc(sizeof(float) * qlen * H * D);
    float *k = malloc(sizeof(float) * nb * bs * Hkv * D), *v = malloc(sizeof(float) * nb * bs * Hkv * D);
    int64_t *table = malloc(sizeof(int64_t) * nb);
    for (int64_t i = 0; i < qlen * H * D; i++) q[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int64_t i = 0; i < nb * bs * Hkv * D; i++) k[i] = (float)rand() / RAND_MAX - 0.5f, v[i] = (float)rand() / RAND_MAX;
    for (int64_t i = 0; i < nb; i++) table[i] = nb - 1 - i;
    int64_t start = 0;
    int r = paged_prefill_attention_f32(q, H * D, k, v, out, table, &start, &qlen, &kv, 1, H, Hkv, D, bs, nb, 0.1f, window,
                                        window ? 30.0f : 0.0f, window ? sinks : NULL, 2);
    if (r != 0) {
        printf("H=%ld Hkv=%ld D=%ld: kernel returned %d\n", (long)H, (long)Hkv, (long)D, r);
        exit(1);
    }
    free(q); free(out); free(k); free(v); free(table);
}
/* Two sequences decoding one token each (rotary and the K/V write fused in), at context kv and kv / 2 + 1. */
static void run_decode(int64_t H, int64_t Hkv, int64_t D, int64_t kv, int64_t window) {
    int64_t bs = 4, nb = (kv + bs - 1) / bs, row = (H + 2 * Hkv) * D;
    int64_t lens[2] = {kv, kv / 2 + 1}, tables[2 * 64], slots[2];
    float *qkv = malloc(sizeof(float) * 2 * row), *out = malloc(sizeof(float) * 2 * H * D);
    float *rope = malloc(sizeof(float) * 2 * D);
    float *k = malloc(sizeof(float) * 2 * nb * bs * Hkv * D), *v = malloc(sizeof(float) * 2 * nb * bs * Hkv * D);
    for (int64_t i = 0; i < 2 * row; i++) qkv[i] = (float)rand() / RAND_MAX - 0.5f;
    for (int64_t i = 0; i < 2 * D; i++) rope[i] = (float)rand() / RAND_MAX;
    for (int64_t i = 0; i < 2 * nb * bs * Hkv * D; i++) k[i] = (float)rand() / RAND_MAX, v[i] = (float)rand() / RAND_MAX;
    for (int64_t i = 0; i < 2 * nb; i++) tables[i] = 2 * nb - 1 - i;
    for (int s = 0; s < 2; s++) slots[s] = tables[s * nb + (lens[s] - 1) / bs] * bs + (lens[s] - 1) % bs;
    int r = paged_decode_attention_f32(qkv, row, rope, slots, k, v, out, tables, lens, 2, H, Hkv, D, bs, nb, 0.1f, window,
                                       window ? 30.0f : 0.0f, window ? sinks : NULL, 2);
    if (r != 0) {
        printf("decode H=%ld Hkv=%ld D=%ld: kernel returned %d\n", (long)H, (long)Hkv, (long)D, r);
        exit(1);
    }
    free(qkv); free(out); free(rope); free(k); free(v);
}

int main(void) {
    /* tiles of exactly 64 lanes (MHA, group 4) and ragged ones, head dims 128, 64, 96 and 32 */
    run(4, 4, 128, 64, 0, 0);
    run(8, 2, 128, 33, 7, 0);
    run(9, 3, 64, 70, 5, 0);
    run(8, 8, 64, 64, 0, 0);
    run(6, 2, 96, 21, 3, 0);
    run(8, 1, 32, 9, 0, 0);
    run(4, 4, 128, 61, 3, 0);
    /* sliding windows shorter than the chunk, than the context before it, and wider than both */
    run(8, 2, 64, 40, 13, 5);
    run(4, 4, 128, 9, 30, 8);
    run(8, 2, 64, 20, 3, 100);
    /* decode: head dims on the unrolled paths and one with a scalar tail; windows */
    run_decode(9, 3, 64, 37, 0);
    run_decode(8, 2, 128, 64, 0);
    run_decode(4, 4, 40, 5, 0);
    run_decode(9, 3, 64, 37, 6);
    run_decode(4, 4, 40, 5, 7);
    puts("ok");
    return 0;
}
