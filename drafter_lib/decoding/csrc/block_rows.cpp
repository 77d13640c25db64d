// y[m, n] = sum_k x[m, k] * w[n, k] with w in one of llama.cpp's GGUF block formats, exactly as the file stores
// it, and each row of x quantized to int8 per block as llama.cpp quantizes activations (one float scale per block
// of 32 inputs for Q8_0 / Q4_1 weights, of 256 for Q4_K / Q6_K).
//
// The weight arrays are the file's blocks split into their fields (block_rows.py `from_gguf`), nothing rounded:
//   Q8_0: q int8 [N, K], d [N, K/32]                          w = d * q
//   Q4_1: q uint8 [N, K/2] (per 32: low nibbles 0..15, high 16..31), d, m [N, K/32]      w = d * q + m
//   Q4_K: q uint8 [N, K/2] (per 64: low nibbles 0..31, high 32..63), sc, mn uint8 [N, K/32], d, dmin [N, K/256]
//                                                               w = d * sc * q - dmin * mn
//   Q6_K: q uint8 [N, K/2] (low nibbles), mn uint8 [N, K/4] (top bit pairs), sc int8 [N, K/16], d [N, K/256]
//         as the file packs them per 128 inputs: value 32i + j = nibble i / 2 of q[32 (i % 2) + j] | bit pair i of
//         mn[j] << 4 (q6_value)                                                          w = d * sc * (value - 32)
// Q8_0 and Q4_1 are multiplied here output by output (`block_rows_mm`); Q4_K and Q6_K are repacked once into tiles
// of 16 outputs and multiplied by `block_tiles_mm` (block_tiles.h).
//
// Exact by construction, and the same bits on every path. Integer products are summed in int32 lanes: lane l of a
// 32-input block holds the sum of inputs 4l..4l+3 (what vpdpbusd, and vpmaddubsw + vpmaddwd, give); integer sums
// are exact in any order. The floats then follow one fixed recipe per (row, output): per block, acc[l] +=
// (d_w * d_a) * float(lane l), in eight lanes, block after block (Q4_1 adds a scalar term per block for its
// minima); at the end a fixed sum of the eight lanes. Every path (portable C++, AVX2, AVX-VNNI, AVX-512 VNNI) runs
// that recipe with the same operations (no FMA: built with -ffp-contract=off), and a row's arithmetic never depends
// on the other rows, the tile, or the thread: a row's output is bit-identical alone or inside a pass of any number
// of rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

enum Format : int64_t { Q8_0 = 0, Q4_1 = 1, Q4_K = 2, Q6_K = 3 };
enum Path : int64_t { AUTO = 0, PORTABLE = 1, AVX2 = 2, AVX_VNNI = 3, AVX512_VNNI = 4 };
constexpr int MB = 4;  // rows per tile: their accumulators and one chunk of weights fit the vector registers

int64_t act_block(int64_t format) { return format == Q4_K || format == Q6_K ? 256 : 32; }

// One row's activations: int8 a [K], one scale per block, integer sums per 16 and per 32 inputs (int16: at most
// 32 * 127 in magnitude, so the vector paths multiply them with vpmaddwd); for Q4_1 the block's d_a * sum(a) (its
// minimum term).
struct Rows {
  int64_t M, K, B;
  std::vector<int8_t> a;
  std::vector<float> d, sa;
  std::vector<int16_t> s16, s32;
  const int8_t* arow(int64_t m) const { return a.data() + m * K; }
  const float* drow(int64_t m) const { return d.data() + m * (K / B); }
  const float* sarow(int64_t m) const { return sa.data() + m * (K / 32); }
  const int16_t* s16row(int64_t m) const { return s16.data() + m * (K / 16); }
  const int16_t* s32row(int64_t m) const { return s32.data() + m * (K / 32); }
};

Rows quantize_rows(const float* x, int64_t M, int64_t K, int64_t B) {
  Rows r{M, K, B, std::vector<int8_t>(M * K), std::vector<float>(M * (K / B)), std::vector<float>(M * (K / 32)),
         std::vector<int16_t>(M * (K / 16)), std::vector<int16_t>(M * (K / 32))};
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    int8_t* ar = r.a.data() + m * K;
    for (int64_t b = 0; b < K / B; ++b) {
      float amax = 0.f;
      for (int64_t i = 0; i < B; ++i) amax = std::max(amax, std::fabs(xr[b * B + i]));
      const float d = amax / 127.f;
      const float id = d > 0.f ? 1.f / d : 0.f;
      for (int64_t i = 0; i < B; ++i) {
        const float v = std::nearbyint(xr[b * B + i] * id);  // half to even
        ar[b * B + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
      }
      r.d[m * (K / B) + b] = d;
    }
    for (int64_t g = 0; g < K / 16; ++g) {
      int32_t s = 0;
      for (int64_t i = 0; i < 16; ++i) s += ar[g * 16 + i];
      r.s16[m * (K / 16) + g] = static_cast<int16_t>(s);
    }
    for (int64_t b = 0; b < K / 32; ++b) {
      r.s32[m * (K / 32) + b] = static_cast<int16_t>(r.s16[m * (K / 16) + 2 * b] + r.s16[m * (K / 16) + 2 * b + 1]);
      // only Q4_1 reads sa: its blocks are 32 inputs, as its scales
      r.sa[m * (K / 32) + b] = r.d[m * (K / B) + b * 32 / B] * static_cast<float>(r.s32[m * (K / 32) + b]);
    }
  }
  return r;
}

// The fixed end of the recipe: the eight lanes summed pairwise, then the scalar term.
inline float finish(const float* acc, float scalar) {
  return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + scalar;
}

struct Weight {
  int64_t format, N, K;
  const uint8_t* q;
  const uint8_t* sc;
  const uint8_t* mn;
  const float* d;
  const float* dm;
};

// Q6_K's value 32i + j of a half super-block (ql: its 64 bytes of low nibbles, qh: its 32 bytes of top bit pairs)
inline uint8_t q6_value(const uint8_t* ql, const uint8_t* qh, int i, int j) {
  const uint8_t low = i < 2 ? ql[32 * (i % 2) + j] & 0x0F : ql[32 * (i % 2) + j] >> 4;
  return static_cast<uint8_t>(low | (((qh[j] >> (2 * i)) & 3) << 4));
}

// ------------------------------------------------------------------------------------------- the portable path
namespace portable {

inline void lanes(const uint8_t* u, const int8_t* a, int32_t* out) {
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += static_cast<int32_t>(u[4 * l + i]) * a[4 * l + i];
    out[l] += s;
  }
}

void row_dot(const Weight& w, int64_t n, const Rows& r, int64_t m, float* y) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  float scalar = 0.f;
  const int8_t* a = r.arow(m);
  const int64_t K = w.K;
  if (w.format == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + n * K;
    for (int64_t b = 0; b < K / 32; ++b) {
      uint8_t u[32];
      int8_t s[32];
      for (int i = 0; i < 32; ++i) {  // |w| times a with w's sign: the vector paths' unsigned x signed form
        const int8_t wi = q[b * 32 + i], ai = a[b * 32 + i];
        u[i] = static_cast<uint8_t>(wi < 0 ? -wi : wi);
        s[i] = static_cast<int8_t>(wi < 0 ? -ai : (wi == 0 ? 0 : ai));
      }
      int32_t L[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      lanes(u, s, L);
      const float D = w.d[n * (K / 32) + b] * r.drow(m)[b];
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] + D * static_cast<float>(L[l]);
    }
  } else if (w.format == Q4_1) {
    const uint8_t* q = w.q + n * (K / 2);
    for (int64_t b = 0; b < K / 32; ++b) {
      uint8_t u[32];
      for (int i = 0; i < 16; ++i) {
        u[i] = q[b * 16 + i] & 0x0F;
        u[16 + i] = q[b * 16 + i] >> 4;
      }
      int32_t L[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      lanes(u, a + b * 32, L);
      const float D = w.d[n * (K / 32) + b] * r.drow(m)[b];
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] + D * static_cast<float>(L[l]);
      scalar = scalar + w.dm[n * (K / 32) + b] * r.sarow(m)[b];
    }
  }
  *y = finish(acc, scalar);
}

void run(const Weight& w, const Rows& r, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < r.M; ++m) row_dot(w, n, r, m, y + m * w.N + n);
}

}  // namespace portable

#include "block_tiles.h"

// ------------------------------------------------------------------------------------------- the vector paths
// The rows' body (block_rows_simd.h) and the tiles' (block_tiles_simd.h, block_tiles_wide.h for AVX-512), compiled
// once per instruction set; DOT(u, a) gives the eight int32 lanes of unsigned u times signed a, DPBUSD adds them to
// an accumulator, DPWSSD adds int16 pairs' products. vpmaddubsw's int16 pairs never saturate here (|u a + u a| <=
// 2 * 128 * 127 < 2^15: |q| <= 128 for Q8_0, q <= 63 otherwise, |a| <= 127), and every sum is exact int32.
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace avx2 {
inline __m256i DOT(__m256i u, __m256i a) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)); }
inline __m256i DPBUSD(__m256i acc, __m256i u, __m256i a) { return _mm256_add_epi32(acc, DOT(u, a)); }
inline __m256i DPWSSD(__m256i acc, __m256i x, __m256i y) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, y)); }
#include "block_rows_simd.h"
#include "block_tiles_simd.h"
}  // namespace avx2
#pragma GCC pop_options

// With VNNI, vpdpbusd sums u x a into the lanes in one step, and vpdpwssd scales the int16 pairs and adds them.
#pragma GCC push_options
#pragma GCC target("avx2,f16c,avxvnni")
namespace avx_vnni {
inline __m256i DOT(__m256i u, __m256i a) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, a); }
inline __m256i DPBUSD(__m256i acc, __m256i u, __m256i a) { return _mm256_dpbusd_avx_epi32(acc, u, a); }
inline __m256i DPWSSD(__m256i acc, __m256i x, __m256i y) { return _mm256_dpwssd_avx_epi32(acc, x, y); }
#include "block_rows_simd.h"
#include "block_tiles_simd.h"
}  // namespace avx_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")
namespace avx512_vnni {
inline __m256i DOT(__m256i u, __m256i a) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a); }
#include "block_rows_simd.h"
#include "block_tiles_wide.h"
}  // namespace avx512_vnni
#pragma GCC pop_options

bool cpu_has(int64_t path) {
  __builtin_cpu_init();
  switch (path) {
    case PORTABLE: return true;
    case AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case AVX_VNNI: return cpu_has(AVX2) && __builtin_cpu_supports("avxvnni");
    case AVX512_VNNI:
      return cpu_has(AVX2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

int64_t best_path() {
  for (int64_t p : {AVX512_VNNI, AVX_VNNI, AVX2})
    if (cpu_has(p)) return p;
  return PORTABLE;
}

at::Tensor block_rows_mm(const at::Tensor& x, int64_t format, const at::Tensor& q, const at::Tensor& sc,
                         const at::Tensor& mn, const at::Tensor& d, const at::Tensor& dm, int64_t path) {
  TORCH_CHECK(format == Q8_0 || format == Q4_1, "block_rows_mm: takes Q8_0 and Q4_1 (Q4_K and Q6_K: block_tiles_mm), "
              "got format ", format);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "block_rows_mm: x must be fp32 [M, K]");
  TORCH_CHECK(q.scalar_type() == (format == Q8_0 ? at::kChar : at::kByte) && q.dim() == 2 && q.is_contiguous(),
              "block_rows_mm: q has the wrong dtype or layout");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), B = act_block(format);
  TORCH_CHECK(K % B == 0 && q.size(1) == (format == Q8_0 ? K : K / 2), "block_rows_mm: K = ", K,
              " does not fit the weight ", q.sizes());
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == N * (K / 32),
              "block_rows_mm: d has the wrong dtype or size");
  if (format == Q4_1)
    TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.is_contiguous() && dm.numel() == d.numel(),
                "block_rows_mm: dm must be fp32 like d");
  if (path == AUTO) path = best_path();
  TORCH_CHECK(cpu_has(path), "block_rows_mm: this CPU cannot run path ", path);
  const auto xc = x.contiguous();
  const Rows r = quantize_rows(xc.data_ptr<float>(), M, K, B);
  Weight w{format, N, K, static_cast<const uint8_t*>(q.data_ptr()),  // Q8_0's int8 values are read as int8
           sc.numel() ? static_cast<const uint8_t*>(sc.data_ptr()) : nullptr,
           mn.numel() ? mn.data_ptr<uint8_t>() : nullptr, d.data_ptr<float>(),
           dm.numel() ? dm.data_ptr<float>() : nullptr};
  auto y = at::empty({M, N}, xc.options());
  float* yp = y.data_ptr<float>();
  // the threads split the outputs; an output's weights are read from memory once and stay in L1 over its row tiles
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    switch (path) {
      case AVX2: return avx2::run(w, r, n0, n1, yp);
      case AVX_VNNI: return avx_vnni::run(w, r, n0, n1, yp);
      case AVX512_VNNI: return avx512_vnni::run(w, r, n0, n1, yp);
      default: return portable::run(w, r, n0, n1, yp);
    }
  });
  return y;
}

Weight k_quant_weight(int64_t format, const at::Tensor& q, const at::Tensor& sc, const at::Tensor& mn,
                      const at::Tensor& d, const at::Tensor& dm) {
  TORCH_CHECK(format == Q4_K || format == Q6_K, "block_tiles: only Q4_K and Q6_K are tiled, got format ", format);
  const int64_t N = q.size(0), K = q.size(1) * 2;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && K % 256 == 0,
              "block_tiles: q must be uint8 [N, K/2], K a multiple of 256");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == N * (K / 256),
              "block_tiles: d must be fp32 [N, K/256]");
  if (format == Q4_K) {
    TORCH_CHECK(sc.scalar_type() == at::kByte && mn.scalar_type() == at::kByte && sc.numel() == N * (K / 32) &&
                    mn.numel() == N * (K / 32) && sc.is_contiguous() && mn.is_contiguous() &&
                    dm.scalar_type() == at::kFloat && dm.is_contiguous() && dm.numel() == d.numel(),
                "block_tiles: Q4_K's sc, mn must be uint8 [N, K/32] and dm fp32 like d");
  } else {
    TORCH_CHECK(sc.scalar_type() == at::kChar && sc.is_contiguous() && sc.numel() == N * (K / 16) &&
                    mn.scalar_type() == at::kByte && mn.is_contiguous() && mn.numel() == N * (K / 4),
                "block_tiles: Q6_K's sc must be int8 [N, K/16] and its top bits mn uint8 [N, K/4]");
  }
  return Weight{format, N, K, q.data_ptr<uint8_t>(), static_cast<const uint8_t*>(sc.data_ptr()),
                mn.data_ptr<uint8_t>(), d.data_ptr<float>(), format == Q4_K ? dm.data_ptr<float>() : nullptr};
}

at::Tensor block_tiles_pack(int64_t format, const at::Tensor& q, const at::Tensor& sc, const at::Tensor& mn,
                            const at::Tensor& d, const at::Tensor& dm) {
  const Weight w = k_quant_weight(format, q, sc, mn, d, dm);
  auto out = at::empty({(w.N + NT - 1) / NT, w.K / 256, tile_bytes(format)}, q.options());
  pack_tiles(w, out.data_ptr<uint8_t>());
  return out;
}

at::Tensor block_tiles_mm(const at::Tensor& x, int64_t format, const at::Tensor& packed, int64_t N, int64_t path) {
  TORCH_CHECK(format == Q4_K || format == Q6_K, "block_tiles_mm: only Q4_K and Q6_K are tiled, got format ", format);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "block_tiles_mm: x must be fp32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), tiles = (N + NT - 1) / NT;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(0) == tiles && packed.size(1) * 256 == K && packed.size(2) == tile_bytes(format),
              "block_tiles_mm: the packed weight ", packed.sizes(), " does not fit N = ", N, ", K = ", K);
  if (path == AUTO) path = best_path();
  TORCH_CHECK(cpu_has(path), "block_tiles_mm: this CPU cannot run path ", path);
  const auto xc = x.contiguous();
  const Rows r = quantize_rows(xc.data_ptr<float>(), M, K, act_block(format));
  auto y = at::empty({M, N}, xc.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    switch (path) {
      case AVX2: return avx2::run_tiles(format, pp, N, K, r, t0, t1, yp);
      case AVX_VNNI: return avx_vnni::run_tiles(format, pp, N, K, r, t0, t1, yp);
      case AVX512_VNNI: return avx512_vnni::run_tiles(format, pp, N, K, r, t0, t1, yp);
      default: return portable::run_tiles(format, pp, N, K, r, t0, t1, yp);
    }
  });
  return y;
}

}  // namespace

// the schemas are defined in block_rows.py; these are their CPU kernels
TORCH_LIBRARY_IMPL(specdraft, CPU, m) {
  m.impl("block_rows_mm", block_rows_mm);
  m.impl("block_tiles_mm", block_tiles_mm);
  m.impl("block_tiles_pack", block_tiles_pack);
}
