/* y = x W^T (+ bias) for up to 4 vectors of rows of x (64 on AVX-512), W in Q4_K or Q6_K blocks: the
 * tiles of csrc/quant_tiled_matmul.c with the dequantization moved into the multiply loop. At V
 * vectors of x^T a tile is R = 24 / V rows of W, so that R x V accumulators fill the registers. A
 * thread takes the panels (R rows by COLUMNS columns) of a run of tiles in turn: while one panel,
 * decoded, is multiplied into x^T from one buffer, the next is decoded into the other, a few
 * 64-weight units after every few columns, so that the decoder's shuffles fill the issue slots the
 * multiply-adds leave between their loads (decoded panel by panel, they ran one after the other).
 * Runs of tiles go to the threads as they free up. The values are kquant_dequantize_chunks's, each
 * output's products summed in column order from 0, in registers across the panels of a tile: the
 * sums of packed_matmul_f32, bit for bit. */
#include <omp.h>
#include <stdint.h>

#include "kquant_blocks.h"
#include "tile_sums.h"

#if defined(KQ_AVX512) && KQ_AVX512

#define ROWS KQUANT_PIPELINED_ROWS /* rows of W a tile at one vector of x^T */
#define COLUMNS KQUANT_PIPELINED_COLUMNS /* 128: two buffers and x^T's panel, 36 KB, stay in L1 */
#define STRIDE (COLUMNS + 16)            /* a cache line more than a panel, as the tiles' */
#define UNIT_VECS (64 / VEC_FLOATS)      /* a unit: 64 weights of a row */
#define ROW_UNITS (COLUMNS / 64)
#define PANEL_UNITS (ROWS * ROW_UNITS)
#define BLOCK_PANELS (256 / COLUMNS)
#define MAX_BLOCK_BYTES 210
#define MAX_VECTORS 4

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

/* panel i of the thread's tiles (from tile t0, `panels` a tile): its rows' scales where it starts a
 * block, Q6_K's integers, its units; the bytes of the block BLOCK_PANELS panels on prefetched */
static inline __attribute__((always_inline)) void start_panel(const int type, const int R, const uint8_t *weight,
                                                             int64_t row_bytes, int64_t n, int64_t t0, int64_t panels,
                                                             int64_t steps, int64_t i, panel_t *panel) {
    const int64_t first_row = (t0 + i / panels) * R, block = i % panels / BLOCK_PANELS;
    const int half = (int)(i % BLOCK_PANELS), starts_block = half == 0;
    const int64_t ahead = i + BLOCK_PANELS, ahead_row = (t0 + ahead / panels) * R;
    const int64_t ahead_offset = ahead % panels / BLOCK_PANELS * quant_block_bytes(type);
    for (int r = 0; r < R; r++) {
        const uint8_t *b = first_row + r < n ? weight + (first_row + r) * row_bytes + block * quant_block_bytes(type) : ZERO_BLOCK;
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
            for (int64_t line = 0; line < quant_block_bytes(type); line += 64)
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
        /* q4_k_pair's work, a sub-block's table at a time */
        for (int high = 0; high < 2; high++) {
            const __m512 table = q4_k_table(scales[high], scales[8 + high]);
            for (int h = 0; h < 2; h++) store_vec(dst + 32 * high + 16 * h, q4_k_lookup(bytes + 16 * h, high, table));
        }
    } else {
        /* the unit's scales start at the half's: q6_k_vector's half 0 of them */
        for (int v = UNIT_VECS * part; v < UNIT_VECS * (part + 1); v++)
            store_vec(dst + (v - UNIT_VECS * part) * VEC_FLOATS, q6_k_vector((const q6_k_half_t *)bytes, scales, 0, v));
    }
}

/* tiles t0 .. t1 of R = ROWS / V rows of W (their panels in turn, `steps` of them) times V
 * vectors of x^T, outputs written */
static inline __attribute__((always_inline)) void pipelined_tiles(const int type, const int V, const float *xt,
                                                                 const uint8_t *weight, const float *bias, float *out,
                                                                 int64_t out_stride, int64_t m, int64_t n, int64_t k,
                                                                 int64_t t0, int64_t t1, float *buffers) {
    /* a panel's R ROW_UNITS units spread over its columns: 3 after every 8 V columns, or 2 after every 16 */
    const int R = ROWS / V, group_columns = V == 3 ? 16 : 8 * V, group_units = R * ROW_UNITS / (COLUMNS / group_columns);
    const int64_t row_bytes = quant_row_bytes(type, k), panels = k / COLUMNS, steps = (t1 - t0) * panels;
    const int64_t block_floats = k * VEC_FLOATS;
    float *sums = buffers + 2 * R * STRIDE;
    panel_t panel;
    vec_t acc[ROWS][MAX_VECTORS];
    if (steps <= 0) return;
    start_panel(type, R, weight, row_bytes, n, t0, panels, steps, 0, &panel);
    for (int u = 0; u < R * ROW_UNITS; u++) decode_unit(type, &panel, u, buffers);
    for (int64_t i = 0; i < steps; i++) {
        const int64_t column0 = i % panels * COLUMNS;
        const float *tile = buffers + i % 2 * R * STRIDE;
        float *next = buffers + (i + 1) % 2 * R * STRIDE;
        if (column0 == 0)
            for (int j = 0; j < R; j++)
                for (int v = 0; v < V; v++) acc[j][v] = (vec_t){0};
        if (i + 1 < steps) start_panel(type, R, weight, row_bytes, n, t0, panels, steps, i + 1, &panel);
        for (int g = 0; g < COLUMNS / group_columns; g++) {
            /* unrolled, so that the accumulators stay in registers */
#pragma GCC unroll 32
            for (int gc = 0; gc < group_columns; gc++) {
                const int c = g * group_columns + gc;
                vec_t xv[MAX_VECTORS];
#pragma GCC unroll 4
                for (int v = 0; v < V; v++) xv[v] = load_vec(xt + v * block_floats + (column0 + c) * VEC_FLOATS);
#pragma GCC unroll 24
                for (int j = 0; j < R; j++) {
                    const float w = tile[j * STRIDE + c];
#pragma GCC unroll 4
                    for (int v = 0; v < V; v++) acc[j][v] += w * xv[v];
                }
            }
            if (i + 1 < steps)
#pragma GCC unroll 4
                for (int gu = 0; gu < group_units; gu++) decode_unit(type, &panel, g * group_units + gu, next);
        }
        if (column0 + COLUMNS == k) {
            for (int j = 0; j < R; j++)
                for (int v = 0; v < V; v++) store_vec(sums + j * V * VEC_FLOATS + v * VEC_FLOATS, acc[j][v]);
            write_tile(sums, bias, out, out_stride, m, V * VEC_FLOATS, n, (t0 + i / panels) * R, R);
        }
    }
}

/* runs of tiles a thread, handed out as threads free up: a vCPU the host slows takes fewer */
#define RUNS_PER_THREAD 4

/* one type's tiles at V vectors of x^T, in runs of consecutive tiles (pipelined within a run): a
 * function each, so that each is compiled (and its registers allocated) on its own: in one function
 * the 16-row Q6_K ran slower */
#define THREAD_TILES(name, type, V)                                                                             \
    static __attribute__((noinline)) void name(const float *xt, const uint8_t *weight, const float *bias,        \
                                               float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k, \
                                               float *buffers) {                                                \
        const int64_t tiles = (n + ROWS / (V) - 1) / (ROWS / (V));                                              \
        const int64_t runs = omp_get_num_threads() * RUNS_PER_THREAD;                                           \
        _Pragma("omp for schedule(dynamic, 1) nowait")                                                          \
        for (int64_t r = 0; r < runs; r++)                                                                      \
            pipelined_tiles(type, V, xt, weight, bias, out, out_stride, m, n, k, r * tiles / runs,               \
                            (r + 1) * tiles / runs, buffers);                                                   \
    }
THREAD_TILES(q4_k_tiles_1, Q4_K, 1)
THREAD_TILES(q4_k_tiles_2, Q4_K, 2)
THREAD_TILES(q4_k_tiles_3, Q4_K, 3)
THREAD_TILES(q4_k_tiles_4, Q4_K, 4)
THREAD_TILES(q6_k_tiles_1, Q6_K, 1)
THREAD_TILES(q6_k_tiles_2, Q6_K, 2)

int kquant_pipelined_tiles(const float *xt, const uint8_t *weight, int64_t type, const float *bias, float *out,
                           int64_t out_stride, int64_t m, int64_t n, int64_t k, float *buffers) {
    const int vectors = (int)((m + VEC_FLOATS - 1) / VEC_FLOATS);
    /* Q6_K from 3 vectors of x^T ran slower pipelined (docs/profiling.md section 20) */
    if ((type != Q4_K && type != Q6_K) || vectors > MAX_VECTORS || (type == Q6_K && vectors > 2)) return 0;
    void (*const tiles[2][4])(const float *, const uint8_t *, const float *, float *, int64_t, int64_t, int64_t,
                              int64_t, float *) = {{q4_k_tiles_1, q4_k_tiles_2, q4_k_tiles_3, q4_k_tiles_4},
                                                   {q6_k_tiles_1, q6_k_tiles_2, NULL, NULL}};
    tiles[type == Q6_K][vectors - 1](xt, weight, bias, out, out_stride, m, n, k, buffers);
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
