// The vector paths' body for Q8_0 and Q4_1 (block_rows.cpp), included once per instruction set inside a namespace
// that defines DOT(u, a). Each step mirrors `portable::row_dot` lane for lane.

template <int T>
void tile(const Weight& w, int64_t n, const Rows& r, int64_t m0, float* y) {
  const int64_t K = w.K;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m256i m4x2 = _mm256_set1_epi8(0x0F);
  __m256 acc[T];
  float scalar[T];
  const int8_t* a[T];
  const float* da[T];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm256_setzero_ps();
    scalar[t] = 0.f;
    a[t] = r.arow(m0 + t);
    da[t] = r.drow(m0 + t);
  }
  auto load = [](const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  auto add_block = [&](int t, float D, __m256i L) {
    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_set1_ps(D), _mm256_cvtepi32_ps(L)));
  };
  if (w.format == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.q) + n * K;
    const float* dw = w.d + n * (K / 32);
    for (int64_t b = 0; b < K / 32; ++b) {
      const __m256i wq = load(q + b * 32);
      const __m256i u = _mm256_sign_epi8(wq, wq);
      for (int t = 0; t < T; ++t) add_block(t, dw[b] * da[t][b], DOT(u, _mm256_sign_epi8(load(a[t] + b * 32), wq)));
    }
  } else if (w.format == Q4_1) {
    const uint8_t* q = w.q + n * (K / 2);
    const float* dw = w.d + n * (K / 32);
    const float* mw = w.dm + n * (K / 32);
    for (int64_t b = 0; b < K / 32; ++b) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
      for (int t = 0; t < T; ++t) {
        add_block(t, dw[b] * da[t][b], DOT(u, load(a[t] + b * 32)));
        scalar[t] = scalar[t] + mw[b] * r.sarow(m0 + t)[b];
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[t]);
    y[(m0 + t) * w.N + n] = finish(lanes, scalar[t]);
  }
}

void run(const Weight& w, const Rows& r, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < r.M; m0 += MB) {
      switch (std::min<int64_t>(MB, r.M - m0)) {
        case 1: tile<1>(w, n, r, m0, y); break;
        case 2: tile<2>(w, n, r, m0, y); break;
        case 3: tile<3>(w, n, r, m0, y); break;
        default: tile<4>(w, n, r, m0, y); break;
      }
    }
}
