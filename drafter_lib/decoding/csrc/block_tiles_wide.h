// The AVX-512 VNNI path of block_tiles.h's recipe: a register holds a tile's 16 outputs.

inline __m512i bcast4(const int8_t* a) {  // four activation bytes in every 32-bit lane
  int32_t v;
  std::memcpy(&v, a, 4);
  return _mm512_set1_epi32(v);
}

inline __m512i bcast_pair(const int16_t* s) {  // two int16 sums in every 32-bit lane
  int32_t v;
  std::memcpy(&v, s, 4);
  return _mm512_set1_epi32(v);
}

constexpr int64_t TILE_ROWS = 6;  // rows a tile's weights are decoded for at once (registers: ~5 a row)

template <int T>
void tile_rows(int64_t format, const uint8_t* P, int64_t nsb, const Rows& r, int64_t m0, int64_t N, int64_t n0,
               float* y) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const int64_t tb = tile_bytes(format);
  __m512 acc[T];
  const int8_t* a[T];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm512_setzero_ps();
    a[t] = r.arow(m0 + t);
  }
  auto load = [](const uint8_t* p) { return _mm512_loadu_si512(p); };
  auto halfs = [](const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = P + sb * tb;
    __m512i L[T];
    for (int t = 0; t < T; ++t) L[t] = _mm512_setzero_si512();
    if (format == Q4_K) {
      for (int g = 0; g < 8; ++g) {
        __m512i G0[T], G1[T];  // low and high nibbles' sums: two chains of dependent vpdpbusd
        for (int t = 0; t < T; ++t) G0[t] = G1[t] = _mm512_setzero_si512();
        for (int b = 0; b < 4; ++b) {
          const __m512i raw = load(p + Q4K_NIB + (g * 4 + b) * 64);
          const __m512i lo = _mm512_and_si512(raw, m4), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
          for (int t = 0; t < T; ++t) {
            const int8_t* at = a[t] + sb * 256 + g * 32;
            G0[t] = _mm512_dpbusd_epi32(G0[t], lo, bcast4(at + b * 4));
            G1[t] = _mm512_dpbusd_epi32(G1[t], hi, bcast4(at + (b + 4) * 4));
          }
        }
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + Q4K_SC + g * 16)));
        for (int t = 0; t < T; ++t)
          L[t] = _mm512_add_epi32(L[t], _mm512_mullo_epi32(_mm512_add_epi32(G0[t], G1[t]), sc));
      }
      __m512i mins[T];
      for (int t = 0; t < T; ++t) mins[t] = _mm512_setzero_si512();
      for (int pr = 0; pr < 4; ++pr) {
        const __m512i mn =
            _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + Q4K_MN + pr * 32)));
        for (int t = 0; t < T; ++t)
          mins[t] = _mm512_dpwssd_epi32(mins[t], mn, bcast_pair(r.s32row(m0 + t) + sb * 8 + pr * 2));
      }
      const __m512 d = halfs(p + Q4K_D), dmin = halfs(p + Q4K_DMIN);
      for (int t = 0; t < T; ++t) {
        const __m512 da = _mm512_set1_ps(r.drow(m0 + t)[sb]);
        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(L[t])));
        acc[t] = _mm512_sub_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(dmin, da), _mm512_cvtepi32_ps(mins[t])));
      }
    } else {  // Q6_K
      __m512i minus[T];
      for (int t = 0; t < T; ++t) minus[t] = _mm512_setzero_si512();
      for (int pr = 0; pr < 8; ++pr) {  // groups 2 pr and 2 pr + 1
        const __m512i sc2 =
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + Q6K_SC + pr * 32)));
        for (int t = 0; t < T; ++t)
          minus[t] = _mm512_dpwssd_epi32(minus[t], sc2, bcast_pair(r.s16row(m0 + t) + sb * 16 + pr * 2));
        for (int h = 0; h < 2; ++h) {
          const int g = pr * 2 + h;
          const __m512i sc = h == 0 ? _mm512_srai_epi32(_mm512_slli_epi32(sc2, 16), 16) : _mm512_srai_epi32(sc2, 16);
          const __m512i top = load(p + q6k_top(g));
          const __m512i raw0 = load(p + q6k_nib(g, 0)), raw1 = load(p + q6k_nib(g, 1));
          // quad k: its nibble | bit pair k of `top` moved to bits 4-5 (16-bit shifts: what crosses a byte is masked)
          const __m512i u0 =
              _mm512_or_si512(_mm512_and_si512(raw0, m4), _mm512_and_si512(_mm512_slli_epi16(top, 4), m30));
          const __m512i u1 =
              _mm512_or_si512(_mm512_and_si512(raw1, m4), _mm512_and_si512(_mm512_slli_epi16(top, 2), m30));
          const __m512i u2 =
              _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw0, 4), m4), _mm512_and_si512(top, m30));
          const __m512i u3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw1, 4), m4),
                                             _mm512_and_si512(_mm512_srli_epi16(top, 2), m30));
          for (int t = 0; t < T; ++t) {
            const int8_t* at = a[t] + sb * 256 + g * 16;
            const __m512i G0 =
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, bcast4(at)), u2, bcast4(at + 8));
            const __m512i G1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, bcast4(at + 4)), u3,
                                                   bcast4(at + 12));
            L[t] = _mm512_add_epi32(L[t], _mm512_mullo_epi32(_mm512_add_epi32(G0, G1), sc));
          }
        }
      }
      const __m512 d = halfs(p + Q6K_D);
      for (int t = 0; t < T; ++t) {
        const __m512 da = _mm512_set1_ps(r.drow(m0 + t)[sb]);
        const __m512i Lm = _mm512_sub_epi32(L[t], _mm512_slli_epi32(minus[t], 5));
        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(Lm)));
      }
    }
  }
  const int64_t real = std::min<int64_t>(NT, N - n0);
  const __mmask16 keep = static_cast<__mmask16>((1u << real) - 1);
  for (int t = 0; t < T; ++t) _mm512_mask_storeu_ps(y + (m0 + t) * N + n0, keep, acc[t]);
}

void run_tiles(int64_t format, const uint8_t* packed, int64_t N, int64_t K, const Rows& r, int64_t t0, int64_t t1,
               float* y) {
  const int64_t nsb = K / 256;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const uint8_t* P = packed + tile * nsb * tile_bytes(format);
    // the rows in near-equal groups of at most TILE_ROWS (9 rows: 5 + 4, not 6 + 3)
    const int64_t groups = (r.M + TILE_ROWS - 1) / TILE_ROWS, size = (r.M + groups - 1) / groups;
    for (int64_t m0 = 0; m0 < r.M; m0 += size) {
      switch (std::min<int64_t>(size, r.M - m0)) {
        case 1: tile_rows<1>(format, P, nsb, r, m0, N, tile * NT, y); break;
        case 2: tile_rows<2>(format, P, nsb, r, m0, N, tile * NT, y); break;
        case 3: tile_rows<3>(format, P, nsb, r, m0, N, tile * NT, y); break;
        case 4: tile_rows<4>(format, P, nsb, r, m0, N, tile * NT, y); break;
        case 5: tile_rows<5>(format, P, nsb, r, m0, N, tile * NT, y); break;
        default: tile_rows<6>(format, P, nsb, r, m0, N, tile * NT, y); break;
      }
    }
  }
}
