// y[m, n] = sum_k x[m, k] * w[n, k] with w in 4 bits and each row of x in 8 bits by its own scale, summed in int32.
//
// The weight (w4a8.py `quantize_weight`): super-blocks of 256 inputs, each 8 groups of 32; in group j of a
// super-block w = d * sc[j] * u - dmin * mn[j], u in [0, 15], sc and mn in [0, 255], d and dmin fp32.
// qs holds two groups in 32 bytes: byte i has group 2p's value i in its low nibble, group 2p + 1's in its high one.
// Each row m is quantized here: a = round(x * 127 / max|x|) (half to even), and asum[m][g], the sum of group g's a.
//
// For one output and one row: sum_k w a = sum_sb d * (sum_j sc[j] * sum_i u a) - dmin * (sum_j mn[j] * asum[j]).
// Both inner sums are exact integers (u a pairs <= 2 * 15 * 127 fit vpmaddubsw's int16 without saturation, on AVX2
// as with VNNI; a super-block's sums stay below 2^24). The floats are then added in one fixed order per (row,
// output), whatever tile or thread computes them and however many rows share the call: a row's result is
// bit-identical alone or inside a pass of any number of rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t SB = 256;  // inputs per super-block
constexpr int64_t G = 32;    // inputs per group
constexpr int MB = 4;        // rows per tile: their accumulators and the output's unpacked weights fit 16 registers

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hsum4(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// row m of x [M, K] into int8 a [Kp] (zero past K), its group sums [Kp / 32] and its scale
void quantize_row(const float* x, int64_t K, int64_t Kp, int8_t* a, int16_t* asum, float* scale) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = std::max(amax, 1e-12f) / 127.f;
  const float inv = 1.f / s;
  for (int64_t k = 0; k < K; ++k) a[k] = static_cast<int8_t>(std::nearbyint(x[k] * inv));  // half to even
  for (int64_t k = K; k < Kp; ++k) a[k] = 0;
  for (int64_t g = 0; g < Kp / G; ++g) {
    int sum = 0;
    for (int64_t i = 0; i < G; ++i) sum += a[g * G + i];
    asum[g] = static_cast<int16_t>(sum);
  }
  *scale = s;
}

// rows [0, mb) of a tile against output n; out[m] = sum_k w[n, k] a[m, k] in the units of a
template <int T>
inline void tile(int64_t nsb, const uint8_t* qs, const int16_t* sc, const int16_t* mn, const float* d,
                 const float* dmin, const int8_t* a, const int16_t* asum, int64_t Kp, float* out) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  __m256 acc[T];
  __m128 accm[T];
  for (int m = 0; m < T; ++m) {
    acc[m] = _mm256_setzero_ps();
    accm[m] = _mm_setzero_ps();
  }
  for (int64_t b = 0; b < nsb; ++b) {
    __m256i isum[T];
    for (int m = 0; m < T; ++m) isum[m] = _mm256_setzero_si256();
    const uint8_t* q = qs + b * (SB / 2);
    const int16_t* scb = sc + b * (SB / G);
    for (int p = 0; p < SB / 64; ++p) {  // two groups: 64 values in 32 bytes
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + p * 32));
      const __m256i w0 = _mm256_and_si256(w, low);
      const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
      const __m256i s0 = _mm256_set1_epi16(scb[2 * p]), s1 = _mm256_set1_epi16(scb[2 * p + 1]);
      for (int m = 0; m < T; ++m) {
        const int8_t* am = a + m * Kp + b * SB + p * 64;
        const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(am));
        const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(am + 32));
        const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, a0), s0);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, a1), s1);
        isum[m] = _mm256_add_epi32(isum[m], _mm256_add_epi32(p0, p1));
      }
    }
    const __m256 db = _mm256_set1_ps(d[b]);
    const __m128 mb = _mm_set1_ps(dmin[b]);
    const __m128i mnb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b * (SB / G)));
    for (int m = 0; m < T; ++m) {
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), db, acc[m]);
      const __m128i as = _mm_loadu_si128(reinterpret_cast<const __m128i*>(asum + m * (Kp / G) + b * (SB / G)));
      accm[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mnb, as)), mb, accm[m]);
    }
  }
  for (int m = 0; m < T; ++m) out[m] = hsum8(acc[m]) - hsum4(accm[m]);
}

void tile_rows(int mb, int64_t nsb, const uint8_t* qs, const int16_t* sc, const int16_t* mn, const float* d,
               const float* dmin, const int8_t* a, const int16_t* asum, int64_t Kp, float* out) {
  switch (mb) {
    case 1: return tile<1>(nsb, qs, sc, mn, d, dmin, a, asum, Kp, out);
    case 2: return tile<2>(nsb, qs, sc, mn, d, dmin, a, asum, Kp, out);
    case 3: return tile<3>(nsb, qs, sc, mn, d, dmin, a, asum, Kp, out);
    default: return tile<4>(nsb, qs, sc, mn, d, dmin, a, asum, Kp, out);
  }
}

at::Tensor q4_rows_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& sc, const at::Tensor& mn,
                      const at::Tensor& d, const at::Tensor& dmin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && qs.scalar_type() == at::kByte && sc.scalar_type() == at::kShort &&
                  mn.scalar_type() == at::kShort && d.scalar_type() == at::kFloat && dmin.scalar_type() == at::kFloat,
              "q4_rows_mm: x fp32, qs uint8, sc and mn int16, d and dmin fp32");
  TORCH_CHECK(x.dim() == 2 && qs.dim() == 2 && d.dim() == 2, "q4_rows_mm: x [M, K], qs [N, Kp / 2], d [N, Kp / 256]");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), Kp = qs.size(1) * 2, nsb = Kp / SB;
  TORCH_CHECK(Kp % SB == 0 && K <= Kp && Kp - K < SB && d.size(0) == N && d.size(1) == nsb &&
                  dmin.sizes() == d.sizes() && sc.size(0) == N && sc.size(1) == Kp / G && mn.sizes() == sc.sizes(),
              "q4_rows_mm: shapes disagree (K ", K, ", qs ", qs.sizes(), ")");
  const auto xc = x.contiguous(), qc = qs.contiguous(), scc = sc.contiguous(), mnc = mn.contiguous(),
             dc = d.contiguous(), dmc = dmin.contiguous();
  std::vector<int8_t> a(M * Kp);
  std::vector<int16_t> asum(M * (Kp / G));
  std::vector<float> rs(M);
  const float* xp = xc.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) quantize_row(xp + m * K, K, Kp, a.data() + m * Kp, asum.data() + m * (Kp / G), &rs[m]);
  auto y = at::empty({M, N}, xc.options());
  float* yp = y.data_ptr<float>();
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const int16_t* sp = scc.data_ptr<int16_t>();
  const int16_t* mp = mnc.data_ptr<int16_t>();
  const float* dp = dc.data_ptr<float>();
  const float* dmp = dmc.data_ptr<float>();
  // the threads split the outputs; an output's weights are read from memory once and stay in L1 over its row tiles
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float out[MB];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; m += MB) {
        const int mb = static_cast<int>(std::min<int64_t>(MB, M - m));
        tile_rows(mb, nsb, qp + n * (Kp / 2), sp + n * (Kp / G), mp + n * (Kp / G), dp + n * nsb, dmp + n * nsb,
                  a.data() + m * Kp, asum.data() + m * (Kp / G), Kp, out);
        for (int i = 0; i < mb; ++i) yp[(m + i) * N + n] = out[i] * rs[m + i];
      }
  });
  return y;
}

}  // namespace

// the schema is defined in w4a8.py; this is its CPU kernel
TORCH_LIBRARY_IMPL(specdraft, CPU, m) { m.impl("q4_rows_mm", q4_rows_mm); }
