/* y = x W^T (+ bias) for one vector of rows of x (up to 16 on AVX-512), W in Q4_K or Q6_K blocks: the
 * tiles of csrc/quant_tiled_matmul.c with the dequantization moved into the multiply loop. A thread
 * takes its tiles' panels (ROWS rows of W by COLUMNS columns) in turn: while one panel, decoded, is
 * multiplied into x^T from one buffer, the next is decoded into the other, a few 64-weight units
 * after every GROUP_COLUMNS columns, so that the decoder's shuffles fill the issue slots the
 * multiply-adds leave between their loads (decoded panel by panel, they ran one after the other).
 * The values are kquant_dequantize_chunks's, each output's products summed in column order from 0,
 * in registers across the panels of a tile: the sums of packed_matmul_f32, bit for bit. */
#include <omp.h>
#include <stdint.h>

#include "kquant_blocks.h"
#include "tile_sums.h"

#if defined(KQ_AVX512) && KQ_AVX512

#define ROWS KQUANT_PIPELINED_ROWS
#define COLUMNS 128                      /* two buffers and x^T's panel, 36 KB, stay in L1 */
#define STRIDE (COLUMNS + 16)            /* a cache line more than a panel, as the tiles' */
#define GROUP_COLUMNS 8
#define UNIT_VECS (64 / VEC_FLOATS)      /* a unit: 64 weights of a row */
#define ROW_UNITS (COLUMNS / 64)
#define PANEL_UNITS (ROWS * ROW_UNITS)
#define GROUP_UNITS (PANEL_UNITS / (COLUMNS / GROUP_COLUMNS))
#define BLOCK_PANELS (256 / COLUMNS)
#define MAX_BLOCK_BYTES 210

/* what decoding a panel needs: each row's block scales (Q4_K: scales and mins, sm[0..16); Q6_K:
 * ds[0..16)) and Q6_K's integers of the block's half the panel covers; then, unit by unit, where its
 * bytes (Q4_K's nibbles, Q6_K's integers) and its first scale lie */
typedef struct {
    float scales[ROWS][16];
    q6_k_half_t ints[ROWS];
    const uint8_t *unit_bytes[PANEL_UNITS];
    const float *unit_scales[PANEL_UNITS];
} panel_t;

/* rows past W's last decode from a block of zeros: their sums are never written */
static const uint8_t ZERO_BLOCK[MAX_BLOCK_BYTES];

static inline __attribute__((always_inline)) int64_t block_bytes(const int type) { return type == Q4_K ? 144 : 210; }

/* panel i of the thread's tiles (from tile t0, `panels` a tile): its rows' scales where it starts a
 * block, Q6_K's integers, its units; the bytes of the block BLOCK_PANELS panels on prefetched */
static inline __attribute__((always_inline)) void start_panel(const int type, const uint8_t *weight, int64_t row_bytes,
                                                             int64_t n, int64_t t0, int64_t panels, int64_t steps,
                                                             int64_t i, panel_t *panel) {
    const int64_t first_row = (t0 + i / panels) * ROWS, block = i % panels / BLOCK_PANELS;
    const int half = (int)(i % BLOCK_PANELS), starts_block = half == 0;
    const int64_t ahead = i + BLOCK_PANELS, ahead_row = (t0 + ahead / panels) * ROWS;
    const int64_t ahead_offset = ahead % panels / BLOCK_PANELS * block_bytes(type);
    for (int r = 0; r < ROWS; r++) {
        const uint8_t *b = first_row + r < n ? weight + (first_row + r) * row_bytes + block * block_bytes(type) : ZERO_BLOCK;
        if (starts_block) {
            if (type == Q4_K)
                q4_k_scales_mins(b, panel->scales[r]);
            else
                q6_k_scales(b, panel->scales[r]);
        }
        if (type == Q6_K) q6_k_half_ints(b, half, &panel->ints[r]);
        for (int part = 0; part < ROW_UNITS; part++) {
            /* Q4_K: the unit is the pair of sub-blocks p; Q6_K: vectors UNIT_VECS part on of the half */
            const int p = ROW_UNITS * half + part;
            panel->unit_bytes[ROW_UNITS * r + part] = type == Q4_K ? b + 16 + 32 * p : (const uint8_t *)&panel->ints[r];
            panel->unit_scales[ROW_UNITS * r + part] = type == Q4_K ? &panel->scales[r][2 * p] : &panel->scales[r][8 * half];
        }
        if (starts_block && ahead < steps && ahead_row + r < n)
            for (int64_t line = 0; line < block_bytes(type); line += 64)
                __builtin_prefetch(weight + (ahead_row + r) * row_bytes + ahead_offset + line);
    }
}

/* unit u of the panel (row u / ROW_UNITS, its weights 64 (u % ROW_UNITS) on) into the buffer: one
 * vector at a time, so that few registers besides the accumulators are taken */
static inline __attribute__((always_inline)) void decode_unit(const int type, const panel_t *panel, int u,
                                                             float *buffer) {
    const int part = u % ROW_UNITS;
    const uint8_t *bytes = panel->unit_bytes[u];
    const float *scales = panel->unit_scales[u];
    float *dst = buffer + u / ROW_UNITS * STRIDE + 64 * part;
    if (type == Q4_K) {
        /* q4_k_pair's tables and lookups, a sub-block at a time */
        const __m512 nibble_values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for (int high = 0; high < 2; high++) {
            const __m512 table = _mm512_fmsub_ps(_mm512_set1_ps(scales[high]), nibble_values,
                                                 _mm512_set1_ps(scales[8 + high]));
            for (int h = 0; h < 2; h++) {
                __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(bytes + 16 * h)));
                if (high) q = _mm512_srli_epi32(q, 4);
                _mm512_storeu_ps(dst + 32 * high + 16 * h, _mm512_permutexvar_ps(q, table));
            }
        }
    } else {
        /* q6_k_vector's products: vector v of the half times its scale ds[8 half + v] */
        for (int v = UNIT_VECS * part; v < UNIT_VECS * (part + 1); v++)
            store_vec(dst + (v - UNIT_VECS * part) * VEC_FLOATS, scales[v] * q6_k_ints((const q6_k_half_t *)bytes, v));
    }
}

/* the thread's tiles t0 .. t1 (their panels in turn, `steps` of them), outputs written */
static inline __attribute__((always_inline)) void pipelined_tiles(const int type, const float *xt,
                                                                 const uint8_t *weight, const float *bias, float *out,
                                                                 int64_t out_stride, int64_t m, int64_t n, int64_t k,
                                                                 int64_t t0, int64_t t1, float *buffers) {
    const int64_t row_bytes = quant_row_bytes(type, k), panels = k / COLUMNS, steps = (t1 - t0) * panels;
    float *sums = buffers + 2 * ROWS * STRIDE;
    panel_t panel;
    vec_t acc[ROWS];
    if (steps <= 0) return;
    start_panel(type, weight, row_bytes, n, t0, panels, steps, 0, &panel);
    for (int u = 0; u < PANEL_UNITS; u++) decode_unit(type, &panel, u, buffers);
    for (int64_t i = 0; i < steps; i++) {
        const int64_t column0 = i % panels * COLUMNS;
        const float *tile = buffers + i % 2 * ROWS * STRIDE;
        float *next = buffers + (i + 1) % 2 * ROWS * STRIDE;
        if (column0 == 0)
            for (int j = 0; j < ROWS; j++) acc[j] = (vec_t){0};
        if (i + 1 < steps) start_panel(type, weight, row_bytes, n, t0, panels, steps, i + 1, &panel);
        for (int g = 0; g < COLUMNS / GROUP_COLUMNS; g++) {
            /* unrolled, so that the accumulators stay in registers */
#pragma GCC unroll 8
            for (int gc = 0; gc < GROUP_COLUMNS; gc++) {
                const int c = g * GROUP_COLUMNS + gc;
                const vec_t xv = load_vec(xt + (column0 + c) * VEC_FLOATS);
#pragma GCC unroll 24
                for (int j = 0; j < ROWS; j++) acc[j] += tile[j * STRIDE + c] * xv;
            }
            if (i + 1 < steps)
#pragma GCC unroll 4
                for (int gu = 0; gu < GROUP_UNITS; gu++) decode_unit(type, &panel, g * GROUP_UNITS + gu, next);
        }
        if (column0 + COLUMNS == k) {
            for (int j = 0; j < ROWS; j++) store_vec(sums + j * VEC_FLOATS, acc[j]);
            write_tile(sums, bias, out, out_stride, m, VEC_FLOATS, n, (t0 + i / panels) * ROWS, ROWS);
        }
    }
}

int kquant_pipelined_tiles(const float *xt, const uint8_t *weight, int64_t type, const float *bias, float *out,
                           int64_t out_stride, int64_t m, int64_t n, int64_t k, float *buffers) {
    if ((type != Q4_K && type != Q6_K) || m > VEC_FLOATS) return 0;
    const int64_t tiles = (n + ROWS - 1) / ROWS, id = omp_get_thread_num(), threads = omp_get_num_threads();
    const int64_t t0 = id * tiles / threads, t1 = (id + 1) * tiles / threads;
    if (type == Q4_K)
        pipelined_tiles(Q4_K, xt, weight, bias, out, out_stride, m, n, k, t0, t1, buffers);
    else
        pipelined_tiles(Q6_K, xt, weight, bias, out, out_stride, m, n, k, t0, t1, buffers);
#pragma omp barrier
    return 1;
}

#else

int kquant_pipelined_tiles(const float *xt, const uint8_t *weight, int64_t type, const float *bias, float *out,
                           int64_t out_stride, int64_t m, int64_t n, int64_t k, float *buffers) {
    (void)xt, (void)weight, (void)type, (void)bias, (void)out, (void)out_stride, (void)m, (void)n, (void)k, (void)buffers;
    return 0;
}

#endif
