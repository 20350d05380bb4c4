/* The int8 path's GEMM for Q4_K, Q5_K and Q6_K weights (and, through csrc/q8_gemm_blocks32.c, Q8_0,
 * Q5_0 and Q5_1) repacked at load (--cpu-activations int8): a tile
 * of GEMM_ROWS = 16 weight rows is interleaved so that one 64-byte vector holds 4 consecutive
 * weights of each of its 16 rows (a 32-bit lane a row), and one integer dot product (vpdpbusd on
 * AVX-512 VNNI; vpmaddubsw, with 16-bit sums on AVX2: q8_gemm_lanes.h) multiplies it by 4 values of
 * one row of x broadcast to every lane: a weight load feeds up to K_GEMM_COLS rows of x (GEMM_COLS
 * for the 32-weight blocks), and the 16 outputs of a tile stay in
 * the lanes, never reduced across them. A sub-block's integer dot is multiplied by the 16 rows'
 * scales once; the rows of x are quantized to Q8_K as the unpacked path quantizes them.
 *
 * Repacked record of a tile's block b (the tile's records back to back, block after block; rows past
 * n are zeros):
 *   Q4_K (2368 B): fp16 d[16], dmin[16]; u8 scales[8 sub-blocks][16 rows]; u8 mins[4 pairs][16 rows][2]
 *                  (sub-blocks 2p, 2p + 1); qs[8][4][64]: byte 4r + i of qs[s][t] holds row r's value
 *                  32s + 4t + i in its low nibble and value 32s + 16 + 4t + i in its high one.
 *   Q5_K (2880 B): Q4_K's record, then high[8][64]: bits 2t and 2t + 1 of byte 4r + i of high[s] are
 *                  the fifth bits of the values in the low and high nibble of byte 4r + i of qs[s][t].
 *   Q6_K (3360 B, as many as the blocks): fp16 d[16]; i8 scales[16 sub-blocks of 16][16 rows];
 *                  low[16][2][64]: byte 4r + i of low[s][h] holds the low 4 bits of row r's values
 *                  16s + 8h + i (low nibble) and 16s + 8h + 4 + i (high nibble); high[16][64]: bits
 *                  2t, 2t + 1 of byte 4r + i of high[s] are the top 2 bits of row r's value 16s + 4t + i.
 * Output (row j, row i of x), in this order, the one every ISA build and the test's reference keep:
 *   acc = 0; for each block b:  I = sum over sub-blocks of scale * (integer dot of q and x's q),
 *     Q4_K, Q5_K: acc = fma((float)I, d * dx, acc); acc = fma((float)M, -(dmin * dx), acc), M = sum
 *           of min * (sum of x's q over the sub-block);
 *     Q6_K: I with q - 32 (the -32 from x's 16-value sums), acc = fma((float)I, d * dx, acc);
 *   out = acc + bias. Every integer sum is exact in 32 bits. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "q8_activations.h"
#include "q8_gemm_lanes.h"
#include "quants.h"

#define Q4_K_RECORD 2368
#define Q5_K_RECORD 2880
#define Q6_K_RECORD 3360

static inline int repacked_type(int64_t type) {
    return type == Q4_K || type == Q5_K || type == Q6_K || type == Q8_0 || type == Q5_0 || type == Q5_1;
}

static inline int64_t record_bytes(int64_t type) {
    return type == Q4_K   ? Q4_K_RECORD
           : type == Q5_K ? Q5_K_RECORD
           : type == Q6_K ? Q6_K_RECORD
                          : blocks32_record_bytes(type);
}

int64_t q8_repacked_bytes(int64_t type, int64_t n, int64_t k) {
    return (n + GEMM_ROWS - 1) / GEMM_ROWS * (k / quant_block_weights(type)) * record_bytes(type);
}

/* One tile-block record from the Q4_K or Q5_K blocks of rows[0..count) (count <= 16; the rest stay
 * zero): a Q5_K block is a Q4_K one with qh[32] (bit s of qh[l]: value l of sub-block s's fifth bit)
 * before its nibbles. */
static void repack_q4_k(int64_t type, const uint8_t *const *rows, int count, uint8_t *out) {
    const int nibbles = type == Q5_K ? 48 : 16;
    for (int r = 0; r < count; r++) {
        const uint8_t *blk = rows[r];
        uint8_t sm[16];
        q4_k_unpack_scales(blk + 4, sm);
        memcpy(out + 2 * r, blk, 2);
        memcpy(out + 32 + 2 * r, blk + 2, 2);
        for (int s = 0; s < 8; s++) {
            out[64 + 16 * s + r] = sm[s];
            out[192 + 32 * (s / 2) + 2 * r + s % 2] = sm[8 + s];
        }
        for (int s = 0; s < 8; s++)
            for (int t = 0; t < 4; t++)
                for (int i = 0; i < 4; i++) {
                    /* value l of sub-block s: byte 32 (s / 2) + l, the high nibble for odd s */
                    const uint8_t *q = blk + nibbles + 32 * (s / 2);
                    const int low = (q[4 * t + i] >> (4 * (s & 1))) & 15, high = (q[16 + 4 * t + i] >> (4 * (s & 1))) & 15;
                    out[320 + 256 * s + 64 * t + 4 * r + i] = (uint8_t)(low | high << 4);
                    if (type == Q5_K)
                        out[Q4_K_RECORD + 64 * s + 4 * r + i] |= (uint8_t)((blk[16 + 4 * t + i] >> s & 1) << (2 * t)
                                                                           | (blk[32 + 4 * t + i] >> s & 1) << (2 * t + 1));
                }
    }
}

static void repack_q6_k(const uint8_t *const *rows, int count, uint8_t *out) {
    for (int r = 0; r < count; r++) {
        const uint8_t *blk = rows[r];
        memcpy(out + 2 * r, blk + 208, 2);
        for (int s = 0; s < 16; s++) out[32 + 16 * s + r] = blk[192 + s];
        for (int v = 0; v < 256; v++) {
            /* value v: half h = v / 128, chunk t of 32 in it; quants.h's Q6_K layout */
            const int h = v / 128, t = (v % 128) / 32, l = v % 32;
            const int q = ((blk[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15)
                          | ((blk[128 + 32 * h + l] >> (2 * t)) & 3) << 4;
            const int s = v / 16, group = (v % 16) / 4, byte = 4 * r + v % 4;
            out[288 + 128 * s + 64 * (group / 2) + byte] |= (uint8_t)((q & 15) << (4 * (group & 1)));
            out[2336 + 64 * s + byte] |= (uint8_t)((q >> 4) << (2 * group));
        }
    }
}

int q8_repack(const uint8_t *weight, int64_t type, int64_t n, int64_t k, uint8_t *out, int num_threads) {
    if (!repacked_type(type) || !quant_shape_ok(type, k)) return 1;
    const int64_t blocks = k / quant_block_weights(type), row_bytes = quant_row_bytes(type, k), record = record_bytes(type);
    const int64_t tiles = (n + GEMM_ROWS - 1) / GEMM_ROWS;
    memset(out, 0, (size_t)q8_repacked_bytes(type, n, k));
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int count = n - t * GEMM_ROWS < GEMM_ROWS ? (int)(n - t * GEMM_ROWS) : GEMM_ROWS;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *rows[GEMM_ROWS];
            for (int r = 0; r < count; r++) rows[r] = weight + (t * GEMM_ROWS + r) * row_bytes + b * quant_block_bytes(type);
            uint8_t *dst = out + (t * blocks + b) * record;
            if (type == Q4_K || type == Q5_K)
                repack_q4_k(type, rows, count, dst);
            else if (type == Q6_K)
                repack_q6_k(rows, count, dst);
            else
                repack_blocks32(type, rows, count, dst);
        }
    }
    return 0;
}

/* x's integer sums a kernel reads besides its q's, 16 a block: Q4_K, Q5_K: 4 pairs of 16-bit sums over
 * sub-blocks (2p, 2p + 1) of 32; Q6_K: -32 times each 16-value sum, as six_bit_offset packs it */
static void block_sums(int64_t type, const block_q8_k *x, int32_t *sums) {
    for (int s = 0; s < 16; s++) sums[s] = 0;
    if (type == Q6_K) {
        for (int s = 0; s < 16; s++) sums[s] = six_bit_offset(x->bsums[s]);
        return;
    }
    for (int p = 0; p < 4; p++) {
        const int first = x->bsums[4 * p] + x->bsums[4 * p + 1], second = x->bsums[4 * p + 2] + x->bsums[4 * p + 3];
        sums[p] = (int32_t)((uint32_t)(uint16_t)first | (uint32_t)(uint16_t)second << 16);
    }
}

void q8_gemm_quantize_row(const float *x, int64_t type, int64_t k, block_q8_k *out, int32_t *sums) {
    quantize_row_q8_k(x, k, out);
    for (int64_t b = 0; b < k / 256; b++) block_sums(type, out + b, sums + b * 16);
}

unsigned q8_rows_forms(int64_t type) {
    return type == Q4_K || type == Q5_K ? Q8_ROWS_Q4_K : type == Q6_K ? Q8_ROWS_Q6_K : Q8_ROWS_32;
}

/* rows' buffer from address `at` on: Q8_K blocks (where a K-quant reads them), Q4_K's sums, Q6_K's
 * sums, Q8_0 blocks, each where its form is wanted; returns the address past it */
static uintptr_t lay_out(uintptr_t at, unsigned forms, int64_t m, int64_t k, q8_rows_t *rows) {
    const size_t k_blocks = (size_t)(m * (k / 256));
    *rows = (q8_rows_t){.forms = forms, .k = k};
    rows->k_rows = (block_q8_k *)at;
    at += forms & (Q8_ROWS_Q4_K | Q8_ROWS_Q6_K) ? k_blocks * sizeof(block_q8_k) : 0;
    rows->sums[0] = (int32_t *)at;
    at += forms & Q8_ROWS_Q4_K ? k_blocks * 16 * sizeof(int32_t) : 0;
    rows->sums[1] = (int32_t *)at;
    at += forms & Q8_ROWS_Q6_K ? k_blocks * 16 * sizeof(int32_t) : 0;
    rows->rows32 = (block_q8_0 *)at;
    return at + (forms & Q8_ROWS_32 ? (size_t)(m * (k / 32)) * sizeof(block_q8_0) : 0);
}

size_t q8_rows_bytes(unsigned forms, int64_t m, int64_t k) {
    q8_rows_t rows;
    return (size_t)lay_out(0, forms, m, k, &rows);
}

q8_rows_t q8_rows_at(void *buffer, unsigned forms, int64_t m, int64_t k) {
    q8_rows_t rows;
    lay_out((uintptr_t)buffer, forms, m, k, &rows);
    return rows;
}

void q8_rows_quantize(const q8_rows_t *rows, const float *x, int64_t i) {
    const int64_t k = rows->k, blocks = k / 256;
    if (rows->forms & (Q8_ROWS_Q4_K | Q8_ROWS_Q6_K)) {
        block_q8_k *q = rows->k_rows + i * blocks;
        quantize_row_q8_k(x, k, q);
        for (int64_t b = 0; b < blocks; b++) {
            if (rows->forms & Q8_ROWS_Q4_K) block_sums(Q4_K, q + b, rows->sums[0] + (i * blocks + b) * 16);
            if (rows->forms & Q8_ROWS_Q6_K) block_sums(Q6_K, q + b, rows->sums[1] + (i * blocks + b) * 16);
        }
    }
    if (rows->forms & Q8_ROWS_32) quantize_row_q8_0(x, k, rows->rows32 + i * (k / 32));
}

/* Sub-block s of `parts` prefetches its share of the record 16 ahead, into L2: one or two rows of x
 * read the tiles faster than the hardware prefetcher brings them, and prefetches into L2 keep more
 * lines in flight than into L1 (docs/profiling.md section 18); more rows are bound by their arithmetic */
static inline void prefetch_ahead(const uint8_t *rec, int64_t record, int s, int parts) {
    const uint8_t *ahead = rec + 16 * record + s * record / parts;
    for (int64_t line = 0; line < record / parts + 64; line += 64) __builtin_prefetch(ahead + line, 0, 2);
}

/* row r's 4 bytes of `nibbles` (a weight vector's nibbles) with their fifth bits from `high`, which
 * holds them at bit `bit` of each byte */
static inline __attribute__((always_inline)) lanes_i with_fifth_bit(lanes_i nibbles, lanes_i high, const int bit) {
    return or_i(nibbles, bit4(bit <= 4 ? shift_left(high, 4 - bit) : shift_right(high, bit - 4)));
}

/* acc[c] for rows of x c < cols: a tile's 16 outputs, every block; five_bits: Q5_K's tiles (the
 * nibbles' fifth bits or-ed in), else Q4_K's */
static inline __attribute__((always_inline)) void nibbles_tile(const uint8_t *tile, const block_q8_k *x,
                                                              const int32_t *sums, int64_t blocks, const int cols,
                                                              lanes_f *acc, const int five_bits) {
    const int64_t record = five_bits ? Q5_K_RECORD : Q4_K_RECORD;
    for (int c = 0; c < cols; c++) acc[c] = zeros_f();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = tile + b * record;
        lanes_i isum[K_GEMM_COLS], msum[K_GEMM_COLS];
        for (int c = 0; c < cols; c++) isum[c] = zeros_i(), msum[c] = zeros_i();
        for (int s = 0; s < 8; s++) {
            /* the low and high nibbles' dots in two chains a row of x, or one (ONE_DOT_CHAIN) */
            lanes_s dot_low[K_GEMM_COLS], dot_high[K_GEMM_COLS];
            for (int c = 0; c < cols; c++) dot_low[c] = zeros_s(), dot_high[c] = zeros_s();
            const lanes_i high_bits = five_bits ? load_bytes(rec + Q4_K_RECORD + 64 * s) : zeros_i();
            /* unrolled, so that Q5_K's shifts take constant counts */
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const lanes_i q = load_bytes(rec + 320 + 256 * s + 64 * t);
                lanes_i low = low_nibbles(q), high = high_nibbles(q);
                if (five_bits) low = with_fifth_bit(low, high_bits, 2 * t), high = with_fifth_bit(high, high_bits, 2 * t + 1);
                for (int c = 0; c < cols; c++) {
                    const int8_t *xq = x[c * blocks + b].qs + 32 * s + 4 * t;
                    dot_low[c] = dot4_s(dot_low[c], low, xq);
                    if (ONE_DOT_CHAIN)
                        dot_low[c] = dot4_s(dot_low[c], high, xq + 16);
                    else
                        dot_high[c] = dot4_s(dot_high[c], high, xq + 16);
                }
                /* 16-bit sums hold 8 dot4s of 4-bit weights (the sub-block), FIVE_BIT_DOTS of 5-bit ones */
                if (five_bits && FIVE_BIT_DOTS < 8 && t == 1) {
                    const lanes_i scale = scales_u8(rec + 64 + 16 * s);
                    for (int c = 0; c < cols; c++) {
                        isum[c] = add_scaled(isum[c], ONE_DOT_CHAIN ? dot_low[c] : add_s(dot_low[c], dot_high[c]), scale);
                        dot_low[c] = zeros_s(), dot_high[c] = zeros_s();
                    }
                }
            }
            const lanes_i scale = scales_u8(rec + 64 + 16 * s);
            if (cols <= 2) prefetch_ahead(rec, record, s, 8);
            for (int c = 0; c < cols; c++)
                isum[c] = add_scaled(isum[c], ONE_DOT_CHAIN ? dot_low[c] : add_s(dot_low[c], dot_high[c]), scale);
        }
        for (int p = 0; p < 4; p++) {
            const lanes_i mins = widen_pairs(rec + 192 + 32 * p);
            for (int c = 0; c < cols; c++) msum[c] = dot2(msum[c], mins, sums[(c * blocks + b) * 16 + p]);
        }
        const lanes_f d = halves(rec), dmin = halves(rec + 32);
        for (int c = 0; c < cols; c++) {
            const float dx = x[c * blocks + b].d;
            acc[c] = fma_lanes(isum[c], times(d, dx), acc[c]);
            acc[c] = fma_lanes(msum[c], times(dmin, -dx), acc[c]);
        }
    }
}

static inline __attribute__((always_inline)) void q4_k_tile(const uint8_t *tile, const block_q8_k *x,
                                                           const int32_t *sums, int64_t blocks, const int cols,
                                                           lanes_f *acc) {
    nibbles_tile(tile, x, sums, blocks, cols, acc, 0);
}

static inline __attribute__((always_inline)) void q5_k_tile(const uint8_t *tile, const block_q8_k *x,
                                                           const int32_t *sums, int64_t blocks, const int cols,
                                                           lanes_f *acc) {
    nibbles_tile(tile, x, sums, blocks, cols, acc, 1);
}

static inline __attribute__((always_inline)) void q6_k_tile(const uint8_t *tile, const block_q8_k *x,
                                                           const int32_t *sums, int64_t blocks, const int cols,
                                                           lanes_f *acc) {
    for (int c = 0; c < cols; c++) acc[c] = zeros_f();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = tile + b * Q6_K_RECORD;
        lanes_i isum[K_GEMM_COLS];
        for (int c = 0; c < cols; c++) isum[c] = zeros_i();
        for (int s = 0; s < 16; s++) {
            /* two chains a row of x, or one (ONE_DOT_CHAIN); where a lanes_s holds the whole sub-block
             * the -32 offset starts one */
            lanes_s dot_even[K_GEMM_COLS], dot_odd[K_GEMM_COLS];
            for (int c = 0; c < cols; c++)
                dot_even[c] = SIX_BIT_DOTS >= 4 ? broadcast_i(sums[(c * blocks + b) * 16 + s]) : zeros_s(), dot_odd[c] = zeros_s();
            const lanes_i high = load_bytes(rec + 2336 + 64 * s), scale = scales_i8(rec + 32 + 16 * s);
            if (cols <= 2) prefetch_ahead(rec, Q6_K_RECORD, s, 16);
            for (int h = 0; h < 2; h++) {
                const lanes_i low = load_bytes(rec + 288 + 128 * s + 64 * h);
                /* values 8h + 0..3 and 8h + 4..7 of the sub-block: their top bits at 4h and 4h + 2 */
                const lanes_i even = six_bits(low, h == 0 ? shift_left(high, 4) : high);
                const lanes_i odd = six_bits(shift_right(low, 4), h == 0 ? shift_left(high, 2) : shift_right(high, 2));
                for (int c = 0; c < cols; c++) {
                    const int8_t *xq = x[c * blocks + b].qs + 16 * s + 8 * h;
                    dot_even[c] = dot4_s(dot_even[c], even, xq);
                    if (ONE_DOT_CHAIN)
                        dot_even[c] = dot4_s(dot_even[c], odd, xq + 4);
                    else
                        dot_odd[c] = dot4_s(dot_odd[c], odd, xq + 4);
                }
                if (h == 1 || SIX_BIT_DOTS < 4)
                    for (int c = 0; c < cols; c++) {
                        isum[c] = add_scaled(isum[c], ONE_DOT_CHAIN ? dot_even[c] : add_s(dot_even[c], dot_odd[c]), scale);
                        dot_even[c] = zeros_s(), dot_odd[c] = zeros_s();
                    }
            }
            if (SIX_BIT_DOTS < 4) /* the offset in add_scaled's form (six_bit_offset) */
                for (int c = 0; c < cols; c++) isum[c] = add_scaled(isum[c], broadcast_i(sums[(c * blocks + b) * 16 + s]), scale);
        }
        const lanes_f d = halves(rec);
        for (int c = 0; c < cols; c++) acc[c] = fma_lanes(isum[c], times(d, x[c * blocks + b].d), acc[c]);
    }
}

/* constant column counts, so the accumulators stay in registers */
static void tile_times_rows(int64_t type, const uint8_t *tile, const block_q8_k *x, const int32_t *sums,
                            int64_t blocks, int cols, lanes_f *acc) {
#define TILE_COLS(kernel)                                                   \
    switch (cols) {                                                         \
    case 1: kernel(tile, x, sums, blocks, 1, acc); break;                   \
    case 2: kernel(tile, x, sums, blocks, 2, acc); break;                   \
    case 3: kernel(tile, x, sums, blocks, K_GEMM_COLS > 3 ? 3 : K_GEMM_COLS, acc); break; /* 4 cols only */ \
    default: kernel(tile, x, sums, blocks, K_GEMM_COLS, acc); break;        \
    }
    if (type == Q4_K) {
        TILE_COLS(q4_k_tile)
    } else if (type == Q5_K) {
        TILE_COLS(q5_k_tile)
    } else {
        TILE_COLS(q6_k_tile)
    }
#undef TILE_COLS
}

/* a tile's outputs for `cols` rows of x (out: the first of them), bias added; rows past n dropped */
static inline void store_tile(const lanes_f *acc, int cols, const float *bias, float *out, int64_t out_stride,
                              int64_t first, int64_t n) {
    const int64_t count = n - first < GEMM_ROWS ? n - first : GEMM_ROWS;
    for (int c = 0; c < cols; c++) {
        float lanes[GEMM_ROWS];
        store_f(lanes, acc[c]);
        float *row = out + c * out_stride + first;
        for (int64_t r = 0; r < count; r++) row[r] = lanes[r] + (bias != NULL ? bias[first + r] : 0.0f);
    }
}

/* the tile of weight rows from `first` on 32-block weights (csrc/q8_gemm_blocks32.c), every row of x */
static void blocks32_quantized_rows(const block_q8_0 *x, const uint8_t *packed, int64_t type, const float *bias,
                                    float *out, int64_t out_stride, int64_t m, int64_t first, int64_t n,
                                    int64_t blocks) {
    const uint8_t *tile = packed + first / GEMM_ROWS * blocks * record_bytes(type);
    for (int64_t g = 0; g < m; g += GEMM_COLS) {
        const int cols = m - g < GEMM_COLS ? (int)(m - g) : GEMM_COLS;
        lanes_f acc[GEMM_COLS];
        blocks32_tile_times_rows(type, tile, x + g * blocks, blocks, cols, acc);
        store_tile(acc, cols, bias, out + g * out_stride, out_stride, first, n);
    }
}

void q8_gemm_part_tasks(const q8_rows_t *rows, const uint8_t *packed, int64_t type, const float *bias, float *out,
                        int64_t out_stride, int64_t m, int64_t n) {
    const int64_t k = rows->k, tiles = (n + GEMM_ROWS - 1) / GEMM_ROWS;
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; t++) {
        if (q8_k_activations(type))
            q8_gemm_quantized_rows(rows->k_rows, rows->sums[type == Q6_K], packed, type, bias, out, out_stride, m,
                                   t * GEMM_ROWS, GEMM_ROWS, n, k);
        else
            blocks32_quantized_rows(rows->rows32, packed, type, bias, out, out_stride, m, t * GEMM_ROWS, n, k / 32);
    }
}

void q8_gemm_tasks(const float *x, int64_t x_stride, const uint8_t *packed, int64_t type, const float *bias,
                   float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k) {
    const unsigned forms = q8_rows_forms(type);
    void *buffer = NULL;
#pragma omp single copyprivate(buffer)
    buffer = malloc(q8_rows_bytes(forms, m, k));
    if (buffer == NULL) { /* NaN outputs rather than silently wrong ones */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < n; j++) out[i * out_stride + j] = NAN;
        return;
    }
    const q8_rows_t rows = q8_rows_at(buffer, forms, m, k);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < m; i++) q8_rows_quantize(&rows, x + i * x_stride, i);
    q8_gemm_part_tasks(&rows, packed, type, bias, out, out_stride, m, n);
#pragma omp barrier
#pragma omp single
    free(buffer);
}

void q8_gemm_quantized_rows(const block_q8_k *x, const int32_t *sums, const uint8_t *packed, int64_t type,
                            const float *bias, float *out, int64_t out_stride, int64_t m, int64_t first_row,
                            int64_t rows, int64_t n, int64_t k) {
    const int64_t blocks = k / 256, end = first_row + rows < n ? first_row + rows : n;
    for (int64_t first = first_row; first < end; first += GEMM_ROWS) {
        const uint8_t *tile = packed + first / GEMM_ROWS * blocks * record_bytes(type);
        for (int64_t g = 0; g < m; g += K_GEMM_COLS) {
            const int cols = m - g < K_GEMM_COLS ? (int)(m - g) : K_GEMM_COLS;
            lanes_f acc[K_GEMM_COLS];
            tile_times_rows(type, tile, x + g * blocks, sums + g * blocks * 16, blocks, cols, acc);
            store_tile(acc, cols, bias, out + g * out_stride, out_stride, first, n);
        }
    }
}
