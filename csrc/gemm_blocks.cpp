// Prompt-sized products against a matrix of ggml blocks, in float32 (see gemm_blocks.h).
//
// Why not oneDNN's sgemm on dequantized weights: a prefill is compute-bound, and on SmolLM2's
// shapes sgemm reaches a third of what a bare FMA loop does, the loops below most of it
// (bench/bench_prefill.py --kernels; measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
//
// Shape of the work: the matrix's rows are taken kPanelCols = 32 at a time, a panel: dequantized
// by blocks.cpp 16 rows at a time into a scratch buffer, then transposed so that each k holds the
// panel's 32 weights side by side (panel [K, 32]: two 512-bit vectors per k). x is packed in tiles
// of a few rows, each tile's rows side by side per k. A tile then runs down k: per k, two vector
// loads of the panel, a broadcast of each row's x[r, k], and two FMAs per row. Each output is one
// lane of one accumulator, so nothing is reduced across lanes, and its sum is the chain over k of
// gemm_blocks.h whatever tile or thread computes it. The panel (K * 128 bytes: 72 KB at K = 576,
// 192 KB at 1536) stays in L2 while every row of x passes over it; x reaches L1 a tile at a time,
// read once per panel. (Not a dot-product tile, 16-lane partial sums of x rows against weight
// rows reduced at the end: it needs no transpose, but its loads per FMA are higher and its
// reduction is paid per output.)
//
// Threads share (row chunk, panel) work items: panels are dequantized once per row chunk, and a
// whole output is computed by the thread that owns its item.
#include "gemm_blocks.h"

#include <algorithm>
#include <vector>

#include "cpu_features.h"
#include "vector_math.h"
#ifdef _OPENMP
#include <omp.h>
#endif

namespace specengine {
namespace {

// Weight rows per panel: 32 outputs per row of x, two 512-bit (four 256-bit) accumulators.
constexpr int64_t kPanelCols = 32;
// Rows of x per work item, at most: a panel is dequantized once per chunk of x's rows, and x [512,
// K] (1.2 MB at K = 576) is re-read from L2/L3 once per panel.
constexpr int64_t kChunkRows = 512;
// Below this many multiply-adds a second thread costs more to wake than it saves (gemm.cpp's bound).
constexpr int64_t kParallelMultiplies = int64_t{1} << 20;

// Half a panel, its columns [half, half + 16): panel[k * kPanelCols + half + j] = rows[j, k] for
// j < cols, 0 for the columns past the matrix's last row (computed, never stored). rows [cols, K].
void transpose_into_panel(const float* rows, int64_t cols, int64_t K, float* panel, int64_t half) {
  for (int64_t j = 0; j < 16; ++j) {
    float* column = panel + half + j;
    if (j < cols) {
      const float* row = rows + j * K;
      for (int64_t k = 0; k < K; ++k) column[k * kPanelCols] = row[k];
    } else {
      for (int64_t k = 0; k < K; ++k) column[k * kPanelCols] = 0.f;
    }
  }
}

#ifdef SPECENGINE_X86
// transpose_into_panel, 16 x 16 weights at a time.
SPECENGINE_AVX512 void transpose_into_panel_avx512(const float* rows, int64_t cols, int64_t K, float* panel,
                                                   int64_t half) {
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t width = std::min<int64_t>(16, K - k0);
    const __mmask16 valid = width == 16 ? __mmask16(0xFFFF) : __mmask16((1u << width) - 1);
    __m512 v[16];
    for (int64_t j = 0; j < 16; ++j)
      v[j] = j < cols ? _mm512_maskz_loadu_ps(valid, rows + j * K + k0) : _mm512_setzero_ps();
    transpose16x16(v);
    for (int64_t i = 0; i < width; ++i) _mm512_storeu_ps(panel + (k0 + i) * kPanelCols + half, v[i]);
  }
}

// transpose_into_panel, 8 x 8 weights at a time (the k past the last multiple of 8 one by one):
// register transposes instead of the scalar loop's strided stores, which dominated a pass on AVX2
// CPUs (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md).
SPECENGINE_AVX2 void transpose_into_panel_avx2(const float* rows, int64_t cols, int64_t K, float* panel,
                                               int64_t half) {
  const int64_t K8 = K & ~int64_t{7};
  for (int64_t j0 = 0; j0 < 16; j0 += 8) {
    for (int64_t k0 = 0; k0 < K8; k0 += 8) {
      __m256 v[8];
      for (int64_t j = 0; j < 8; ++j)
        v[j] = j0 + j < cols ? _mm256_loadu_ps(rows + (j0 + j) * K + k0) : _mm256_setzero_ps();
      transpose8x8(v);
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k0 + i) * kPanelCols + half + j0, v[i]);
    }
    for (int64_t k = K8; k < K; ++k)
      for (int64_t j = j0; j < j0 + 8; ++j) panel[k * kPanelCols + half + j] = j < cols ? rows[j * K + k] : 0.f;
  }
}
#endif

// ---- x in tiles ----------------------------------------------------------------------------------
// A tile's rows side by side, so that its broadcasts per k are one run of TILE floats from one
// pointer (one stream to prefetch, few address registers): tile t of x [R, K] is
// packed[t][k][i] = x[t * TILE + i, k], zeros past R.

void pack_x_tile(const float* x, int64_t R, int64_t K, int64_t tile_rows, int64_t t, float* packed) {
  float* out = packed + t * K * tile_rows;
  for (int64_t i = 0; i < tile_rows; ++i) {
    const int64_t r = t * tile_rows + i;
    if (r < R) {
      const float* row = x + r * K;
      for (int64_t k = 0; k < K; ++k) out[k * tile_rows + i] = row[k];
    } else {
      for (int64_t k = 0; k < K; ++k) out[k * tile_rows + i] = 0.f;
    }
  }
}

// ---- portable path: the same chains, as a rounded multiply and a rounded add ----------------------

constexpr int kTilePortable = 4;

// Rows [0, ROWS) of a packed tile (TILE rows wide) against a panel: out [ROWS, cols] rows
// out_stride apart, bias [cols] or nullptr.
template <int ROWS, int TILE>
void tile_portable(const float* xt, int64_t K, const float* panel, const float* bias, float* out, int64_t out_stride,
                   int64_t cols) {
  float acc[ROWS][kPanelCols] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = panel + k * kPanelCols;
    for (int i = 0; i < ROWS; ++i) {
      const float xi = xt[k * TILE + i];
      for (int64_t j = 0; j < kPanelCols; ++j) acc[i][j] += xi * wk[j];
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * out_stride + j] = bias ? acc[i][j] + bias[j] : acc[i][j];
}

#ifdef SPECENGINE_X86
// ---- AVX2 path: half a panel (16 outputs, two 256-bit vectors) per tile of 6 rows ----------------
// 12 accumulators, 2 weight vectors and a broadcast: 15 of the 16 registers.

constexpr int kTileAvx2 = 6;

// 16 outputs of the panel, its columns [0, 16) from `panel` (offset by the half), `valid` of them
// stored.
template <int ROWS, int TILE>
SPECENGINE_AVX2 void half_tile_avx2(const float* xt, int64_t K, const float* panel, const float* bias, float* out,
                                    int64_t out_stride, int64_t valid) {
  __m256 acc[ROWS][2];
  for (int i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_loadu_ps(panel + k * kPanelCols);
    const __m256 w1 = _mm256_loadu_ps(panel + k * kPanelCols + 8);
    for (int i = 0; i < ROWS; ++i) {
      const __m256 xi = _mm256_set1_ps(xt[k * TILE + i]);
      acc[i][0] = _mm256_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  // Lanes below `valid`, as masks (a loop over them here would keep acc in memory, not registers).
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), count = _mm256_set1_epi32(static_cast<int>(valid));
  const __m256i low = _mm256_cmpgt_epi32(count, lane);
  const __m256i high = _mm256_cmpgt_epi32(count, _mm256_add_epi32(lane, _mm256_set1_epi32(8)));
  if (bias) {
    const __m256 b0 = _mm256_maskload_ps(bias, low), b1 = _mm256_maskload_ps(bias + 8, high);
    for (int i = 0; i < ROWS; ++i) {
      acc[i][0] = _mm256_add_ps(acc[i][0], b0);
      acc[i][1] = _mm256_add_ps(acc[i][1], b1);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    _mm256_maskstore_ps(out + i * out_stride, low, acc[i][0]);
    _mm256_maskstore_ps(out + i * out_stride + 8, high, acc[i][1]);
  }
}

template <int ROWS, int TILE>
SPECENGINE_AVX2 void tile_avx2(const float* xt, int64_t K, const float* panel, const float* bias, float* out,
                               int64_t out_stride, int64_t cols) {
  for (int64_t half = 0; half < cols; half += 16)
    half_tile_avx2<ROWS, TILE>(xt, K, panel + half, bias ? bias + half : nullptr, out + half, out_stride,
                               std::min<int64_t>(16, cols - half));
}

// ---- AVX-512 path: a whole panel (32 outputs, two 512-bit vectors) per tile of 8 rows ------------
// 16 accumulators, twice the FMAs two units with a 4-cycle latency need in flight. Per k, 10 loads
// (2 of the panel, 8 broadcasts) feed 16 FMAs. More rows a tile gain nothing once the FMA units
// are fed (measured: see bench/results/kernel-tuning-2026-11-29-to-12-03.md), and 8 divides the usual prompt lengths.

constexpr int kTileAvx512 = 8;

template <int ROWS, int TILE>
SPECENGINE_AVX512 void tile_avx512(const float* xt, int64_t K, const float* panel, const float* bias, float* out,
                                   int64_t out_stride, int64_t cols) {
  __m512 acc[ROWS][2];
  for (int i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * kPanelCols);
    const __m512 w1 = _mm512_loadu_ps(panel + k * kPanelCols + 16);
    for (int i = 0; i < ROWS; ++i) {
      const __m512 xi = _mm512_set1_ps(xt[k * TILE + i]);
      acc[i][0] = _mm512_fmadd_ps(xi, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(xi, w1, acc[i][1]);
    }
  }
  const __mmask16 low = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __mmask16 high = cols >= 32   ? __mmask16(0xFFFF)
                         : cols <= 16 ? __mmask16(0)
                                      : __mmask16((1u << (cols - 16)) - 1);
  if (bias) {
    const __m512 b0 = _mm512_maskz_loadu_ps(low, bias), b1 = _mm512_maskz_loadu_ps(high, bias + 16);
    for (int i = 0; i < ROWS; ++i) {
      acc[i][0] = _mm512_add_ps(acc[i][0], b0);
      acc[i][1] = _mm512_add_ps(acc[i][1], b1);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    _mm512_mask_storeu_ps(out + i * out_stride, low, acc[i][0]);
    _mm512_mask_storeu_ps(out + i * out_stride + 16, high, acc[i][1]);
  }
}
#endif  // SPECENGINE_X86

using Path = VectorPath;

Path choose_path() { return vector_path(use_avx512(), use_avx2()); }

int64_t tile_rows(Path path) {
  switch (path) {
    case Path::avx512: return kTileAvx512;
    case Path::avx2: return kTileAvx2;
    default: return kTilePortable;
  }
}

// Rows [0, ROWS) of one packed tile of TILE rows against a panel.
template <Path P, int ROWS, int TILE>
void tile(const float* xt, int64_t K, const float* panel, const float* bias, float* out, int64_t out_stride,
          int64_t cols) {
#ifdef SPECENGINE_X86
  if constexpr (P == Path::avx512) return tile_avx512<ROWS, TILE>(xt, K, panel, bias, out, out_stride, cols);
  if constexpr (P == Path::avx2) return tile_avx2<ROWS, TILE>(xt, K, panel, bias, out, out_stride, cols);
#endif
  if constexpr (P == Path::portable) return tile_portable<ROWS, TILE>(xt, K, panel, bias, out, out_stride, cols);
}

// The first `rows` (< TILE) rows of a tile: the tile of exactly that many rows.
template <Path P, int ROWS, int TILE>
void partial_tile(int64_t rows, const float* xt, int64_t K, const float* panel, const float* bias, float* out,
                  int64_t out_stride, int64_t cols) {
  if constexpr (ROWS > 0) {
    if (rows != ROWS) return partial_tile<P, ROWS - 1, TILE>(rows, xt, K, panel, bias, out, out_stride, cols);
    tile<P, ROWS, TILE>(xt, K, panel, bias, out, out_stride, cols);
  }
}

// Rows [r0, r1) of x (r0 a multiple of TILE; packed: x in tiles) against one panel, into out's
// rows [r0, r1), columns [0, cols).
template <Path P, int TILE>
void rows_against_panel(const float* packed, int64_t r0, int64_t r1, int64_t K, const float* panel, const float* bias,
                        float* out, int64_t out_stride, int64_t cols) {
  for (int64_t r = r0; r < r1; r += TILE) {
    const float* xt = packed + r * K;  // tile r / TILE: TILE rows of K
    if (r + TILE <= r1) {
      tile<P, TILE, TILE>(xt, K, panel, bias, out + r * out_stride, out_stride, cols);
    } else {
      partial_tile<P, TILE - 1, TILE>(r1 - r, xt, K, panel, bias, out + r * out_stride, out_stride, cols);
    }
  }
}

void run_rows(Path path, const float* packed, int64_t r0, int64_t r1, int64_t K, const float* panel,
              const float* bias, float* out, int64_t out_stride, int64_t cols) {
  switch (path) {
#ifdef SPECENGINE_X86
    case Path::avx512:
      return rows_against_panel<Path::avx512, kTileAvx512>(packed, r0, r1, K, panel, bias, out, out_stride, cols);
    case Path::avx2:
      return rows_against_panel<Path::avx2, kTileAvx2>(packed, r0, r1, K, panel, bias, out, out_stride, cols);
#endif
    default:
      return rows_against_panel<Path::portable, kTilePortable>(packed, r0, r1, K, panel, bias, out, out_stride, cols);
  }
}

// This thread's share [begin, end) of `units` units of work.
void thread_share(int64_t units, int64_t& begin, int64_t& end) {
#ifdef _OPENMP
  const int64_t threads = omp_get_num_threads(), id = omp_get_thread_num();
#else
  const int64_t threads = 1, id = 0;
#endif
  begin = units * id / threads;
  end = units * (id + 1) / threads;
}

int64_t team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// A float buffer of at least `count` floats starting on a 64-byte line.
float* aligned(std::vector<float>& storage, int64_t count) {
  if (storage.size() < static_cast<size_t>(count + 16)) storage.resize(static_cast<size_t>(count + 16));
  const uintptr_t address = reinterpret_cast<uintptr_t>(storage.data());
  return reinterpret_cast<float*>((address + 63) & ~uintptr_t{63});
}

}  // namespace

void gemm_blocks(const float* x, const Matrix& w, const float* bias, float* out, int64_t R, int64_t out_stride) {
  const int64_t K = w.in_features, N = w.out_features();
  if (R <= 0 || N <= 0) return;
  if (K == 0) {
    for (int64_t r = 0; r < R; ++r)
      for (int64_t n = 0; n < N; ++n) out[r * out_stride + n] = bias ? bias[n] : 0.f;
    return;
  }
  const Path path = choose_path();
  const int64_t rows_per_tile = tile_rows(path), tiles = (R + rows_per_tile - 1) / rows_per_tile;
  const int64_t panels = (N + kPanelCols - 1) / kPanelCols;
  thread_local std::vector<float> packed_storage;  // the calling thread's, shared with its team
  float* packed = aligned(packed_storage, tiles * rows_per_tile * K);
#pragma omp parallel if (R * K * N >= kParallelMultiplies)
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) pack_x_tile(x, R, K, rows_per_tile, t, packed);
    // Work items (row chunk, panel), chunk by chunk; chunks are whole tiles, and more of them than
    // x's size asks for where there are fewer panels than threads.
    const int64_t max_chunk_tiles = std::max<int64_t>(1, kChunkRows / rows_per_tile);
    const int64_t chunks = std::min(tiles, std::max((tiles + max_chunk_tiles - 1) / max_chunk_tiles,
                                                    (team_size() + panels - 1) / panels));
    const int64_t chunk_rows = (tiles + chunks - 1) / chunks * rows_per_tile;
    thread_local std::vector<float> rows_storage, panel_storage;
    float* rows = aligned(rows_storage, 16 * K);
    float* panel = aligned(panel_storage, kPanelCols * K);
    int64_t item_begin, item_end, filled = -1;
    thread_share(chunks * panels, item_begin, item_end);
    for (int64_t item = item_begin; item < item_end; ++item) {
      const int64_t chunk = item / panels, p = item % panels;
      const int64_t r0 = chunk * chunk_rows, r1 = std::min(R, r0 + chunk_rows);
      const int64_t n0 = p * kPanelCols, cols = std::min(kPanelCols, N - n0);
      if (r0 >= r1) continue;
      if (p != filled) {  // 16 rows at a time: their float32 weights stay in L1 for the transpose
        for (int64_t half = 0; half < kPanelCols; half += 16) {
          const int64_t half_cols = std::clamp<int64_t>(cols - half, 0, 16);
          dequantize_rows_serial(w, n0 + half, n0 + half + half_cols, rows);
#ifdef SPECENGINE_X86
          if (path == Path::avx512) {
            transpose_into_panel_avx512(rows, half_cols, K, panel, half);
            continue;
          }
          if (path == Path::avx2) {
            transpose_into_panel_avx2(rows, half_cols, K, panel, half);
            continue;
          }
#endif
          transpose_into_panel(rows, half_cols, K, panel, half);
        }
        filled = p;
      }
      run_rows(path, packed, r0, r1, K, panel, bias ? bias + n0 : nullptr, out + n0, out_stride, cols);
    }
  }
}

}  // namespace specengine
