// Row-exact attention for one-query heads: out[i] = softmax(q[i] . k[s, :n_i] * scale) v[s, :n_i], s = i / group.
//
// Each query's arithmetic is one fixed sequence that depends on nothing but its own query, its n_i keys and values
// in slot order, and the scale: dot products in eight float lanes over the head dimension, summed pairwise; the
// maximum; exp(score - max) in slot order, their sum in slot order; the values weighted and added in slot order,
// one lane per head dimension; one division. The queries are split over the threads, but a query never shares
// its arithmetic with another, so its bits are the same alone, beside any other queries, or on any thread (built
// with -ffp-contract=off: no fused multiply-adds the compiler might choose differently per loop).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// One query's attention, written lane by lane (eight float lanes over the head dimension, one lane per head
// dimension for the values) so that the compiler's vector code is the same arithmetic at any vector width: the
// portable build and the AVX2 build below give the same bits.
#define ROW_ATTENTION_BODY                                                                                        \
  /* a dot product's eight lanes, summed pairwise */                                                              \
  inline float lanes_sum(const float* x) {                                                                        \
    return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));                                     \
  }                                                                                                               \
  inline float dot(const float* a, const float* b, int64_t D) {                                                   \
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                                    \
    int64_t d = 0;                                                                                                \
    for (; d + 8 <= D; d += 8)                                                                                    \
      for (int l = 0; l < 8; ++l) lanes[l] = lanes[l] + a[d + l] * b[d + l];                                      \
    for (int l = 0; d < D; ++d, ++l) lanes[l] = lanes[l] + a[d] * b[d];                                           \
    return lanes_sum(lanes);                                                                                      \
  }                                                                                                               \
  /* exp(x) for x <= 0 from basic float operations only (libm's expf may differ between builds): x = n ln2 + r,  \
     a degree-6 polynomial in r, times 2^n; within 2 ulp, 0 below -87 */                                          \
  inline float exp_one(float x) {                                                                                 \
    const float v = x < -87.f ? -87.f : x;                                                                        \
    const float k = (v * 1.44269504f + 12582912.f) - 12582912.f; /* round to nearest */                           \
    const float r = (v - k * 0.693145752f) - k * 1.42860677e-06f;                                                 \
    float p = 1.f / 720.f;                                                                                        \
    p = p * r + 1.f / 120.f;                                                                                      \
    p = p * r + 1.f / 24.f;                                                                                       \
    p = p * r + 1.f / 6.f;                                                                                        \
    p = p * r + 0.5f;                                                                                             \
    p = p * r + 1.f;                                                                                              \
    p = p * r + 1.f;                                                                                              \
    int32_t bits = (static_cast<int32_t>(k) + 127) << 23;                                                         \
    float scale;                                                                                                  \
    std::memcpy(&scale, &bits, 4);                                                                                \
    return x < -87.f ? 0.f : p * scale;                                                                           \
  }

// The queries' loop; each namespace has dots4(q, k, stride, D, scale, out), four keys' dot() * scale at once,
// exps(x, n), x[j] = exp_one(x[j]), and weighted_sum(w, v, stride, n, D, acc), acc[d] = the n values' dimension d
// weighted and added in slot order.
#define ROW_ATTENTION_QUERIES                                                                                     \
  /* ks_, vs_: the key and value strides {sequence, slot} (a slot's D floats are adjacent) */                   \
  void queries(const float* qp, const float* kp, const float* vp, const int64_t* ks_, const int64_t* vs_,         \
               const int64_t* len, int64_t i0, int64_t i1, int64_t N, int64_t D, int64_t group, float sc,         \
               float* op) {                                                                                       \
    std::vector<float> w(N), acc(D);                                                                              \
    for (int64_t i = i0; i < i1; ++i) {                                                                           \
      const float* qi = qp + i * D;                                                                               \
      const float* ks = kp + (i / group) * ks_[0];                                                                \
      const float* vs = vp + (i / group) * vs_[0];                                                                \
      const int64_t n = len[i];                                                                                   \
      float top = -INFINITY;                                                                                      \
      int64_t j = 0;                                                                                              \
      for (; j + 4 <= n; j += 4) dots4(qi, ks + j * ks_[1], ks_[1], D, sc, &w[j]);                               \
      for (; j < n; ++j) w[j] = dot(qi, ks + j * ks_[1], D) * sc;                                                 \
      for (j = 0; j < n; ++j) top = std::max(top, w[j]);                                                          \
      for (int64_t j = 0; j < n; ++j) w[j] = w[j] - top;                                                          \
      exps(w.data(), n);                                                                                          \
      float total = 0.f;                                                                                          \
      for (int64_t j = 0; j < n; ++j) total = total + w[j];                                                       \
      weighted_sum(w.data(), vs, vs_[1], n, D, acc.data());                                                      \
      for (int64_t d = 0; d < D; ++d) op[i * D + d] = acc[d] / total;                                             \
    }                                                                                                             \
  }

namespace portable {
ROW_ATTENTION_BODY
inline void exps(float* x, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] = exp_one(x[j]);
}
inline void dots4(const float* a, const float* k, int64_t stride, int64_t D, float sc, float* out) {
  for (int s = 0; s < 4; ++s) out[s] = dot(a, k + s * stride, D) * sc;
}
inline void weighted_sum(const float* w, const float* v, int64_t stride, int64_t n, int64_t D, float* acc) {
  std::fill(acc, acc + D, 0.f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + w[j] * v[j * stride + d];
}
ROW_ATTENTION_QUERIES
}  // namespace portable

#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
ROW_ATTENTION_BODY
// exp_one on eight slots at once: the same operations lane by lane (no fused multiply-add)
inline void exps(float* x, int64_t n) {
  const __m256 low = _mm256_set1_ps(-87.f), shift = _mm256_set1_ps(12582912.f), zero = _mm256_setzero_ps();
  const float coef[6] = {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 xj = _mm256_loadu_ps(x + j);
    const __m256 under = _mm256_cmp_ps(xj, low, _CMP_LT_OQ);
    const __m256 v = _mm256_blendv_ps(xj, low, under);
    const __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504f)), shift), shift);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(v, _mm256_mul_ps(k, _mm256_set1_ps(0.693145752f))),
                                   _mm256_mul_ps(k, _mm256_set1_ps(1.42860677e-06f)));
    __m256 p = _mm256_set1_ps(1.f / 720.f);
    for (float c : coef) p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    _mm256_storeu_ps(x + j, _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), zero, under));
  }
  for (; j < n; ++j) x[j] = exp_one(x[j]);
}
// dot()'s eight lanes as one register, for four keys at once: four independent chains of adds (mul, then add: no
// fused multiply-add, as dot())
inline void dots4(const float* a, const float* k, int64_t stride, int64_t D, float sc, float* out) {
  if (D % 8) return portable::dots4(a, k, stride, D, sc, out);
  __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(a + d);
    l0 = _mm256_add_ps(l0, _mm256_mul_ps(x, _mm256_loadu_ps(k + d)));
    l1 = _mm256_add_ps(l1, _mm256_mul_ps(x, _mm256_loadu_ps(k + stride + d)));
    l2 = _mm256_add_ps(l2, _mm256_mul_ps(x, _mm256_loadu_ps(k + 2 * stride + d)));
    l3 = _mm256_add_ps(l3, _mm256_mul_ps(x, _mm256_loadu_ps(k + 3 * stride + d)));
  }
  const __m256 sums[4] = {l0, l1, l2, l3};
  for (int s = 0; s < 4; ++s) {
    float x[8];
    _mm256_storeu_ps(x, sums[s]);
    out[s] = lanes_sum(x) * sc;
  }
}
// the same sums with 64 dimensions' accumulators in registers (a pass over the slots per 64 dimensions)
inline void weighted_sum(const float* w, const float* v, int64_t stride, int64_t n, int64_t D, float* acc) {
  if (D % 64) return portable::weighted_sum(w, v, stride, n, D, acc);
  for (int64_t c = 0; c < D; c += 64) {
    __m256 s[8];
    for (int r = 0; r < 8; ++r) s[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      const __m256 wj = _mm256_set1_ps(w[j]);
      const float* vj = v + j * stride + c;
      for (int r = 0; r < 8; ++r) s[r] = _mm256_add_ps(s[r], _mm256_mul_ps(wj, _mm256_loadu_ps(vj + 8 * r)));
    }
    for (int r = 0; r < 8; ++r) _mm256_storeu_ps(acc + c + 8 * r, s[r]);
  }
}
ROW_ATTENTION_QUERIES
}  // namespace avx2
#pragma GCC pop_options

bool has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}

// path: 0 the widest this CPU runs, 1 portable, 2 AVX2 (the same bits: for tests)
at::Tensor row_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lengths,
                         double scale, int64_t path) {
  TORCH_CHECK(path >= 0 && path <= 2 && (path != 2 || has_avx2()), "row_attention: this CPU cannot run path ", path);
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "row_attention: q, k and v must be fp32");
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(),
              "row_attention: q [Q, D], k and v [S, N, D]");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.dim() == 1 && lengths.size(0) == q.size(0),
              "row_attention: lengths must be int64 [Q]");
  const int64_t Q = q.size(0), D = q.size(1), S = k.size(0), N = k.size(1);
  TORCH_CHECK(k.size(2) == D && S > 0 && Q % S == 0, "row_attention: ", Q, " queries do not share ", S,
              " key sequences evenly, or the head sizes differ");
  // k and v are read through their sequence and slot strides (the KV cache's [kv heads, n, D] views of
  // [heads, capacity, D] buffers are not contiguous, and copying them cost every layer of every pass); only a
  // slot whose D floats are not adjacent is copied
  const auto qc = q.contiguous();
  const auto kc = k.stride(2) == 1 ? k : k.contiguous(), vc = v.stride(2) == 1 ? v : v.contiguous();
  const int64_t kst[2] = {kc.stride(0), kc.stride(1)}, vst[2] = {vc.stride(0), vc.stride(1)};
  const auto lc = lengths.contiguous();
  const int64_t* len = lc.data_ptr<int64_t>();
  for (int64_t i = 0; i < Q; ++i)
    TORCH_CHECK(len[i] >= 1 && len[i] <= N, "row_attention: query ", i, " reads ", len[i], " of ", N, " slots");
  const int64_t group = Q / S;
  const float sc = static_cast<float>(scale);
  const float* qp = qc.data_ptr<float>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  auto out = at::empty({Q, D}, qc.options());
  float* op = out.data_ptr<float>();
  const bool wide = path == 2 || (path == 0 && has_avx2());
  at::parallel_for(0, Q, 1, [&](int64_t i0, int64_t i1) {
    if (wide)
      avx2::queries(qp, kp, vp, kst, vst, len, i0, i1, N, D, group, sc, op);
    else
      portable::queries(qp, kp, vp, kst, vst, len, i0, i1, N, D, group, sc, op);
  });
  return out;
}

}  // namespace

// the schema is defined in row_attention.py; this is its CPU kernel
TORCH_LIBRARY_IMPL(specdraft, CPU, m) { m.impl("row_attention", row_attention); }
