/* Every entry point of the kernels, declared once. The kernels' own files include it (so the
 * compiler checks each definition against it), csrc/decode_layers.c chains them, the
 * AddressSanitizer harnesses in tests/ drive them, and Python builds its ctypes bindings by reading
 * this file (backends/cpu/kernels.py): its calls pass every argument by the name it has here, so
 * a parameter moved or renamed fails loudly instead of passing a wrong value. Keep each
 * declaration in the plain form that reader takes: no macros, no function pointers. */
#ifndef ROSEINFER_KERNELS_H
#define ROSEINFER_KERNELS_H

#include <stdint.h>

/* One part of a weight whose output rows are stored in several GGML types (a fused q/k/v whose v is
 * Q6_K and q, k Q4_K): the parts' rows follow one another in the output. A weight of weight_type
 * -count is `count` of these, back to back. */
typedef struct {
    const void *blocks;                    /* [rows, k] in GGUF blocks, rows back to back */
    int64_t type;                          /* its GGML type */
    int64_t rows;
} weight_part_t;

typedef struct {
    const float *input_norm, *post_norm;   /* [hidden] RMSNorm weights */
    const void *qkv;                       /* [q_size + 2 * kv_size, hidden] */
    const float *qkv_bias;                 /* or NULL */
    const void *o;                         /* [hidden, q_size] */
    const float *o_bias;                   /* or NULL */
    const void *gate_up, *down;            /* [2 * intermediate, hidden], [hidden, intermediate] */
    float *k_cache, *v_cache;              /* [slots, num_kv_heads, head_dim] */
    /* each weight's layout: 0 packed fp32 (64-row blocks), -count weight_part_t parts, else the GGML
     * type of its GGUF blocks */
    int64_t qkv_type, o_type, gate_up_type, down_type;
    int64_t sliding_window;                /* its attention's window, 0 for the whole context */
    float logit_softcap;                   /* its attention's soft-cap, 0 for none */
    int64_t no_rope;                       /* 1 for a NoPE layer (SmolLM3): q and k rotated by 1 + 0i */
} decode_layer_t;

void rms_norm_f32(const float *x, int64_t x_row_stride, float *residual, const float *weight, float *out,
                  int64_t n, int64_t dim, float eps, int num_threads);
void silu_mul_f32(const float *gate_up, float *out, int64_t n, int64_t width, int num_threads);
void rotary_f32(float *x, int64_t x_row_stride, const float *rope, int64_t n, int64_t heads, int64_t head_dim,
                int num_threads);
void argmax_rows_f32(const float *x, int64_t n, int64_t width, int64_t *out, int num_threads);
void store_kv_f32(const float *k, int64_t k_row_stride, const float *v, int64_t v_row_stride,
                  const int64_t *slots, int64_t n, int64_t row_floats, float *k_cache, float *v_cache);
int packed_matmul_steps_f32(const void *const *packed, const int64_t *types, const float *const *bias,
                            const int64_t *n, const int64_t *k, int64_t count, const float *x, int64_t x_stride,
                            float *out, int64_t m, int64_t steps, int num_threads);
void packed_matmul_f32(const float *x, int64_t x_stride, const float *packed, const float *bias, float *out,
                       int64_t m, int64_t n, int64_t k, int num_threads);
int weight_matmul_f32(const float *x, int64_t x_stride, const void *weight, int64_t weight_type, const float *bias,
                      float *out, int64_t m, int64_t n, int64_t k, int num_threads);
int rms_norm_packed_matmul_f32(const float *x, int64_t x_stride, float *residual, const float *norm_weight, float eps,
                               const void *packed, int64_t weight_type, const float *bias, float *out, int64_t m,
                               int64_t n, int64_t k, int num_threads);
int silu_mul_packed_matmul_f32(const float *gate_up, const void *packed, int64_t weight_type, const float *bias,
                               float *out, int64_t m, int64_t n, int64_t k, int num_threads);
int paged_decode_attention_f32(float *q, int64_t q_row_stride, const float *rope, const int64_t *new_slots,
                               float *k_cache, float *v_cache, float *out, const int64_t *block_tables,
                               const int64_t *kv_lens, int64_t n, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                               int64_t sliding_window, float logit_softcap, const float *sinks, int num_threads);
int paged_prefill_attention_f32(const float *q, int64_t q_row_stride, const float *k_cache, const float *v_cache,
                                float *out, const int64_t *block_tables, const int64_t *q_starts,
                                const int64_t *q_lens, const int64_t *kv_lens, int64_t n, int64_t num_heads,
                                int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                float scale, int64_t sliding_window, float logit_softcap, const float *sinks,
                                int num_threads);
int decode_layers_f32(const decode_layer_t *layers, int64_t num_layers, float *x, float *out, const float *rope,
                      const int64_t *new_slots, const int64_t *block_tables, const int64_t *kv_lens, int64_t n,
                      int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, float eps, float scale, int num_threads);
int quant_matmul_f32(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                     float *out, int64_t m, int64_t n, int64_t k, int num_threads);
int dequantize_rows_f32(const uint8_t *weight, int64_t type, const int64_t *ids, int64_t count, int64_t k, float *out,
                        int num_threads);
/* hybrid models' linear attention (gated_delta_rule.c) */
void gated_delta_decode_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                            float *states, const int64_t *slots, const float *keep, float *out, int64_t n,
                            int64_t heads, int64_t k_dim, int64_t v_dim, int num_threads);
void gated_delta_prefill_f32(const float *q, const float *k, const float *v, const float *g, const float *beta,
                             float *states, const int64_t *slots, const float *keep, const int64_t *lens, float *out,
                             int64_t n, int64_t length, int64_t heads, int64_t k_dim, int64_t v_dim,
                             int num_threads);
/* a mixture-of-experts layer's routed experts in GGUF blocks, in one call (moe_experts.c) */
int moe_experts_f32(const float *x, int64_t x_stride, const int64_t *experts, const float *weights, int64_t tokens,
                    int64_t top_k, const uint8_t *gate_up, int64_t gate_up_type, const uint8_t *down,
                    int64_t down_type, int64_t num_experts, int64_t hidden, int64_t width, float *out,
                    int num_threads);
/* the int8 path's GEMM (q8_gemm.c): a Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 or Q5_1 weight [n, k] in GGUF blocks
 * repacked into tiles of 16 rows, q8_repacked_bytes(type, n, k) bytes at out, for a weight type with INT8_ACTIVATIONS and
 * INT8_REPACKED (quants.h); returns nonzero for another type or a k not whole blocks */
int64_t q8_repacked_bytes(int64_t type, int64_t n, int64_t k);
int q8_repack(const uint8_t *weight, int64_t type, int64_t n, int64_t k, uint8_t *out, int num_threads);

#endif
