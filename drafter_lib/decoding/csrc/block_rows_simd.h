// The vector paths' body (block_rows.cpp), included once per instruction set inside a namespace that defines
// DOT(u, a), SCALED_ADD(acc, u, a, s) and scale_lanes(lo, hi). Each step mirrors `portable::row_dot` lane for lane.

// Q4_K's minima: lanes 0-3 take mn[2l] s[2l] + mn[2l + 1] s[2l + 1] (one vpmaddwd; s the row's sums per 32),
// lanes 4-7 zero
inline __m256 minus_minima(__m256 acc, float Dmin, __m128i mn16, const int16_t* s32) {
  const __m128i m = _mm_madd_epi16(mn16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(s32)));
  return _mm256_sub_ps(acc, _mm256_mul_ps(_mm256_set1_ps(Dmin), _mm256_cvtepi32_ps(_mm256_zextsi128_si256(m))));
}

// Q6_K's -32 of every value: lane l takes 32 (sc[2l] s[2l] + sc[2l + 1] s[2l + 1]), s the row's sums per 16
inline __m256i minus_32(__m256i L, __m256i sc16, const int16_t* s16) {
  const __m256i p = _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16)));
  return _mm256_sub_epi32(L, _mm256_slli_epi32(p, 5));
}

#ifdef WIDE_TILES
template <int T>
void wide_tile(const Weight& w, int64_t n, const Rows& r, int64_t m0, float* y);  // block_rows_wide.h
#endif

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
  } else if (w.format == Q4_K) {
    const uint8_t* q = w.q + n * (K / 2);
    const uint8_t* sc = w.sc + n * (K / 32);
    const uint8_t* mn = w.mn + n * (K / 32);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      __m256i L[T];
      for (int t = 0; t < T; ++t) L[t] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = load(q + sb * 128 + c * 32);
        const __m256i lo = _mm256_and_si256(raw, m4x2), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4x2);
        const int64_t g = sb * 8 + 2 * c;
        const __m256i s0 = scale_lanes(sc[g], sc[g]), s1 = scale_lanes(sc[g + 1], sc[g + 1]);
        for (int t = 0; t < T; ++t) {
          const int8_t* at = a[t] + sb * 256 + c * 64;
          L[t] = SCALED_ADD(SCALED_ADD(L[t], lo, load(at), s0), hi, load(at + 32), s1);
        }
      }
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + sb * 8)));
      for (int t = 0; t < T; ++t) {
        add_block(t, w.d[n * (K / 256) + sb] * da[t][sb], L[t]);
        acc[t] = minus_minima(acc[t], w.dm[n * (K / 256) + sb] * da[t][sb], mn16, r.s32row(m0 + t) + sb * 8);
      }
    }
  } else {  // Q6_K
    const uint8_t* ql = w.q + n * (K / 2);
    const uint8_t* qh = w.mn + n * (K / 4);
    const int8_t* sc = reinterpret_cast<const int8_t*>(w.sc) + n * (K / 16);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      __m256i L[T];
      for (int t = 0; t < T; ++t) L[t] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {  // chunk c: quarter i = c % 4 of half c / 4 (q6_value)
        const int i = c % 4;
        const __m256i raw = load(ql + sb * 128 + (c / 4) * 64 + 32 * (i % 2));
        const __m256i low = _mm256_and_si256(i < 2 ? raw : _mm256_srli_epi16(raw, 4), m4x2);
        const __m256i h = load(qh + sb * 64 + (c / 4) * 32);  // bit pair i of each byte to bits 4-5 (16-bit
        const __m256i top = i == 0 ? _mm256_slli_epi16(h, 4)   // shifts: what crosses a byte is masked off)
                            : i == 1 ? _mm256_slli_epi16(h, 2) : i == 2 ? h : _mm256_srli_epi16(h, 2);
        const __m256i u = _mm256_or_si256(low, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
        const __m256i s = scale_lanes(sc[sb * 16 + 2 * c], sc[sb * 16 + 2 * c + 1]);
        for (int t = 0; t < T; ++t) L[t] = SCALED_ADD(L[t], u, load(a[t] + sb * 256 + c * 32), s);
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + sb * 16)));
      for (int t = 0; t < T; ++t)
        add_block(t, w.d[n * (K / 256) + sb] * da[t][sb], minus_32(L[t], sc16, r.s16row(m0 + t) + sb * 16));
    }
  }
  for (int t = 0; t < T; ++t) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[t]);
    y[(m0 + t) * w.N + n] = finish(lanes, scalar[t]);
  }
}

template <int T>
inline void any_tile(const Weight& w, int64_t n, const Rows& r, int64_t m0, float* y) {
#ifdef WIDE_TILES
  if (w.format == Q4_K || w.format == Q6_K) return wide_tile<T>(w, n, r, m0, y);
#endif
  tile<T>(w, n, r, m0, y);
}

void run(const Weight& w, const Rows& r, int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m0 = 0; m0 < r.M; m0 += MB) {
      switch (std::min<int64_t>(MB, r.M - m0)) {
        case 1: any_tile<1>(w, n, r, m0, y); break;
        case 2: any_tile<2>(w, n, r, m0, y); break;
        case 3: any_tile<3>(w, n, r, m0, y); break;
        default: any_tile<4>(w, n, r, m0, y); break;
      }
    }
}
