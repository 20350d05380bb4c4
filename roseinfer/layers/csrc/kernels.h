/* The kernels' entry points that other C code calls: csrc/decode_layers.c chains them, and the
 * AddressSanitizer harnesses in tests/ drive them. Python binds the same functions with ctypes
 * (layers/native.py), whose DecodeLayer mirrors decode_layer_t. */
#ifndef ROSEINFER_KERNELS_H
#define ROSEINFER_KERNELS_H

#include <stdint.h>

typedef struct {
    const float *input_norm, *post_norm;   /* [hidden] RMSNorm weights */
    const float *qkv, *qkv_bias;           /* packed [q_size + 2 * kv_size, hidden]; bias or NULL */
    const float *o, *o_bias;               /* packed [hidden, q_size]; bias or NULL */
    const float *gate_up, *down;           /* packed [2 * intermediate, hidden], [hidden, intermediate] */
    float *k_cache, *v_cache;              /* [slots, num_kv_heads, head_dim] */
} decode_layer_t;

void packed_matmul_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                       int64_t m, int64_t n, int64_t k, int num_threads);
int rms_norm_packed_matmul_f32(const float *x, int64_t x_stride, float *residual, const float *norm_weight, float eps,
                               const float *packed, const float *bias, float *out, int64_t m, int64_t n, int64_t k,
                               int num_threads);
int silu_mul_packed_matmul_f32(const float *gate_up, const float *packed, const float *bias, float *out, int64_t m,
                               int64_t n, int64_t k, int num_threads);
int paged_decode_attention_f32(float *q, int64_t q_row_stride, const float *rope, const int64_t *new_slots,
                               float *k_cache, float *v_cache, float *out, const int64_t *block_tables,
                               const int64_t *kv_lens, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                               int num_threads);
int paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                                float *out, const int64_t *block_tables, const int64_t *q_starts,
                                const int64_t *q_lens, const int64_t *kv_lens, int64_t n, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                float scale, int num_threads);
int decode_layers_f32(const decode_layer_t *layers, int64_t num_layers, float *x, float *out, const float *rope,
                      const int64_t *new_slots, const int64_t *block_tables, const int64_t *kv_lens, int64_t n,
                      int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, float eps, float scale, int num_threads);

#endif
