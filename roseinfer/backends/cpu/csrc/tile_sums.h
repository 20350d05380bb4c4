/* The tiles' last step, shared by csrc/quant_tiled_matmul.c and csrc/kquant_pipelined_tiles.c. */
#ifndef ROSEINFER_TILE_SUMS_H
#define ROSEINFER_TILE_SUMS_H

#include <stdint.h>

/* out's columns first_row .. (at most tile_rows of them) = a tile's running sums [tile_rows][m_pad], bias added */
static inline void write_tile(const float *sums, const float *bias, float *out, int64_t out_stride, int64_t m,
                              int64_t m_pad, int64_t n, int64_t first_row, int64_t tile_rows) {
    const int64_t rows = n - first_row < tile_rows ? n - first_row : tile_rows;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < rows; j++)
            out[i * out_stride + first_row + j] = sums[j * m_pad + i] + (bias != NULL ? bias[first_row + j] : 0.0f);
}

#endif
