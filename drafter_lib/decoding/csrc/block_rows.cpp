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
//
// Exact by construction, and the same bits on every path. Integer products are summed in int32 lanes: lane l of a
// 32-input chunk holds the sum of inputs 4l..4l+3 (what vpdpbusd, and vpmaddubsw + vpmaddwd, give), times the
// chunk's integer sub-scale; integer sums are exact in any order. The floats then follow one fixed recipe per
// (row, output): per block, acc[l] += (d_w * d_a) * float(lane l), in eight lanes, block after block (Q4_K then
// acc[l] -= (dmin_w * d_a) * float(minima lane l), its minima's integer term in lanes too: lane l < 4 holds groups
// 2l and 2l + 1, what one vpmaddwd gives; Q4_1 adds a scalar term per block); at the end a fixed sum of the eight
// lanes. Q6_K's -32 is an integer term of its own lanes (lane l: groups 2l and 2l + 1). Every path (portable C++, AVX2,
// AVX-VNNI, AVX-512 VNNI) runs that recipe with the same operations (no FMA: built with -ffp-contract=off), and a
// row's arithmetic never depends on the other rows, the tile, or the thread: a row's output is bit-identical alone
// or inside a pass of any number of rows.
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
  std::vector<int8_t> a128;  // a per 128 inputs in the order 0-31, 64-95, 32-63, 96-127 (AVX-512 Q4_K tiles only)
  const int8_t* arow(int64_t m) const { return a.data() + m * K; }
  const float* drow(int64_t m) const { return d.data() + m * (K / B); }
  const float* sarow(int64_t m) const { return sa.data() + m * (K / 32); }
  const int16_t* s16row(int64_t m) const { return s16.data() + m * (K / 16); }
  const int16_t* s32row(int64_t m) const { return s32.data() + m * (K / 32); }
  const int8_t* a128row(int64_t m) const { return a128.data() + m * K; }
};

// Rows::a128: the inputs in the order in which one 64-byte load of a Q4_K row's nibbles lays them out (two chunks'
// low nibbles, then their high nibbles). Blocks of 32 move whole, so an input keeps its lane (i mod 32) / 4.
void order_by_128(Rows& r) {
  r.a128.resize(r.a.size());
  for (int64_t j = 0; j < r.M * r.K; j += 128)
    for (int h = 0; h < 4; ++h) std::memcpy(&r.a128[j + 32 * h], &r.a[j + 32 * ((h & 1) * 2 + (h >> 1))], 32);
}

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

// The four int32 lanes' sum (integers: any order gives the same value).
inline int32_t hsum4(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1)));
}

// Q6_K's value 32i + j of a half super-block (ql: its 64 bytes of low nibbles, qh: its 32 bytes of top bit pairs)
inline uint8_t q6_value(const uint8_t* ql, const uint8_t* qh, int i, int j) {
  const uint8_t low = i < 2 ? ql[32 * (i % 2) + j] & 0x0F : ql[32 * (i % 2) + j] >> 4;
  return static_cast<uint8_t>(low | (((qh[j] >> (2 * i)) & 3) << 4));
}

// ------------------------------------------------------------------------------------------- the portable path
namespace portable {

inline void lanes(const uint8_t* u, const int8_t* a, int32_t* out, int32_t scale_lo, int32_t scale_hi) {
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) s += static_cast<int32_t>(u[4 * l + i]) * a[4 * l + i];
    out[l] += s * (l < 4 ? scale_lo : scale_hi);
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
      lanes(u, s, L, 1, 1);
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
      lanes(u, a + b * 32, L, 1, 1);
      const float D = w.d[n * (K / 32) + b] * r.drow(m)[b];
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] + D * static_cast<float>(L[l]);
      scalar = scalar + w.dm[n * (K / 32) + b] * r.sarow(m)[b];
    }
  } else if (w.format == Q4_K) {
    const uint8_t* q = w.q + n * (K / 2);
    const uint8_t* sc = w.sc + n * (K / 32);
    const uint8_t* mn = w.mn + n * (K / 32);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      int32_t L[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int c = 0; c < 4; ++c) {
        uint8_t lo[32], hi[32];
        for (int i = 0; i < 32; ++i) {
          lo[i] = q[sb * 128 + c * 32 + i] & 0x0F;
          hi[i] = q[sb * 128 + c * 32 + i] >> 4;
        }
        const int g = static_cast<int>(sb * 8 + 2 * c);
        lanes(lo, a + sb * 256 + c * 64, L, sc[g], sc[g]);
        lanes(hi, a + sb * 256 + c * 64 + 32, L, sc[g + 1], sc[g + 1]);
      }
      int32_t mins[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // lane l < 4: groups 2l and 2l + 1
      for (int g = 0; g < 8; ++g) mins[g / 2] += static_cast<int32_t>(mn[sb * 8 + g]) * r.s32row(m)[sb * 8 + g];
      const float da = r.drow(m)[sb];
      const float D = w.d[n * (K / 256) + sb] * da, Dmin = w.dm[n * (K / 256) + sb] * da;
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] + D * static_cast<float>(L[l]);
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] - Dmin * static_cast<float>(mins[l]);
    }
  } else {  // Q6_K
    const uint8_t* ql = w.q + n * (K / 2);
    const uint8_t* qh = w.mn + n * (K / 4);
    const int8_t* sc = reinterpret_cast<const int8_t*>(w.sc) + n * (K / 16);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      int32_t L[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int c = 0; c < 8; ++c) {
        uint8_t u[32];
        for (int j = 0; j < 32; ++j)
          u[j] = q6_value(ql + sb * 128 + (c / 4) * 64, qh + sb * 64 + (c / 4) * 32, c % 4, j);
        lanes(u, a + sb * 256 + c * 32, L, sc[sb * 16 + 2 * c], sc[sb * 16 + 2 * c + 1]);
      }
      // the -32 of every value, through the activations' sums per 16: lane l takes groups 2l and 2l + 1
      for (int g = 0; g < 16; ++g) L[g / 2] -= 32 * (static_cast<int32_t>(sc[sb * 16 + g]) * r.s16row(m)[sb * 16 + g]);
      const float D = w.d[n * (K / 256) + sb] * r.drow(m)[sb];
      for (int l = 0; l < 8; ++l) acc[l] = acc[l] + D * static_cast<float>(L[l]);
    }
  }
  *y = finish(acc, scalar);
}

void run(const Weight& w, const Rows& r, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = 0; m < r.M; ++m) row_dot(w, n, r, m, y + m * w.N + n);
}

}  // namespace portable

// ------------------------------------------------------------------------------------------- the vector paths
// One body (block_rows_simd.h), compiled once per instruction set; DOT(u, a) gives the eight int32 lanes of
// unsigned u times signed a, SCALED_ADD(acc, u, a, s) adds to acc the same lanes times the lanes' int16 scales s
// (scale_lanes: one for lanes 0-3, one for 4-7). vpmaddubsw's int16 pairs never saturate here (|u a + u a| <=
// 2 * 128 * 127 < 2^15: |q| <= 128 for Q8_0, q <= 63 otherwise, |a| <= 127), and the scaled sums are exact int32.
#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
inline __m256i scale_lanes(int32_t lo, int32_t hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)), _mm_set1_epi16(static_cast<int16_t>(lo)));
}
inline __m256i DOT(__m256i u, __m256i a) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)); }
inline __m256i SCALED_ADD(__m256i acc, __m256i u, __m256i a, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), s));
}
#include "block_rows_simd.h"
}  // namespace avx2
#pragma GCC pop_options

// With VNNI, vpdpbusd sums u x a into the lanes in one step, and vpdpwssd scales the int16 pairs and adds them.
#pragma GCC push_options
#pragma GCC target("avx2,avxvnni")
namespace avx_vnni {
inline __m256i scale_lanes(int32_t lo, int32_t hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)), _mm_set1_epi16(static_cast<int16_t>(lo)));
}
inline __m256i DOT(__m256i u, __m256i a) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, a); }
inline __m256i SCALED_ADD(__m256i acc, __m256i u, __m256i a, __m256i s) {
  return _mm256_dpwssd_avx_epi32(acc, _mm256_maddubs_epi16(u, a), s);
}
#include "block_rows_simd.h"
}  // namespace avx_vnni
#pragma GCC pop_options

// AVX-512 also multiplies the K formats 64 inputs at a time (block_rows_wide.h): half the instructions a weight.
#pragma GCC push_options
#pragma GCC target("avx2,avx512f,avx512bw,avx512vl,avx512vnni")
namespace avx512_vnni {
inline __m256i scale_lanes(int32_t lo, int32_t hi) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(hi)), _mm_set1_epi16(static_cast<int16_t>(lo)));
}
inline __m256i DOT(__m256i u, __m256i a) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, a); }
inline __m256i SCALED_ADD(__m256i acc, __m256i u, __m256i a, __m256i s) {
  return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, a), s);
}
#define WIDE_TILES
#include "block_rows_simd.h"
#include "block_rows_wide.h"
#undef WIDE_TILES
}  // namespace avx512_vnni
#pragma GCC pop_options

bool cpu_has(int64_t path) {
  __builtin_cpu_init();
  switch (path) {
    case PORTABLE: return true;
    case AVX2: return __builtin_cpu_supports("avx2");
    case AVX_VNNI: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avxvnni");
    case AVX512_VNNI:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
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
  TORCH_CHECK(format >= Q8_0 && format <= Q6_K, "block_rows_mm: unknown format ", format);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "block_rows_mm: x must be fp32 [M, K]");
  TORCH_CHECK(q.scalar_type() == (format == Q8_0 ? at::kChar : at::kByte) && q.dim() == 2 && q.is_contiguous(),
              "block_rows_mm: q has the wrong dtype or layout");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), B = act_block(format);
  const int64_t qcols = format == Q8_0 ? K : K / 2;
  TORCH_CHECK(K % B == 0 && q.size(1) == qcols, "block_rows_mm: K = ", K, " does not fit the weight ", q.sizes());
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == N * (K / (format >= Q4_K ? 256 : 32)),
              "block_rows_mm: d has the wrong dtype or size");
  if (format == Q4_1 || format == Q4_K)
    TORCH_CHECK(dm.scalar_type() == at::kFloat && dm.is_contiguous() && dm.numel() == d.numel(),
                "block_rows_mm: dm must be fp32 like d");
  if (format == Q4_K)
    TORCH_CHECK(sc.scalar_type() == at::kByte && mn.scalar_type() == at::kByte && sc.is_contiguous() &&
                    mn.is_contiguous() && sc.numel() == N * (K / 32) && mn.numel() == N * (K / 32),
                "block_rows_mm: Q4_K's sc and mn must be uint8 [N, K / 32]");
  if (format == Q6_K)
    TORCH_CHECK(sc.scalar_type() == at::kChar && sc.is_contiguous() && sc.numel() == N * (K / 16) &&
                    mn.scalar_type() == at::kByte && mn.is_contiguous() && mn.numel() == N * (K / 4),
                "block_rows_mm: Q6_K's sc must be int8 [N, K / 16] and its top bits mn uint8 [N, K / 4]");
  if (path == AUTO) path = best_path();
  TORCH_CHECK(cpu_has(path), "block_rows_mm: this CPU cannot run path ", path);
  const auto xc = x.contiguous();
  Rows r = quantize_rows(xc.data_ptr<float>(), M, K, B);
  if (path == AVX512_VNNI && format == Q4_K) order_by_128(r);
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

}  // namespace

// the schema is defined in block_rows.py; this is its CPU kernel
TORCH_LIBRARY_IMPL(specdraft, CPU, m) { m.impl("block_rows_mm", block_rows_mm); }
