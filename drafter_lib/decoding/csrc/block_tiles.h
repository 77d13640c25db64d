// The K-quants (Q4_K, Q6_K) multiplied 16 outputs at a time: the layout, the packing and the portable path
// (block_rows.cpp includes this once, outside the instruction-set namespaces; the vector paths are
// block_tiles_simd.h for AVX2 and AVX-VNNI, block_tiles_wide.h for AVX-512 VNNI).
//
// The weights are repacked once (`pack_tiles`) so that a register holds 16 outputs' weights for 4 consecutive
// inputs: one vpdpbusd (or vpmaddubsw + vpmaddwd) times 4 broadcast activation bytes gives each output's int32 sum of
// those 4 products, and the float work that follows is done for 16 outputs per instruction. The bytes are the
// file's: nothing rounded, the values only moved (Q4_K 148 bytes an output and super-block, Q6_K 210).
//
// The recipe, the same on every path: for each (row, output), per super-block in order,
//   L = sum over its groups g of sc_g * (sum of q_i a_i over the group's inputs)     (int32, exact)
//   Q6_K: L -= 32 * sum_g sc_g s_g, s_g the row's sum over group g                   (int32, exact)
//   acc = acc + (d * d_a) * float(L)
//   Q4_K: acc = acc - (dmin * d_a) * float(sum_g mn_g s_g)
// and the output is acc. A row's arithmetic never depends on the other rows, the tile, or the thread.

constexpr int64_t NT = 16;  // outputs per tile
// Bytes of a tile per super-block, and where each field starts in it.
// Q4_K: d, dmin fp16 [16]; sc u8 [8 groups][16]; mn u8 [4 pairs][16][2]; nibbles u8 [8 groups][4 blocks][16][4]
//       (block b of a group: low nibble = quad b, high = quad b + 4; quad j = the group's inputs 4j..4j+3)
// Q6_K: d fp16 [16]; sc s8 [8 pairs][16][2]; per group of 16 inputs: nibbles u8 [2 blocks][16][4] (low = quad b,
//       high = quad b + 2), top bit pairs u8 [16][4] (bits 2k, 2k + 1 of a byte: quad k's)
constexpr int64_t Q4K_D = 0, Q4K_DMIN = 32, Q4K_SC = 64, Q4K_MN = 192, Q4K_NIB = 320, Q4K_TILE = 2368;
constexpr int64_t Q6K_D = 0, Q6K_SC = 32, Q6K_GROUPS = 288, Q6K_TILE = 3360;
// Q6_K group g's bytes: its two nibble blocks, then its top bits (one stream: 192 bytes a group)
inline int64_t q6k_nib(int g, int b) { return Q6K_GROUPS + g * 192 + b * 64; }
inline int64_t q6k_top(int g) { return Q6K_GROUPS + g * 192 + 128; }

inline int64_t tile_bytes(int64_t format) { return format == Q4_K ? Q4K_TILE : Q6K_TILE; }

inline uint16_t half_bits(float v) { return c10::Half(v).x; }  // exact: the file's scales are fp16
inline float half_value(uint16_t b) { return static_cast<float>(c10::Half(b, c10::Half::from_bits())); }

// The value 0..15 (Q4_K) or 0..63 (Q6_K) of output row n's input i, from the weight's fields (block_rows.cpp).
inline uint8_t field_value(const Weight& w, int64_t n, int64_t i) {
  const int64_t sb = i / 256, j = i % 256;
  if (w.format == Q4_K) {
    const uint8_t b = w.q[n * (w.K / 2) + sb * 128 + (j / 64) * 32 + j % 32];
    return j % 64 < 32 ? b & 0x0F : b >> 4;
  }
  const int64_t h = j / 128;
  return q6_value(w.q + n * (w.K / 2) + sb * 128 + h * 64, w.mn + n * (w.K / 4) + sb * 64 + h * 32,
                  static_cast<int>((j % 128) / 32), static_cast<int>(j % 32));
}

// The fields of a Q4_K or Q6_K weight as tiles [ceil(N / 16)][K / 256][tile bytes]; outputs past N are zeros.
void pack_tiles(const Weight& w, uint8_t* out) {
  const int64_t nsb = w.K / 256, tb = tile_bytes(w.format), tiles = (w.N + NT - 1) / NT;
  std::memset(out, 0, tiles * nsb * tb);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tile = t0; tile < t1; ++tile)
      for (int64_t o = 0; o < NT && tile * NT + o < w.N; ++o) {
        const int64_t n = tile * NT + o;
        for (int64_t sb = 0; sb < nsb; ++sb) {
          uint8_t* p = out + (tile * nsb + sb) * tb;
          auto put_half = [&](int64_t at, float v) {
            const uint16_t h = half_bits(v);
            std::memcpy(p + at + 2 * o, &h, 2);
          };
          auto value = [&](int64_t i) { return field_value(w, n, sb * 256 + i); };
          put_half(Q4K_D, w.d[n * nsb + sb]);  // Q6K_D is the same place
          if (w.format == Q4_K) {
            put_half(Q4K_DMIN, w.dm[n * nsb + sb]);
            for (int g = 0; g < 8; ++g) {
              p[Q4K_SC + g * 16 + o] = w.sc[n * (w.K / 32) + sb * 8 + g];
              p[Q4K_MN + (g / 2) * 32 + o * 2 + g % 2] = w.mn[n * (w.K / 32) + sb * 8 + g];
              for (int b = 0; b < 4; ++b)
                for (int e = 0; e < 4; ++e)
                  p[Q4K_NIB + (g * 4 + b) * 64 + o * 4 + e] =
                      static_cast<uint8_t>(value(g * 32 + b * 4 + e) | (value(g * 32 + (b + 4) * 4 + e) << 4));
            }
          } else {
            for (int g = 0; g < 16; ++g) {
              p[Q6K_SC + (g / 2) * 32 + o * 2 + g % 2] = w.sc[n * (w.K / 16) + sb * 16 + g];
              for (int e = 0; e < 4; ++e) {
                uint8_t top = 0;
                for (int k = 0; k < 4; ++k) top |= static_cast<uint8_t>((value(g * 16 + k * 4 + e) >> 4) << (2 * k));
                p[q6k_top(g) + o * 4 + e] = top;
                for (int b = 0; b < 2; ++b)
                  p[q6k_nib(g, b) + o * 4 + e] = static_cast<uint8_t>(
                      (value(g * 16 + b * 4 + e) & 0x0F) | ((value(g * 16 + (b + 2) * 4 + e) & 0x0F) << 4));
              }
            }
          }
        }
      }
  });
}

namespace portable {

// Output o of a tile: the recipe above, from the packed bytes.
void tile_output(int64_t format, const uint8_t* P, int64_t nsb, const Rows& r, int64_t m, int64_t o, float* y) {
  const int64_t tb = tile_bytes(format);
  const int8_t* a = r.arow(m);
  float acc = 0.f;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const uint8_t* p = P + sb * tb;
    uint16_t db;
    std::memcpy(&db, p + Q4K_D + 2 * o, 2);
    const float da = r.drow(m)[sb];
    int32_t L = 0;
    if (format == Q4_K) {
      for (int g = 0; g < 8; ++g) {
        int32_t G = 0;
        for (int b = 0; b < 4; ++b)
          for (int e = 0; e < 4; ++e) {
            const uint8_t v = p[Q4K_NIB + (g * 4 + b) * 64 + o * 4 + e];
            G += (v & 0x0F) * a[sb * 256 + g * 32 + b * 4 + e] + (v >> 4) * a[sb * 256 + g * 32 + (b + 4) * 4 + e];
          }
        L += G * static_cast<int32_t>(p[Q4K_SC + g * 16 + o]);
      }
      int32_t mins = 0;
      for (int g = 0; g < 8; ++g)
        mins += static_cast<int32_t>(p[Q4K_MN + (g / 2) * 32 + o * 2 + g % 2]) * r.s32row(m)[sb * 8 + g];
      uint16_t mb;
      std::memcpy(&mb, p + Q4K_DMIN + 2 * o, 2);
      acc = acc + (half_value(db) * da) * static_cast<float>(L);
      acc = acc - (half_value(mb) * da) * static_cast<float>(mins);
    } else {
      int32_t minus = 0;
      for (int g = 0; g < 16; ++g) {
        int32_t G = 0;
        for (int k = 0; k < 4; ++k)
          for (int e = 0; e < 4; ++e) {
            const uint8_t nib = p[q6k_nib(g, k % 2) + o * 4 + e];
            const uint8_t low = k < 2 ? nib & 0x0F : nib >> 4;
            const uint8_t top = (p[q6k_top(g) + o * 4 + e] >> (2 * k)) & 3;
            G += static_cast<int32_t>(low | (top << 4)) * a[sb * 256 + g * 16 + k * 4 + e];
          }
        const int32_t sc = static_cast<int8_t>(p[Q6K_SC + (g / 2) * 32 + o * 2 + g % 2]);
        L += G * sc;
        minus += sc * r.s16row(m)[sb * 16 + g];
      }
      L -= 32 * minus;
      acc = acc + (half_value(db) * da) * static_cast<float>(L);
    }
  }
  *y = acc;
}

void run_tiles(int64_t format, const uint8_t* packed, int64_t N, int64_t K, const Rows& r, int64_t t0, int64_t t1,
               float* y) {
  const int64_t nsb = K / 256;
  for (int64_t tile = t0; tile < t1; ++tile)
    for (int64_t o = 0; o < NT && tile * NT + o < N; ++o)
      for (int64_t m = 0; m < r.M; ++m)
        tile_output(format, packed + tile * nsb * tile_bytes(format), nsb, r, m, o, y + m * N + tile * NT + o);
}

}  // namespace portable
