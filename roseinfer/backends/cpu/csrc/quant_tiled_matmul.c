/* y = x W^T (+ bias) for many rows of x, W in GGUF blocks, as a GEMM, in chunks of at most CHUNK_ROWS
 * rows of x. x is transposed once per chunk, a vector of rows at a time (x^T [m / VEC_FLOATS][k]
 * [VEC_FLOATS], m rounded up, the padding 0): a column's vector then lies next to the one before it,
 * where rows of x^T m floats apart put a panel's columns in a few L1 sets (2 KB apart at 512 rows of
 * x). A thread takes a tile's rows of W at a time, dequantizes a panel of their columns into a
 * row-major tile (the values dequantize_rows_f32 writes) and multiplies it into every row of x: per
 * column, V vectors of x^T times R weights broadcast from the tile into R x V accumulators (outputs of
 * R rows of W for V vectors of rows of x), carrying each output's running sum from one panel to the
 * next. A weight is decoded once per chunk, never transposed, and each output's products are summed in
 * column order from 0: the sums of packed_matmul_f32 on the dequantized W, bit for bit. The large tile
 * (96 KB) and the panel of x^T stay in L2 while they pass over each other; the small one (26 KB) in
 * L1. From BY_PANEL_ROWS rows of x, where x^T (2 MB at 256 rows of 2048) no longer stays in the L2
 * from one tile to the next, the loops turn: each panel of x^T meets every tile of a band of W's rows
 * in turn, their running sums in a shared buffer, so that x^T passes through the L2 once a band; a
 * chunk's panel of x^T (1 MB at 512 rows) stays in the L2 while it meets the band's tiles. Up to 64
 * rows of x Q4_K (Q6_K up to 32) on AVX-512 takes csrc/kquant_pipelined_tiles.c instead. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quants.h"
#include "simd.h"
#include "tile_sums.h"

/* Two tile sizes (rows of W, each a multiple of every R below; columns, whole 256-weight blocks). From
 * SMALL_TILE_MAX_ROWS rows of x down, where decoding the weights took a third of the time, the tile
 * fits in L1: decoded into a 96-KB tile, every store missed L1 and decoding took twice as long.
 * Above, the large tile's longer panels pass over x^T fewer times. */
#define TILE_ROWS 48
#define PANEL_COLUMNS 512
#define SMALL_TILE_ROWS 24
#define SMALL_PANEL_COLUMNS 256
#define SMALL_TILE_MAX_ROWS 16
#define TRANSPOSE_COLUMNS 512
#define BY_PANEL_ROWS 256
#define BAND_SUMS_BYTES (4 << 20) /* the running sums of a band's tiles, in L3 */
#define CHUNK_ROWS 512
/* floats from one tile row to the next: a cache line more than a panel, because rows 2 KB apart all
 * fell in the same L1 sets (a kernel reading 24 of them thrashed) */
#define STRIDE(panel_columns) ((panel_columns) + 16)
#if defined(__AVX512F__)
#define ACCUMULATORS 24 /* of 32 registers, the rest for x^T's vectors and a broadcast weight */
#define MAX_VECTORS 4
#else
/* AVX2's 16 registers, and the portable build: with 4 vectors of x^T no register was left for the
 * broadcast weight, and every multiply-add read its vector of x^T from memory again */
#define ACCUMULATORS 12
#define MAX_VECTORS 2
#endif

/* acc[j][v] += tile rows j < R (rows `stride` floats apart) times x^T's vectors v < V (their blocks
 * block_floats apart), over `width` columns. The pragmas unroll it: GCC kept AVX-512's 24 x 1 accumulators
 * in memory otherwise, a load and a store around every multiply-add. */
static inline __attribute__((always_inline)) void tile_times_columns(const float *tile, const float *xt,
                                                                     int64_t block_floats, int64_t width,
                                                                     vec_t acc[][4], const int R, const int V,
                                                                     const int stride) {
    for (int64_t c = 0; c < width; c++) {
        vec_t xv[4];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) xv[v] = load_vec(xt + v * block_floats + c * VEC_FLOATS);
#pragma GCC unroll 24
        for (int j = 0; j < R; j++) {
            const float w = tile[j * stride + c];
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[j][v] += w * xv[v];
        }
    }
}

/* sums [R][m_pad] (rows m_pad apart) += R tile rows times V vectors of x^T, from sums (0 at the
 * first panel) through registers */
static inline __attribute__((always_inline)) void register_tile(const float *tile, const float *xt, int64_t m_pad,
                                                                int64_t block_floats, int64_t width, float *sums,
                                                                int first_panel, const int R, const int V,
                                                                const int stride) {
    vec_t acc[ACCUMULATORS][4];
    for (int j = 0; j < R; j++)
        for (int v = 0; v < V; v++) acc[j][v] = first_panel ? (vec_t){0} : load_vec(sums + j * m_pad + v * VEC_FLOATS);
    tile_times_columns(tile, xt, block_floats, width, acc, R, V, stride);
    for (int j = 0; j < R; j++)
        for (int v = 0; v < V; v++) store_vec(sums + j * m_pad + v * VEC_FLOATS, acc[j][v]);
}

/* sums [tile_rows][m_pad] += the tile times every vector of x^T's panel (its blocks block_floats
 * apart); tile_rows and stride are literals, so the tile's offsets are too */
static inline __attribute__((always_inline)) void tile_times_panel(const float *tile, const float *xt, int64_t m_pad,
                                                                   int64_t block_floats, int64_t width, float *sums,
                                                                   int first_panel, const int tile_rows,
                                                                   const int stride) {
    for (int64_t v0 = 0; v0 < m_pad; ) {
        const int64_t left = (m_pad - v0) / VEC_FLOATS;
        const int V = left >= 4 && MAX_VECTORS >= 4 ? 4 : left >= 2 ? 2 : 1;
        for (int j = 0; j < tile_rows; j += ACCUMULATORS / V) {
            const float *t = tile + j * stride, *x = xt + v0 / VEC_FLOATS * block_floats;
            float *s = sums + j * m_pad + v0;
            /* constant shapes, so the accumulators stay in registers */
            if (V == 4)
                register_tile(t, x, m_pad, block_floats, width, s, first_panel, ACCUMULATORS / 4, 4, stride);
            else if (V == 2)
                register_tile(t, x, m_pad, block_floats, width, s, first_panel, ACCUMULATORS / 2, 2, stride);
            else
                register_tile(t, x, m_pad, block_floats, width, s, first_panel, ACCUMULATORS, 1, stride);
        }
        v0 += V * VEC_FLOATS;
    }
}

static void large_tile_times_panel(const float *tile, const float *xt, int64_t m_pad, int64_t block_floats,
                                   int64_t width, float *sums, int first_panel) {
    tile_times_panel(tile, xt, m_pad, block_floats, width, sums, first_panel, TILE_ROWS, STRIDE(PANEL_COLUMNS));
}

static void small_tile_times_panel(const float *tile, const float *xt, int64_t m_pad, int64_t block_floats,
                                   int64_t width, float *sums, int first_panel) {
    tile_times_panel(tile, xt, m_pad, block_floats, width, sums, first_panel, SMALL_TILE_ROWS,
                     STRIDE(SMALL_PANEL_COLUMNS));
}

/* W's rows first_row .. + tile_rows (those from n on as zeros), columns first .. + width, dequantized
 * into the tile; the same columns of the rows from next_row (the bytes decoded next, where they are
 * tile_rows short runs, which the hardware prefetcher did not keep ahead of) are prefetched */
static void decode_panel(const uint8_t *weight, int64_t type, int64_t row_bytes, int64_t n, int64_t first_row,
                         int64_t tile_rows, int64_t first, int64_t width, int64_t next_row, int64_t next,
                         int64_t next_width, float *tile, int64_t stride) {
    const int64_t next_offset = quant_row_bytes(type, next), next_bytes = quant_row_bytes(type, next_width);
    for (int64_t r = 0; r < tile_rows; r++) {
        const uint8_t *row = weight + (first_row + r) * row_bytes;
        for (int64_t b = 0; next_row + r < n && b < next_bytes; b += 64)
            __builtin_prefetch(weight + (next_row + r) * row_bytes + next_offset + b);
        if (first_row + r < n && !kquant_dequantize_chunks(type, row, first / 32, width / 32, tile + r * stride))
            dequantize_chunks(type, row, first / 32, width / 32, tile + r * stride);
        else if (first_row + r >= n)
            memset(tile + r * stride, 0, (size_t)width * sizeof(float));
    }
}

/* The sizes a call's loops and buffers take for m rows of x */
typedef struct {
    int small, by_panel;
    int64_t tile_rows, panel_columns, stride, tiles, m_pad, tile_sums, band_tiles;
    size_t thread_floats, shared_floats;
} TiledShape;

static TiledShape tiled_shape(int64_t m, int64_t n, int64_t k) {
    TiledShape s;
    s.small = m <= SMALL_TILE_MAX_ROWS;
    s.tile_rows = s.small ? SMALL_TILE_ROWS : TILE_ROWS;
    s.panel_columns = s.small ? SMALL_PANEL_COLUMNS : PANEL_COLUMNS;
    s.stride = STRIDE(s.panel_columns);
    s.tiles = (n + s.tile_rows - 1) / s.tile_rows;
    s.m_pad = (m + VEC_FLOATS - 1) / VEC_FLOATS * VEC_FLOATS;
    /* panel by panel: bands of band_tiles tiles whose running sums fit BAND_SUMS_BYTES */
    s.by_panel = s.m_pad >= BY_PANEL_ROWS;
    s.tile_sums = s.tile_rows * s.m_pad;
    const int64_t bands = s.by_panel ? (s.tiles * s.tile_sums * (int64_t)sizeof(float) + BAND_SUMS_BYTES - 1) /
                                           BAND_SUMS_BYTES : 1;
    s.band_tiles = (s.tiles + bands - 1) / bands;
    /* x^T, each thread's tile [tile_rows][panel_columns] and running sums [tile_rows][m_pad] (tile by
     * tile; or the pipelined tiles' buffers), then a band's running sums (panel by panel) */
    s.thread_floats = (size_t)(s.tile_rows * s.stride + s.tile_sums);
    if (s.small && s.thread_floats < KQUANT_PIPELINED_FLOATS) s.thread_floats = KQUANT_PIPELINED_FLOATS;
    s.shared_floats = (size_t)(k * s.m_pad) + (s.by_panel ? (size_t)(s.band_tiles * s.tile_sums) : 0);
    return s;
}

/* One chunk of at most CHUNK_ROWS rows of x through the tiles, in buffers that fit its tiled_shape.
 * Its loops end at a barrier, so the next chunk may overwrite the buffers. */
static void tiled_chunk(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                        float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k, float *buffers) {
    const TiledShape s = tiled_shape(m, n, k);
    const int64_t tile_rows = s.tile_rows, panel_columns = s.panel_columns, stride = s.stride, tiles = s.tiles;
    const int64_t m_pad = s.m_pad, tile_sums = s.tile_sums, band_tiles = s.band_tiles;
    const int64_t row_bytes = quant_row_bytes(type, k), block_floats = k * VEC_FLOATS;
    float *xt = buffers, *band_sums = buffers + k * m_pad;
    float *tile = buffers + s.shared_floats + (size_t)omp_get_thread_num() * s.thread_floats;
    float *sums = tile + tile_rows * stride;
    /* a row of x at a time, read in order (read down its columns, x_stride floats apart, every float
     * is a cache miss at large k), in runs of TRANSPOSE_COLUMNS columns so that both threads have work
     * at 16 rows */
#pragma omp for collapse(2) schedule(static)
    for (int64_t block = 0; block < m_pad / VEC_FLOATS; block++)
        for (int64_t first = 0; first < k; first += TRANSPOSE_COLUMNS)
            for (int64_t i = block * VEC_FLOATS; i < (block + 1) * VEC_FLOATS; i++) {
                float *column = xt + block * block_floats + i % VEC_FLOATS;
                const int64_t end = k - first < TRANSPOSE_COLUMNS ? k : first + TRANSPOSE_COLUMNS;
                for (int64_t c = first; c < end; c++) column[c * VEC_FLOATS] = i < m ? x[i * x_stride + c] : 0.0f;
            }
    if (s.by_panel) {
        for (int64_t band = 0; band < tiles; band += band_tiles) {
            const int64_t end = band + band_tiles < tiles ? band + band_tiles : tiles;
            for (int64_t first = 0; first < k; first += panel_columns) {
                const int64_t width = k - first < panel_columns ? k - first : panel_columns;
                /* a static schedule over the same tiles: each thread keeps its tiles from panel to
                 * panel, so it need not wait for the others */
#pragma omp for schedule(static) nowait
                for (int64_t t = band; t < end; t++) {
                    decode_panel(weight, type, row_bytes, n, t * tile_rows, tile_rows, first, width,
                                 (t + 1) * tile_rows, first, width, tile, stride);
                    large_tile_times_panel(tile, xt + first * VEC_FLOATS, m_pad, block_floats, width,
                                           band_sums + (t - band) * tile_sums, first == 0);
                }
            }
#pragma omp for schedule(static) nowait
            for (int64_t t = band; t < end; t++)
                write_tile(band_sums + (t - band) * tile_sums, bias, out, out_stride, m, m_pad, n, t * tile_rows,
                           tile_rows);
            /* the next band's tiles reuse the buffer, and may fall to the other thread */
#pragma omp barrier
        }
    } else if (!kquant_pipelined_tiles(xt, weight, type, bias, out, out_stride, m, n, k, tile)) {
        /* tile by tile, where the K-quants' pipelined tiles do not run */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            for (int64_t first = 0; first < k; first += panel_columns) {
                const int64_t width = k - first < panel_columns ? k - first : panel_columns;
                /* this tile's next panel, or the next tile's first */
                const int64_t next = first + panel_columns < k ? first + panel_columns : 0;
                decode_panel(weight, type, row_bytes, n, t * tile_rows, tile_rows, first, width,
                             next ? t * tile_rows : (t + 1) * tile_rows, next,
                             k - next < panel_columns ? k - next : panel_columns, tile, stride);
                if (s.small)
                    small_tile_times_panel(tile, xt + first * VEC_FLOATS, m_pad, block_floats, width, sums, first == 0);
                else
                    large_tile_times_panel(tile, xt + first * VEC_FLOATS, m_pad, block_floats, width, sums, first == 0);
            }
            write_tile(sums, bias, out, out_stride, m, m_pad, n, t * tile_rows, tile_rows);
        }
    }
}

/* Whether it ran: 0 (nothing written) where the buffers could not be allocated; every thread of the
 * enclosing region sees the same answer. Rows of x in chunks of at most CHUNK_ROWS, as even as whole
 * vectors allow: W is decoded once a chunk. The buffers fit both chunk sizes: the last chunk's band
 * of running sums can be the larger (fewer rows, one band where the full chunk took two). */
int quant_tiled_tasks(const float *x, int64_t x_stride, const uint8_t *weight, int64_t type, const float *bias,
                      float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k) {
    const int64_t chunks = (m + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const int64_t chunk_rows = ((m + chunks - 1) / chunks + VEC_FLOATS - 1) / VEC_FLOATS * VEC_FLOATS;
    const TiledShape full = tiled_shape(chunk_rows < m ? chunk_rows : m, n, k);
    const TiledShape last = tiled_shape(m - (m - 1) / chunk_rows * chunk_rows, n, k);
    const size_t shared_floats = full.shared_floats > last.shared_floats ? full.shared_floats : last.shared_floats;
    const size_t thread_floats = full.thread_floats > last.thread_floats ? full.thread_floats : last.thread_floats;
    float *buffers = NULL;
#pragma omp single copyprivate(buffers)
    buffers = aligned_alloc(64, (shared_floats + (size_t)omp_get_num_threads() * thread_floats) * sizeof(float));
    if (buffers == NULL) return 0;
    for (int64_t first = 0; first < m; first += chunk_rows)
        tiled_chunk(x + first * x_stride, x_stride, weight, type, bias, out + first * out_stride, out_stride,
                    m - first < chunk_rows ? m - first : chunk_rows, n, k, buffers);
#pragma omp single
    free(buffers);
    return 1;
}
