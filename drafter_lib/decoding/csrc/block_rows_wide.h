// The AVX-512 path's tiles for Q4_K and Q6_K (block_rows.cpp, included after block_rows_simd.h): 64 inputs per
// instruction instead of 32. A 512-bit register holds the int32 lanes of two 32-input chunks; adding its halves
// gives the eight lanes the 256-bit body keeps (lane l: the inputs i of the super-block with (i mod 32) / 4 == l,
// times their sub-scales), and integer sums are exact in any order, so the lanes, and the float recipe that
// follows, are the portable path's to the bit.

inline __m256i halves_sum(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// int16 words: the first 16 take sub-scale `a`, the last 16 `b` (Q4_K: two groups of 32 inputs a register)
inline __m512i pick2(int a, int b) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>(i < 16 ? a : b);
  return _mm512_load_si512(idx);
}

// int16 words: each quarter of 8 takes one sub-scale, g .. g + 3 (Q6_K: four groups of 16 inputs a register)
inline __m512i pick4(int g) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 32; ++i) idx[i] = static_cast<int16_t>(g + i / 8);
  return _mm512_load_si512(idx);
}

template <int T>
void wide_tile(const Weight& w, int64_t n, const Rows& r, int64_t m0, float* y) {
  const int64_t K = w.K;
  __m256 acc[T];
  const float* da[T];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm256_setzero_ps();
    da[t] = r.drow(m0 + t);
  }
  auto load = [](const void* p) { return _mm512_loadu_si512(p); };
  auto add_block = [&](int t, float D, __m256i L) {
    acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_set1_ps(D), _mm256_cvtepi32_ps(L)));
  };
  if (w.format == Q4_K) {
    // a 64-byte load of nibbles holds chunks c and c + 1: low nibbles = their groups 2c and 2c + 2, high = 2c + 1
    // and 2c + 3; Rows::a128 lays the inputs out in that order
    static const __m512i s_lo[2] = {pick2(0, 2), pick2(4, 6)}, s_hi[2] = {pick2(1, 3), pick2(5, 7)};
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint8_t* q = w.q + n * (K / 2);
    const uint8_t* sc = w.sc + n * (K / 32);
    const uint8_t* mn = w.mn + n * (K / 32);
    const int8_t* a[T];
    for (int t = 0; t < T; ++t) a[t] = r.a128row(m0 + t);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const __m512i s16 = _mm512_cvtepu8_epi16(
          _mm256_zextsi128_si256(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + sb * 8))));
      __m512i L[T], H[T];  // two sums a row, added at the end: half the chain of dependent vpdpwssd
      for (int t = 0; t < T; ++t) L[t] = H[t] = _mm512_setzero_si512();
      for (int p = 0; p < 2; ++p) {
        const __m512i raw = load(q + sb * 128 + p * 64);
        const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        const __m512i slo = _mm512_permutexvar_epi16(s_lo[p], s16), shi = _mm512_permutexvar_epi16(s_hi[p], s16);
        for (int t = 0; t < T; ++t) {
          const int8_t* at = a[t] + sb * 256 + p * 128;
          L[t] = _mm512_dpwssd_epi32(L[t], _mm512_maddubs_epi16(lo, load(at)), slo);
          H[t] = _mm512_dpwssd_epi32(H[t], _mm512_maddubs_epi16(hi, load(at + 64)), shi);
        }
      }
      const __m128i mn16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + sb * 8)));
      for (int t = 0; t < T; ++t) {
        add_block(t, w.d[n * (K / 256) + sb] * da[t][sb], halves_sum(_mm512_add_epi32(L[t], H[t])));
        acc[t] = minus_minima(acc[t], w.dm[n * (K / 256) + sb] * da[t][sb], mn16, r.s32row(m0 + t) + sb * 8);
      }
    }
  } else {  // Q6_K: a register holds 64 inputs, four groups of 16
    static const __m512i s_of[4] = {pick4(0), pick4(4), pick4(8), pick4(12)};
    // a half super-block's 64 bytes of nibbles give its inputs 0-63 (low) and 64-127 (high); its 32 bytes of top
    // bits, in both halves of a register, give bit pairs 0 | 1 (low) and 2 | 3 (high) at bits 4-5 by 16-bit shifts
    constexpr long long W0 = 0, W2 = 0x0002000200020002LL, W4 = 0x0004000400040004LL;  // a count per 16-bit word
    static const __m512i up_lo = _mm512_set_epi64(W2, W2, W2, W2, W4, W4, W4, W4);  // shift left 4 | 2
    static const __m512i down_hi = _mm512_set_epi64(W2, W2, W2, W2, W0, W0, W0, W0);  // shift right 0 | 2
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const uint8_t* ql = w.q + n * (K / 2);
    const uint8_t* qh = w.mn + n * (K / 4);
    const int8_t* sc = reinterpret_cast<const int8_t*>(w.sc) + n * (K / 16);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + sb * 16)));
      const __m512i s16 = _mm512_zextsi256_si512(sc16);
      __m512i L[T], H[T];  // even and odd registers' sums, added at the end
      for (int t = 0; t < T; ++t) L[t] = H[t] = _mm512_setzero_si512();
      for (int c = 0; c < 4; c += 2) {  // half c / 2: registers c (its inputs 0-63) and c + 1 (64-127)
        const __m512i raw = load(ql + sb * 128 + c * 32);
        const __m512i h =
            _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + sb * 64 + c * 16)));
        const __m512i u0 =
            _mm512_or_si512(_mm512_and_si512(raw, m4), _mm512_and_si512(_mm512_sllv_epi16(h, up_lo), m30));
        const __m512i u1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi16(h, down_hi), m30));
        const __m512i s0 = _mm512_permutexvar_epi16(s_of[c], s16), s1 = _mm512_permutexvar_epi16(s_of[c + 1], s16);
        for (int t = 0; t < T; ++t) {
          const int8_t* at = r.arow(m0 + t) + sb * 256 + c * 64;
          L[t] = _mm512_dpwssd_epi32(L[t], _mm512_maddubs_epi16(u0, load(at)), s0);
          H[t] = _mm512_dpwssd_epi32(H[t], _mm512_maddubs_epi16(u1, load(at + 64)), s1);
        }
      }
      for (int t = 0; t < T; ++t)
        add_block(t, w.d[n * (K / 256) + sb] * da[t][sb],
                  minus_32(halves_sum(_mm512_add_epi32(L[t], H[t])), sc16, r.s16row(m0 + t) + sb * 16));
    }
  }
  for (int t = 0; t < T; ++t) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[t]);
    y[(m0 + t) * w.N + n] = finish(lanes, 0.f);
  }
}
