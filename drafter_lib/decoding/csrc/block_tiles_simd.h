// The 256-bit paths (AVX2, AVX-VNNI) of block_tiles.h's recipe: a tile's 16 outputs as two halves of 8, each a
// register; DPBUSD(acc, u, a) and DPWSSD(acc, x, y) are the namespace's (VNNI instructions or their AVX2 pairs).

inline __m256i bcast4(const int8_t* a) {  // four activation bytes in every 32-bit lane
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm256_set1_epi32(v);
}

inline __m256i bcast_pair(const int16_t* s) {  // two int16 sums in every 32-bit lane
  int32_t v;
  std::memcpy(&v, s, 4);
  return _mm256_set1_epi32(v);
}

// Rows m0 .. m0 + T - 1 times outputs 8 h .. 8 h + 7 of the tile at P.
template <int T>
void tile_rows(int64_t format, const uint8_t* P, int64_t nsb, const Rows& r, int64_t m0, int64_t N, int64_t n0, int h,
               float* y) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const int64_t tb = tile_bytes(format);
  __m256 acc[T];
  const int8_t* a[T];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm256_setzero_ps();
    a[t] = r.arow(m0 + t);
  }
  auto load = [h](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)); };
  auto load16 = [h](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)); };
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = P + sb * tb;
    __m256i L[T];
    for (int t = 0; t < T; ++t) L[t] = _mm256_setzero_si256();
    if (format == Q4_K) {
      for (int g = 0; g < 8; ++g) {
        __m256i G0[T], G1[T];
        for (int t = 0; t < T; ++t) G0[t] = G1[t] = _mm256_setzero_si256();
        for (int b = 0; b < 4; ++b) {
          const __m256i raw = load(p + Q4K_NIB + (g * 4 + b) * 64);
          const __m256i lo = _mm256_and_si256(raw, m4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
          for (int t = 0; t < T; ++t) {
            const int8_t* at = a[t] + sb * 256 + g * 32;
            G0[t] = DPBUSD(G0[t], lo, bcast4(at + b * 4));
            G1[t] = DPBUSD(G1[t], hi, bcast4(at + (b + 4) * 4));
          }
        }
        const __m256i sc =
            _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + Q4K_SC + g * 16 + 8 * h)));
        for (int t = 0; t < T; ++t)
          L[t] = _mm256_add_epi32(L[t], _mm256_mullo_epi32(_mm256_add_epi32(G0[t], G1[t]), sc));
      }
      __m256i mins[T];
      for (int t = 0; t < T; ++t) mins[t] = _mm256_setzero_si256();
      for (int pr = 0; pr < 4; ++pr) {
        const __m256i mn = _mm256_cvtepu8_epi16(load16(p + Q4K_MN + pr * 32));
        for (int t = 0; t < T; ++t) mins[t] = DPWSSD(mins[t], mn, bcast_pair(r.s32row(m0 + t) + sb * 8 + pr * 2));
      }
      const __m256 d = _mm256_cvtph_ps(load16(p + Q4K_D)), dmin = _mm256_cvtph_ps(load16(p + Q4K_DMIN));
      for (int t = 0; t < T; ++t) {
        const __m256 da = _mm256_set1_ps(r.drow(m0 + t)[sb]);
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(L[t])));
        acc[t] = _mm256_sub_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(mins[t])));
      }
    } else {  // Q6_K
      __m256i minus[T];
      for (int t = 0; t < T; ++t) minus[t] = _mm256_setzero_si256();
      for (int pr = 0; pr < 8; ++pr) {  // groups 2 pr and 2 pr + 1
        const __m256i sc2 = _mm256_cvtepi8_epi16(load16(p + Q6K_SC + pr * 32));
        for (int t = 0; t < T; ++t) minus[t] = DPWSSD(minus[t], sc2, bcast_pair(r.s16row(m0 + t) + sb * 16 + pr * 2));
        for (int e = 0; e < 2; ++e) {
          const int g = pr * 2 + e;
          const __m256i sc = e == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(sc2, 16), 16) : _mm256_srai_epi32(sc2, 16);
          const __m256i top = load(p + q6k_top(g)), raw0 = load(p + q6k_nib(g, 0)), raw1 = load(p + q6k_nib(g, 1));
          const __m256i u0 =
              _mm256_or_si256(_mm256_and_si256(raw0, m4), _mm256_and_si256(_mm256_slli_epi16(top, 4), m30));
          const __m256i u1 =
              _mm256_or_si256(_mm256_and_si256(raw1, m4), _mm256_and_si256(_mm256_slli_epi16(top, 2), m30));
          const __m256i u2 =
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), m4), _mm256_and_si256(top, m30));
          const __m256i u3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), m4),
                                             _mm256_and_si256(_mm256_srli_epi16(top, 2), m30));
          for (int t = 0; t < T; ++t) {
            const int8_t* at = a[t] + sb * 256 + g * 16;
            const __m256i G0 = DPBUSD(DPBUSD(_mm256_setzero_si256(), u0, bcast4(at)), u2, bcast4(at + 8));
            const __m256i G1 = DPBUSD(DPBUSD(_mm256_setzero_si256(), u1, bcast4(at + 4)), u3, bcast4(at + 12));
            L[t] = _mm256_add_epi32(L[t], _mm256_mullo_epi32(_mm256_add_epi32(G0, G1), sc));
          }
        }
      }
      const __m256 d = _mm256_cvtph_ps(load16(p + Q6K_D));
      for (int t = 0; t < T; ++t) {
        const __m256 da = _mm256_set1_ps(r.drow(m0 + t)[sb]);
        const __m256i Lm = _mm256_sub_epi32(L[t], _mm256_slli_epi32(minus[t], 5));
        acc[t] = _mm256_add_ps(acc[t], _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(Lm)));
      }
    }
  }
  const int64_t first = n0 + 8 * h, real = std::min<int64_t>(8, N - first);
  for (int t = 0; t < T; ++t) {
    float out[8];
    _mm256_storeu_ps(out, acc[t]);
    std::memcpy(y + (m0 + t) * N + first, out, std::max<int64_t>(real, 0) * sizeof(float));
  }
}

// One row times all 16 outputs of the tile at P, both halves in one pass: each activation broadcast once (a
// one-token pass). The same arithmetic per (row, output) as tile_rows.
void tile_row(int64_t format, const uint8_t* P, int64_t nsb, const Rows& r, int64_t m, int64_t N, int64_t n0,
              float* y) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const int64_t tb = tile_bytes(format);
  const int8_t* a = r.arow(m);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  auto load = [](const uint8_t* p, int h) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h)); };
  auto load16 = [](const uint8_t* p, int h) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)); };
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = P + sb * tb;
    const __m256 da = _mm256_set1_ps(r.drow(m)[sb]);
    __m256i L[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    if (format == Q4_K) {
      for (int g = 0; g < 8; ++g) {
        __m256i G0[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, G1[2] = {G0[0], G0[0]};
        const int8_t* at = a + sb * 256 + g * 32;
        for (int b = 0; b < 4; ++b) {
          const __m256i alo = bcast4(at + b * 4), ahi = bcast4(at + (b + 4) * 4);
          for (int h = 0; h < 2; ++h) {
            const __m256i raw = load(p + Q4K_NIB + (g * 4 + b) * 64, h);
            G0[h] = DPBUSD(G0[h], _mm256_and_si256(raw, m4), alo);
            G1[h] = DPBUSD(G1[h], _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4), ahi);
          }
        }
        for (int h = 0; h < 2; ++h) {
          const __m256i sc =
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + Q4K_SC + g * 16 + 8 * h)));
          L[h] = _mm256_add_epi32(L[h], _mm256_mullo_epi32(_mm256_add_epi32(G0[h], G1[h]), sc));
        }
      }
      __m256i mins[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int pr = 0; pr < 4; ++pr) {
        const __m256i s = bcast_pair(r.s32row(m) + sb * 8 + pr * 2);
        for (int h = 0; h < 2; ++h)
          mins[h] = DPWSSD(mins[h], _mm256_cvtepu8_epi16(load16(p + Q4K_MN + pr * 32, h)), s);
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(load16(p + Q4K_D, h)), dmin = _mm256_cvtph_ps(load16(p + Q4K_DMIN, h));
        acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(L[h])));
        acc[h] = _mm256_sub_ps(acc[h], _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(mins[h])));
      }
    } else {  // Q6_K
      __m256i minus[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int pr = 0; pr < 8; ++pr) {  // groups 2 pr and 2 pr + 1
        const __m256i s = bcast_pair(r.s16row(m) + sb * 16 + pr * 2);
        const __m256i sc2[2] = {_mm256_cvtepi8_epi16(load16(p + Q6K_SC + pr * 32, 0)),
                                _mm256_cvtepi8_epi16(load16(p + Q6K_SC + pr * 32, 1))};
        for (int h = 0; h < 2; ++h) minus[h] = DPWSSD(minus[h], sc2[h], s);
        for (int e = 0; e < 2; ++e) {
          const int g = pr * 2 + e;
          const int8_t* at = a + sb * 256 + g * 16;
          const __m256i a0 = bcast4(at), a1 = bcast4(at + 4), a2 = bcast4(at + 8), a3 = bcast4(at + 12);
          for (int h = 0; h < 2; ++h) {
            const __m256i sc =
                e == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(sc2[h], 16), 16) : _mm256_srai_epi32(sc2[h], 16);
            const __m256i top = load(p + q6k_top(g), h), raw0 = load(p + q6k_nib(g, 0), h),
                          raw1 = load(p + q6k_nib(g, 1), h);
            const __m256i u0 =
                _mm256_or_si256(_mm256_and_si256(raw0, m4), _mm256_and_si256(_mm256_slli_epi16(top, 4), m30));
            const __m256i u1 =
                _mm256_or_si256(_mm256_and_si256(raw1, m4), _mm256_and_si256(_mm256_slli_epi16(top, 2), m30));
            const __m256i u2 =
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), m4), _mm256_and_si256(top, m30));
            const __m256i u3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(top, 2), m30));
            const __m256i G0 = DPBUSD(DPBUSD(_mm256_setzero_si256(), u0, a0), u2, a2);
            const __m256i G1 = DPBUSD(DPBUSD(_mm256_setzero_si256(), u1, a1), u3, a3);
            L[h] = _mm256_add_epi32(L[h], _mm256_mullo_epi32(_mm256_add_epi32(G0, G1), sc));
          }
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(load16(p + Q6K_D, h));
        const __m256i Lm = _mm256_sub_epi32(L[h], _mm256_slli_epi32(minus[h], 5));
        acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(Lm)));
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t first = n0 + 8 * h, real = std::min<int64_t>(8, N - first);
    if (real <= 0) break;
    float out[8];
    _mm256_storeu_ps(out, acc[h]);
    std::memcpy(y + m * N + first, out, real * sizeof(float));
  }
}

void run_tiles(int64_t format, const uint8_t* packed, int64_t N, int64_t K, const Rows& r, int64_t t0, int64_t t1,
               float* y) {
  const int64_t nsb = K / 256;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const uint8_t* P = packed + tile * nsb * tile_bytes(format);
    if (r.M == 1) {
      tile_row(format, P, nsb, r, 0, N, tile * NT, y);
      continue;
    }
    for (int h = 0; h < 2 && tile * NT + 8 * h < N; ++h)
      for (int64_t m0 = 0; m0 < r.M; m0 += MB) {
        switch (std::min<int64_t>(MB, r.M - m0)) {
          case 1:
            tile_rows<1>(format, P, nsb, r, m0, N, tile * NT, h, y);
            break;
          case 2:
            tile_rows<2>(format, P, nsb, r, m0, N, tile * NT, h, y);
            break;
          case 3:
            tile_rows<3>(format, P, nsb, r, m0, N, tile * NT, h, y);
            break;
          default:
            tile_rows<4>(format, P, nsb, r, m0, N, tile * NT, h, y);
            break;
        }
      }
  }
}
