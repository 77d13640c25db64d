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

// A Q6_K group's four quads: each nibble | bit pair k of `top` moved to bits 4-5 (16-bit shifts: what crosses a byte
// is masked off).
inline void q6_quads(__m256i raw0, __m256i raw1, __m256i top, __m256i* u) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  u[0] = _mm256_or_si256(_mm256_and_si256(raw0, m4), _mm256_and_si256(_mm256_slli_epi16(top, 4), m30));
  u[1] = _mm256_or_si256(_mm256_and_si256(raw1, m4), _mm256_and_si256(_mm256_slli_epi16(top, 2), m30));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw0, 4), m4), _mm256_and_si256(top, m30));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw1, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(top, 2), m30));
}

// Rows m0 .. m0 + T - 1 times H halves of the tile at P, from half h0 (outputs n0 + 8 h0 ..): H = 2 for one row,
// each activation broadcast once for both halves (a one-token pass); H = 1 for several rows (the registers hold no
// more). The arithmetic per (row, output) is the same whatever T and H.
template <int T, int H>
void tile_rows(int64_t format, const uint8_t* P, int64_t nsb, const Rows& r, int64_t m0, int64_t N, int64_t n0, int h0,
               float* y) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const int64_t tb = tile_bytes(format);
  __m256 acc[H][T];
  const int8_t* a[T];
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) acc[h][t] = _mm256_setzero_ps();
    a[t] = r.arow(m0 + t);
  }
  auto load = [h0](const uint8_t* p, int h) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * (h0 + h)));
  };
  auto load16 = [h0](const uint8_t* p, int h) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * (h0 + h)));
  };
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = P + sb * tb;
    __m256i L[H][T];
    for (int h = 0; h < H; ++h)
      for (int t = 0; t < T; ++t) L[h][t] = _mm256_setzero_si256();
    if (format == Q4_K) {
      for (int g = 0; g < 8; ++g) {
        __m256i G0[H][T], G1[H][T];
        for (int h = 0; h < H; ++h)
          for (int t = 0; t < T; ++t) G0[h][t] = G1[h][t] = _mm256_setzero_si256();
        for (int b = 0; b < 4; ++b) {
          __m256i lo[H], hi[H];
          for (int h = 0; h < H; ++h) {
            const __m256i raw = load(p + Q4K_NIB + (g * 4 + b) * 64, h);
            lo[h] = _mm256_and_si256(raw, m4);
            hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
          }
          for (int t = 0; t < T; ++t) {
            const int8_t* at = a[t] + sb * 256 + g * 32;
            const __m256i alo = bcast4(at + b * 4), ahi = bcast4(at + (b + 4) * 4);
            for (int h = 0; h < H; ++h) {
              G0[h][t] = DPBUSD(G0[h][t], lo[h], alo);
              G1[h][t] = DPBUSD(G1[h][t], hi[h], ahi);
            }
          }
        }
        for (int h = 0; h < H; ++h) {
          const __m256i sc = _mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + Q4K_SC + g * 16 + 8 * (h0 + h))));
          for (int t = 0; t < T; ++t)
            L[h][t] = _mm256_add_epi32(L[h][t], _mm256_mullo_epi32(_mm256_add_epi32(G0[h][t], G1[h][t]), sc));
        }
      }
      __m256i mins[H][T];
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) mins[h][t] = _mm256_setzero_si256();
      for (int pr = 0; pr < 4; ++pr) {
        __m256i mn[H];
        for (int h = 0; h < H; ++h) mn[h] = _mm256_cvtepu8_epi16(load16(p + Q4K_MN + pr * 32, h));
        for (int t = 0; t < T; ++t) {
          const __m256i s = bcast_pair(r.s32row(m0 + t) + sb * 8 + pr * 2);
          for (int h = 0; h < H; ++h) mins[h][t] = DPWSSD(mins[h][t], mn[h], s);
        }
      }
      for (int h = 0; h < H; ++h) {
        const __m256 d = _mm256_cvtph_ps(load16(p + Q4K_D, h)), dmin = _mm256_cvtph_ps(load16(p + Q4K_DMIN, h));
        for (int t = 0; t < T; ++t) {
          const __m256 da = _mm256_set1_ps(r.drow(m0 + t)[sb]);
          acc[h][t] = _mm256_add_ps(acc[h][t], _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(L[h][t])));
          acc[h][t] =
              _mm256_sub_ps(acc[h][t], _mm256_mul_ps(_mm256_mul_ps(dmin, da), _mm256_cvtepi32_ps(mins[h][t])));
        }
      }
    } else {  // Q6_K
      __m256i minus[H][T];
      for (int h = 0; h < H; ++h)
        for (int t = 0; t < T; ++t) minus[h][t] = _mm256_setzero_si256();
      for (int pr = 0; pr < 8; ++pr) {  // groups 2 pr and 2 pr + 1
        __m256i sc2[H];
        for (int h = 0; h < H; ++h) sc2[h] = _mm256_cvtepi8_epi16(load16(p + Q6K_SC + pr * 32, h));
        for (int t = 0; t < T; ++t) {
          const __m256i s = bcast_pair(r.s16row(m0 + t) + sb * 16 + pr * 2);
          for (int h = 0; h < H; ++h) minus[h][t] = DPWSSD(minus[h][t], sc2[h], s);
        }
        for (int e = 0; e < 2; ++e) {
          const int g = pr * 2 + e;
          __m256i sc[H], u[H][4];
          for (int h = 0; h < H; ++h) {
            sc[h] = e == 0 ? _mm256_srai_epi32(_mm256_slli_epi32(sc2[h], 16), 16) : _mm256_srai_epi32(sc2[h], 16);
            q6_quads(load(p + q6k_nib(g, 0), h), load(p + q6k_nib(g, 1), h), load(p + q6k_top(g), h), u[h]);
          }
          for (int t = 0; t < T; ++t) {
            const int8_t* at = a[t] + sb * 256 + g * 16;
            const __m256i a0 = bcast4(at), a1 = bcast4(at + 4), a2 = bcast4(at + 8), a3 = bcast4(at + 12);
            for (int h = 0; h < H; ++h) {
              const __m256i G0 = DPBUSD(DPBUSD(_mm256_setzero_si256(), u[h][0], a0), u[h][2], a2);
              const __m256i G1 = DPBUSD(DPBUSD(_mm256_setzero_si256(), u[h][1], a1), u[h][3], a3);
              L[h][t] = _mm256_add_epi32(L[h][t], _mm256_mullo_epi32(_mm256_add_epi32(G0, G1), sc[h]));
            }
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const __m256 d = _mm256_cvtph_ps(load16(p + Q6K_D, h));
        for (int t = 0; t < T; ++t) {
          const __m256 da = _mm256_set1_ps(r.drow(m0 + t)[sb]);
          const __m256i Lm = _mm256_sub_epi32(L[h][t], _mm256_slli_epi32(minus[h][t], 5));
          acc[h][t] = _mm256_add_ps(acc[h][t], _mm256_mul_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(Lm)));
        }
      }
    }
  }
  for (int h = 0; h < H; ++h) {
    const int64_t first = n0 + 8 * (h0 + h), real = std::min<int64_t>(8, N - first);
    if (real <= 0) break;
    for (int t = 0; t < T; ++t) {
      float out[8];
      _mm256_storeu_ps(out, acc[h][t]);
      std::memcpy(y + (m0 + t) * N + first, out, real * sizeof(float));
    }
  }
}

void run_tiles(int64_t format, const uint8_t* packed, int64_t N, int64_t K, const Rows& r, int64_t t0, int64_t t1,
               float* y) {
  const int64_t nsb = K / 256;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const uint8_t* P = packed + tile * nsb * tile_bytes(format);
    if (r.M == 1) {
      tile_rows<1, 2>(format, P, nsb, r, 0, N, tile * NT, 0, y);
      continue;
    }
    for (int h = 0; h < 2 && tile * NT + 8 * h < N; ++h)
      for (int64_t m0 = 0; m0 < r.M; m0 += MB) {
        switch (std::min<int64_t>(MB, r.M - m0)) {
          case 1: tile_rows<1, 1>(format, P, nsb, r, m0, N, tile * NT, h, y); break;
          case 2: tile_rows<2, 1>(format, P, nsb, r, m0, N, tile * NT, h, y); break;
          case 3: tile_rows<3, 1>(format, P, nsb, r, m0, N, tile * NT, h, y); break;
          default: tile_rows<4, 1>(format, P, nsb, r, m0, N, tile * NT, h, y); break;
        }
      }
  }
}
