/* Every decoder layer of a Llama-style decode step in one call (fp32, CPU).
 *
 * Per layer the Python path makes five C calls (norm + q/k/v, attention, o_proj, norm + gate/up,
 * SiLU + down), and each matmul streams megabytes of weights through the caches between them: a
 * Python call that takes ~1 us in a loop took ~6.5 us after an 8 MB sweep, and the Python around
 * the calls was ~2.6 ms of a 34 ms batch-16 step. Here the same five functions run back to back
 * from C, in the same order on the same buffers, so the results are bit for bit the Python path's.
 *
 * x:        [n, hidden] the embeddings, contiguous; it becomes the residual stream (updated in place,
 *           as the first layer's fused add does in Python)
 * out:      [n, hidden] the last layer's MLP output (the final norm adds it into x)
 * rope, new_slots, block_tables, kv_lens: as paged_decode_attention_f32 takes them, one row per
 *           sequence. Every row decodes. A NoPE layer rotates by 1 + 0i instead, as the Python path
 *           hands it (models/llama.py), so its q and k keep their bits.
 * Each weight is packed fp32, GGUF blocks or parts of several GGUF types (decode_layer_t's types), so a
 * model whose weights are kept quantized runs here too.
 * Returns 0, or 1 where a buffer could not be allocated or a weight type is not handled (out is then
 * incomplete). */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"

int decode_layers_f32(const decode_layer_t *layers, int64_t num_layers, float *x, float *out, const float *rope,
                      const int64_t *new_slots, const int64_t *block_tables, const int64_t *kv_lens, int64_t n,
                      int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, int64_t max_blocks, float eps, float scale, int num_threads) {
    const int64_t q_size = num_heads * head_dim, qkv_size = q_size + 2 * num_kv_heads * head_dim;
    float *qkv = malloc(sizeof(float) * (size_t)(n * qkv_size));
    float *attn = malloc(sizeof(float) * (size_t)(n * q_size));
    float *attn_out = malloc(sizeof(float) * (size_t)(n * hidden));
    float *gate_up = malloc(sizeof(float) * (size_t)(n * 2 * intermediate));
    int any_nope = 0;
    for (int64_t l = 0; l < num_layers; l++) any_nope |= layers[l].no_rope != 0;
    /* (cos, sin) = (1, 0) for every pair of every row: what a NoPE layer is rotated by */
    float *unrotated = any_nope ? malloc(sizeof(float) * (size_t)(n * head_dim)) : NULL;
    for (int64_t i = 0; unrotated != NULL && i < n * head_dim; i++) unrotated[i] = i % 2 == 0 ? 1.0f : 0.0f;
    int failed = qkv == NULL || attn == NULL || attn_out == NULL || gate_up == NULL || (any_nope && unrotated == NULL);
    for (int64_t l = 0; l < num_layers && !failed; l++) {
        const decode_layer_t *layer = &layers[l];
        /* the first layer normalises the embeddings, which then are the stream; later ones add the
         * previous MLP output into it first */
        failed |= rms_norm_packed_matmul_f32(l == 0 ? x : out, hidden, l == 0 ? NULL : x, layer->input_norm, eps,
                                             layer->qkv, layer->qkv_type, layer->qkv_bias, qkv, n, qkv_size, hidden,
                                             num_threads);
        failed |= paged_decode_attention_f32(qkv, qkv_size, layer->no_rope ? unrotated : rope, new_slots,
                                             layer->k_cache, layer->v_cache, attn,
                                             block_tables, kv_lens, n, num_heads, num_kv_heads, head_dim, block_size,
                                             max_blocks, scale, layer->sliding_window, layer->logit_softcap, NULL,
                                             num_threads);
        failed |= weight_matmul_f32(attn, q_size, layer->o, layer->o_type, layer->o_bias, attn_out, n, hidden, q_size,
                                    num_threads);
        failed |= rms_norm_packed_matmul_f32(attn_out, hidden, x, layer->post_norm, eps, layer->gate_up,
                                             layer->gate_up_type, NULL, gate_up, n, 2 * intermediate, hidden,
                                             num_threads);
        failed |= silu_mul_packed_matmul_f32(gate_up, layer->down, layer->down_type, NULL, out, n, hidden,
                                             intermediate, num_threads);
    }
    free(qkv);
    free(attn);
    free(attn_out);
    free(gate_up);
    free(unrotated);
    return failed != 0;
}
