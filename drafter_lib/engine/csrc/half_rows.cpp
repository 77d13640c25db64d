// y[m, o] = scale[o] * sum_k x[m, k] * float(w[o, k]): fp32 rows times an fp16 weight, for the engine's short steps.
//
// The weight comes blocked (half_rows.py `block_rows`): blocks of 8 output rows, each stored as K/8 chunks of
// [8 rows][8 values], so one block is one contiguous stream however many of its rows a tile reads at once.
// Each output (m, o) has its own 8-lane accumulator that runs over k in one fixed order, then one fixed horizontal
// sum, then the scalar tail, whatever tile computes it and however many rows share the call: a row's result is
// bit-identical alone or batched. K is walked in panels, the accumulators kept in a small buffer between them (an
// exact store and load, so the same order), so up to 8 activation rows and the block's panel stay in L1 however
// long K is. A block is read from memory once per call, so a call of 8 rows costs little more than one.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t R = 8;        // output rows per block, values per chunk, most activation rows per pass
constexpr int64_t PANEL = 256;  // values of k per panel from 2 rows on: 8 rows of x (8 KB), the block's panel (4 KB)
constexpr int64_t PREFETCH = 16;  // chunks ahead: a tile reads 16 of every 128 weight bytes, which the hardware
                                  // prefetcher follows poorly (8 rows: 6.7 -> 3.9 ms over 16 drafter weights)

// MB activation rows x OB output rows [r0, r0 + OB) of one block, over k in [k0, k1); acc[m][r] holds 8 lanes
template <int MB, int OB>
inline void tile(const float* x, int64_t K, int64_t k0, int64_t k1, const at::Half* blk, int64_t r0, float* acc) {
  __m256 a[MB][OB];  // the first panel starts from zero, later ones from where the last left off
  for (int m = 0; m < MB; ++m)
    for (int o = 0; o < OB; ++o) a[m][o] = k0 == 0 ? _mm256_setzero_ps() : _mm256_load_ps(acc + (m * R + r0 + o) * R);
  for (int64_t k = k0; k < k1; k += R) {
    const at::Half* chunk = blk + k * R + r0 * R;  // chunk k / 8 starts at (k / 8) * 64
    if (r0 == 0) {  // the first tile over a panel pulls the block from memory: ask for both lines PREFETCH ahead
      const char* ahead = reinterpret_cast<const char*>(blk + (k + PREFETCH * R) * R);
      _mm_prefetch(ahead, _MM_HINT_T0);
      _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    __m256 wv[OB];
    for (int o = 0; o < OB; ++o)
      wv[o] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + o * R)));
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int o = 0; o < OB; ++o) a[m][o] = _mm256_fmadd_ps(xv, wv[o], a[m][o]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int o = 0; o < OB; ++o) _mm256_store_ps(acc + (m * R + r0 + o) * R, a[m][o]);
}

// up to 8 activation rows against one block: panels of k, and per panel as many of the block's rows per tile as
// keep ~8 accumulators in registers; then each output's horizontal sum, tail and scale
template <int MB>
void rows_against(const float* x, int64_t K, const at::Half* blk, const float* scale, float* y, int64_t N,
                  int64_t nvalid) {
  constexpr int OB = MB == 1 ? 8 : MB == 2 ? 4 : 2;  // MB > 4 splits (below)
  alignas(32) float acc[MB * R * R];  // written by the first panel of every tile before any read
  const int64_t K8 = K / R * R;
  const int64_t panel = MB == 1 ? std::max<int64_t>(K8, R) : PANEL;  // one row of x fits L1 whole
  for (int64_t k0 = 0; k0 < K8; k0 += panel) {
    const int64_t k1 = std::min(k0 + panel, K8);
    if constexpr (MB > 4) {  // two passes over the panel (in L1): 4 rows x 2 outputs, then the rest, each reusing
      constexpr int MB2 = MB - 4, OB2 = MB2 == 1 ? 8 : MB2 == 2 ? 4 : 2;  // a loaded x or weight vector 2-8 times
      for (int64_t r0 = 0; r0 < R && r0 < nvalid; r0 += 2) tile<4, 2>(x, K, k0, k1, blk, r0, acc);
      for (int64_t r0 = 0; r0 < R && r0 < nvalid; r0 += OB2)
        tile<MB2, OB2>(x + 4 * K, K, k0, k1, blk, r0, acc + 4 * R * R);
    } else {
      for (int64_t r0 = 0; r0 < R && r0 < nvalid; r0 += OB) tile<MB, OB>(x, K, k0, k1, blk, r0, acc);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int64_t r = 0; r < nvalid; ++r) {
      const __m256 v = K8 ? _mm256_load_ps(acc + (m * R + r) * R) : _mm256_setzero_ps();  // K < 8: only a tail
      __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      float sum = _mm_cvtss_f32(s);
      const at::Half* tail = blk + K8 * R + r * R;  // the zero-padded last chunk
      for (int64_t t = K8; t < K; ++t) sum += x[m * K + t] * static_cast<float>(tail[t - K8]);
      y[m * N + r] = sum * scale[r];
    }
}

void chunk_against(int64_t mb, const float* x, int64_t K, const at::Half* blk, const float* scale, float* y,
                   int64_t N, int64_t nvalid) {
  switch (mb) {
    case 1: return rows_against<1>(x, K, blk, scale, y, N, nvalid);
    case 2: return rows_against<2>(x, K, blk, scale, y, N, nvalid);
    case 3: return rows_against<3>(x, K, blk, scale, y, N, nvalid);
    case 4: return rows_against<4>(x, K, blk, scale, y, N, nvalid);
    case 5: return rows_against<5>(x, K, blk, scale, y, N, nvalid);
    case 6: return rows_against<6>(x, K, blk, scale, y, N, nvalid);
    case 7: return rows_against<7>(x, K, blk, scale, y, N, nvalid);
    default: return rows_against<8>(x, K, blk, scale, y, N, nvalid);
  }
}

at::Tensor half_rows_mm(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && blocks.scalar_type() == at::kHalf && scale.scalar_type() == at::kFloat,
              "half_rows_mm: x fp32, blocks fp16, scale fp32");
  const int64_t N = scale.numel(), K = x.dim() == 2 ? x.size(1) : -1;
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 4 && blocks.size(0) == (N + R - 1) / R &&
                  blocks.size(1) == (K + R - 1) / R && blocks.size(2) == R && blocks.size(3) == R,
              "half_rows_mm: x [M, K], blocks [ceil(N/8), ceil(K/8), 8, 8], scale [N]");
  const auto xc = x.contiguous(), bc = blocks.contiguous(), sc = scale.contiguous();
  const int64_t M = xc.size(0), NB = bc.size(0), block = bc.size(1) * R * R;
  auto y = at::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const at::Half* bp = bc.data_ptr<at::Half>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // the threads split the blocks; each block is read once per pass of up to 8 activation rows
  at::parallel_for(0, NB, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m = 0; m < M; m += R)
        chunk_against(std::min<int64_t>(R, M - m), xp + m * K, K, bp + b * block, sp + b * R, yp + m * N + b * R,
                      N, std::min<int64_t>(R, N - b * R));
  });
  return y;
}

}  // namespace

// the schema is defined in half_rows.py (with its shape function for tracing); this is its CPU kernel
TORCH_LIBRARY_IMPL(specdraft, CPU, m) { m.impl("half_rows_mm", half_rows_mm); }
