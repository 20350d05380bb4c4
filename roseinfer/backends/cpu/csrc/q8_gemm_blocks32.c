/* The int8 path's repacked GEMM (csrc/q8_gemm.c) for the 32-weight blocks Q8_0, Q5_0 and Q5_1, on
 * rows of x quantized to Q8_0 (32 values, d and the sum S of their q's): the same tiles of 16 weight
 * rows, 4 consecutive weights of each row in a 32-bit lane, one integer dot product multiplying them
 * by 4 values of a row of x broadcast. Each weight is an unsigned byte u = q + offset, so vpdpbusd
 * takes it as is: Q8_0's signed q shifted by 128 (the AVX2 build, whose vpmaddubsw pairs would
 * saturate there, multiplies q = u - 128 itself, its sign moved onto x: WIDE_OFFSET 0), Q5_0's and
 * Q5_1's 0..31 as stored. The shift comes back in the integers: a row's chain starts at -offset * S.
 *
 * Repacked record of a tile's block b (rows past n are zeros):
 *   Q8_0 (544 B): fp16 d[16]; u[8][64]: byte 4r + i of u[t] is row r's q of value 4t + i, plus 128.
 *   Q5_0 (352 B): fp16 d[16]; qh[64]; qs[4][64]: byte 4r + i of qs[t] holds the low 4 bits of row r's
 *                 value 4t + i (low nibble) and of value 16 + 4t + i (high nibble); bits t and 4 + t
 *                 of byte 4r + i of qh are those two values' fifth bits.
 *   Q5_1 (384 B): fp16 d[16], m[16]; qh and qs as Q5_0.
 * Output (row j, row i of x), in this order, the one every ISA build and the test's reference keep:
 *   acc = 0; for each block b: I = sum of u * q_x - offset * S (offsets 128, 16, 0: Q8_0's and Q5_0's
 *   I is sum of q * q_x, the per-row int8 kernel's integers with Q5_0's -16 folded in),
 *     acc = fma((float)I, d * dx, acc); Q5_1 then acc = fma((float)S, m * dx, acc);
 *   out = acc + bias. Every integer sum is exact in 32 bits. */
#include <stdint.h>
#include <string.h>

#include "q8_activations.h"
#include "q8_gemm_lanes.h"
#include "quants.h"

#define Q8_0_RECORD 544
#define Q5_0_RECORD 352
#define Q5_1_RECORD 384

int64_t blocks32_record_bytes(int64_t type) {
    return type == Q8_0 ? Q8_0_RECORD : type == Q5_0 ? Q5_0_RECORD : Q5_1_RECORD;
}

void repack_blocks32(int64_t type, const uint8_t *const *rows, int count, uint8_t *out) {
    for (int r = 0; r < count; r++) {
        const uint8_t *blk = rows[r];
        if (type == Q8_0) {
            memcpy(out + 2 * r, blk, 2);
            for (int v = 0; v < 32; v++) out[32 + 64 * (v / 4) + 4 * r + v % 4] = (uint8_t)(blk[2 + v] ^ 0x80);
            continue;
        }
        const int head = type == Q5_1 ? 64 : 32, scale_bytes = type == Q5_1 ? 4 : 2; /* the record's, the block's */
        memcpy(out + 2 * r, blk, 2);
        if (type == Q5_1) memcpy(out + 32 + 2 * r, blk + 2, 2);
        uint32_t qh;
        memcpy(&qh, blk + scale_bytes, sizeof qh);
        const uint8_t *qs = blk + scale_bytes + 4;
        for (int t = 0; t < 4; t++)
            for (int i = 0; i < 4; i++) {
                const int low = 4 * t + i, high = 16 + 4 * t + i;
                out[head + 64 + 64 * t + 4 * r + i] = qs[low];
                out[head + 4 * r + i] |= (uint8_t)((qh >> low & 1) << t | (qh >> high & 1) << (4 + t));
            }
    }
}

/* acc[c] for rows of x c < cols: a tile's 16 outputs, every block */
static inline __attribute__((always_inline)) void q8_0_tile(const uint8_t *tile, const block_q8_0 *x, int64_t blocks,
                                                           const int cols, lanes_f *acc) {
    for (int c = 0; c < cols; c++) acc[c] = zeros_f();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = tile + b * Q8_0_RECORD;
        lanes_i dot_first[GEMM_COLS], dot_second[GEMM_COLS]; /* values 0-15 and 16-31: two chains */
        for (int c = 0; c < cols; c++) dot_first[c] = broadcast_i(-WIDE_OFFSET * x[c * blocks + b].sum), dot_second[c] = zeros_i();
        for (int t = 0; t < 4; t++) {
            const lanes_i first = load_bytes(rec + 32 + 64 * t), second = load_bytes(rec + 32 + 64 * (t + 4));
            for (int c = 0; c < cols; c++) {
                const int8_t *xq = x[c * blocks + b].qs + 4 * t;
                dot_first[c] = dot4_wide(dot_first[c], first, xq);
                dot_second[c] = dot4_wide(dot_second[c], second, xq + 16);
            }
        }
        const lanes_f d = halves(rec);
        for (int c = 0; c < cols; c++)
            acc[c] = fma_lanes(add_i(dot_first[c], dot_second[c]), times(d, x[c * blocks + b].d), acc[c]);
    }
}

static inline __attribute__((always_inline)) void q5_tile(const int64_t type, const uint8_t *tile,
                                                         const block_q8_0 *x, int64_t blocks, const int cols,
                                                         lanes_f *acc) {
    const int64_t record = type == Q5_1 ? Q5_1_RECORD : Q5_0_RECORD, head = type == Q5_1 ? 64 : 32;
    for (int c = 0; c < cols; c++) acc[c] = zeros_f();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = tile + b * record;
        lanes_i dot_low[GEMM_COLS], dot_high[GEMM_COLS]; /* values 0-15 and 16-31: two chains */
        for (int c = 0; c < cols; c++) {
            dot_low[c] = type == Q5_0 ? broadcast_i(-16 * x[c * blocks + b].sum) : zeros_i();
            dot_high[c] = zeros_i();
        }
        const lanes_i qh = load_bytes(rec + head);
        for (int t = 0; t < 4; t++) {
            const lanes_i q = load_bytes(rec + head + 64 + 64 * t);
            /* the fifth bits: bit t of a byte to bit 4 (16-bit shifts; bit 4 never crosses a byte) */
            const lanes_i low = or_i(low_nibbles(q), bit4(shift_left(qh, 4 - t)));
            const lanes_i high = or_i(high_nibbles(q), bit4(shift_right(qh, t)));
            for (int c = 0; c < cols; c++) {
                const int8_t *xq = x[c * blocks + b].qs + 4 * t;
                dot_low[c] = dot4(dot_low[c], low, xq);
                dot_high[c] = dot4(dot_high[c], high, xq + 16);
            }
        }
        const lanes_f d = halves(rec);
        for (int c = 0; c < cols; c++)
            acc[c] = fma_lanes(add_i(dot_low[c], dot_high[c]), times(d, x[c * blocks + b].d), acc[c]);
        if (type == Q5_1) {
            const lanes_f m = halves(rec + 32);
            for (int c = 0; c < cols; c++)
                acc[c] = fma_lanes(broadcast_i(x[c * blocks + b].sum), times(m, x[c * blocks + b].d), acc[c]);
        }
    }
}

#define Q5_0_TILE(tile, x, blocks, cols, acc) q5_tile(Q5_0, tile, x, blocks, cols, acc)
#define Q5_1_TILE(tile, x, blocks, cols, acc) q5_tile(Q5_1, tile, x, blocks, cols, acc)

/* constant types and column counts, so the accumulators stay in registers */
void blocks32_tile_times_rows(int64_t type, const uint8_t *tile, const block_q8_0 *x, int64_t blocks, int cols,
                              lanes_f *acc) {
#define TILE_COLS(kernel)                                                   \
    switch (cols) {                                                         \
    case 1: kernel(tile, x, blocks, 1, acc); break;                         \
    case 2: kernel(tile, x, blocks, 2, acc); break;                         \
    case 3: kernel(tile, x, blocks, GEMM_COLS > 3 ? 3 : GEMM_COLS, acc); break; /* 4 cols only */ \
    default: kernel(tile, x, blocks, GEMM_COLS, acc); break;                \
    }
    if (type == Q8_0) {
        TILE_COLS(q8_0_tile)
    } else if (type == Q5_0) {
        TILE_COLS(Q5_0_TILE)
    } else {
        TILE_COLS(Q5_1_TILE)
    }
#undef TILE_COLS
}
