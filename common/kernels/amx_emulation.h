// AMX tile intrinsics in portable C++, for tests on CPUs without AMX. Never
// part of a service: the AMX kernel (gemm_amx.cc) is compiled a second time
// with this header included first (gemm_amx_emulated.cc, library
// vlm_amx_emulation), so its unchanged source runs here.
//
// Semantics follow the Intel SDM (palette 1: 8 tiles of at most 16 rows x 64
// bytes, tile shapes from the 64-byte LDTILECFG block):
//   - TILELOADD / TILELOADDT1 read rows x colsb bytes at base + row·stride; bytes
//     beyond colsb and rows beyond the configured rows read as zero.
//   - TILESTORED writes rows x colsb bytes; TILEZERO zeroes the whole tile;
//     TILERELEASE returns to the unconfigured state.
//   - TDPBF16PS, per the SDM's Operation section (not the shorter intrinsics-
//     guide form that adds each product straight into the destination): for
//     each row m, two f32 accumulators per output column start at zero, the
//     even k-elements' products go into one and the odd ones' into the other
//     (each an FMA, RNE), over k = 0 .. a.colsb/4 - 1 in order; then
//     dst[m][n] += (even + odd). Input denormals (bf16 and the f32 dst) count
//     as zero (DAZ), denormal results become zero (FTZ); MXCSR plays no part.
//   - TDPB[SU][SU]D: int8 x int8 dot products of 4, accumulated into int32
//     with wrap-around.
// What real hardware faults on (#UD / #GP) aborts with a message: a tile
// instruction before LDTILECFG or on a tile the configuration leaves empty,
// a configuration with rows > 16, colsb > 64, a non-zero reserved byte or a
// palette other than 0/1, operand shapes that do not fit (K, M or N
// mismatch), and the same tile twice in one TDP instruction.
//
// Tile state is per thread, like the hardware's. The tile numbers must be
// constant expressions, as GCC's macros (which paste them into the assembly)
// require.
#pragma once

// The real declarations first: <immintrin.h> has include guards, so once the
// names below are redefined, a later #include <immintrin.h> changes nothing.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace vlm::amx_emulation {

constexpr int kTiles = 8;       // palette 1: tmm0..tmm7
constexpr int kMaxRows = 16;
constexpr int kMaxColsb = 64;

struct TileState {
  bool configured = false;
  uint8_t start_row = 0;
  uint8_t rows[kTiles] = {};
  uint16_t colsb[kTiles] = {};
  alignas(64) uint8_t data[kTiles][kMaxRows][kMaxColsb] = {};
};

// TDP instructions executed by the emulation in this process (all threads):
// lets a test tell that the emulated tiles really ran.
inline std::atomic<uint64_t>& DotInstructionCount() {
  static std::atomic<uint64_t> count{0};
  return count;
}

inline TileState& State() {
  static thread_local TileState state;
  return state;
}

[[noreturn]] inline void Fault(const char* instruction, const char* what, int tile = -1) {
  if (tile >= 0) {
    std::fprintf(stderr, "AMX emulation: %s tmm%d: %s (the hardware raises a fault here)\n",
                 instruction, tile, what);
  } else {
    std::fprintf(stderr, "AMX emulation: %s: %s (the hardware raises a fault here)\n", instruction,
                 what);
  }
  std::abort();
}

// The tile `t` must be configured (non-empty) for `instruction`.
inline void RequireTile(const char* instruction, int t) {
  const TileState& s = State();
  if (!s.configured) Fault(instruction, "no tile configuration loaded (LDTILECFG)", t);
  if (s.rows[t] == 0 || s.colsb[t] == 0) Fault(instruction, "tile is not configured", t);
}

// f32 from bf16 bits, input denormals as signed zero (DAZ).
inline float Bf16ToF32Daz(uint16_t bits) {
  if ((bits & 0x7F80u) == 0) bits &= 0x8000u;
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Denormal f32 to signed zero (DAZ on inputs, FTZ on results).
inline float FlushDenormal(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
  std::memcpy(&f, &u, 4);
  return f;
}

// Layout of the 64-byte LDTILECFG operand.
struct Config {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(Config) == 64, "LDTILECFG reads 64 bytes");

inline void LoadConfig(const void* memory) {
  Config c;
  std::memcpy(&c, memory, sizeof c);  // all 64 bytes, as the instruction reads them
  TileState& s = State();
  if (c.palette_id == 0) {  // palette 0: the init state
    s = TileState();
    return;
  }
  if (c.palette_id != 1) Fault("LDTILECFG", "palette other than 0 and 1");
  for (uint8_t r : c.reserved) {
    if (r != 0) Fault("LDTILECFG", "reserved byte not zero");
  }
  for (int t = 0; t < 16; ++t) {
    if (t >= kTiles) {
      if (c.rows[t] != 0 || c.colsb[t] != 0) {
        Fault("LDTILECFG", "palette 1 has 8 tiles; tiles 8-15 must be zero", t);
      }
      continue;
    }
    if (c.rows[t] > kMaxRows) Fault("LDTILECFG", "rows beyond the palette's 16", t);
    if (c.colsb[t] > kMaxColsb) Fault("LDTILECFG", "colsb beyond the palette's 64 bytes", t);
    if ((c.rows[t] == 0) != (c.colsb[t] == 0)) {
      Fault("LDTILECFG", "rows and colsb must both be zero or both non-zero", t);
    }
  }
  s = TileState();
  s.configured = true;
  s.start_row = c.start_row;
  for (int t = 0; t < kTiles; ++t) {
    s.rows[t] = c.rows[t];
    s.colsb[t] = c.colsb[t];
  }
}

inline void StoreConfig(void* memory) {
  const TileState& s = State();
  Config c{};
  if (s.configured) {
    c.palette_id = 1;
    c.start_row = s.start_row;
    for (int t = 0; t < kTiles; ++t) {
      c.rows[t] = s.rows[t];
      c.colsb[t] = s.colsb[t];
    }
  }
  std::memcpy(memory, &c, sizeof c);
}

inline void Release() { State() = TileState(); }

inline void Zero(int t) {
  TileState& s = State();
  RequireTile("TILEZERO", t);
  std::memset(s.data[t], 0, sizeof s.data[t]);
}

// TILELOADD and TILELOADDT1 (the hint only concerns caches).
inline void Load(const char* instruction, int t, const void* base, long stride) {
  TileState& s = State();
  RequireTile(instruction, t);
  const uint8_t* p = static_cast<const uint8_t*>(base);
  for (int r = 0; r < kMaxRows; ++r) {
    uint8_t* row = s.data[t][r];
    if (r < s.rows[t] && r >= s.start_row) {
      std::memcpy(row, p + static_cast<long>(r) * stride, s.colsb[t]);
      std::memset(row + s.colsb[t], 0, kMaxColsb - s.colsb[t]);
    } else if (r >= s.rows[t]) {
      std::memset(row, 0, kMaxColsb);
    }
  }
  s.start_row = 0;
}

inline void Store(int t, void* base, long stride) {
  TileState& s = State();
  RequireTile("TILESTORED", t);
  uint8_t* p = static_cast<uint8_t*>(base);
  for (int r = s.start_row; r < s.rows[t]; ++r) {
    std::memcpy(p + static_cast<long>(r) * stride, s.data[t][r], s.colsb[t]);
  }
  s.start_row = 0;
}

// Shape checks shared by the TDP instructions: C[M x N] += A[M x K]·B[K x N]
// with K counted in 4-byte groups (bf16 pairs, int8 quads).
inline void CheckDotShapes(const char* instruction, int dst, int a, int b) {
  RequireTile(instruction, dst);
  RequireTile(instruction, a);
  RequireTile(instruction, b);
  if (dst == a || dst == b || a == b) Fault(instruction, "the three tiles must differ", dst);
  const TileState& s = State();
  if (s.colsb[dst] % 4 != 0 || s.colsb[a] % 4 != 0 || s.colsb[b] % 4 != 0) {
    Fault(instruction, "colsb not a multiple of 4", dst);
  }
  if (s.rows[a] != s.rows[dst]) Fault(instruction, "M mismatch: a.rows != dst.rows", dst);
  if (s.colsb[a] / 4 != s.rows[b]) Fault(instruction, "K mismatch: a.colsb / 4 != b.rows", dst);
  if (s.colsb[b] != s.colsb[dst]) Fault(instruction, "N mismatch: b.colsb != dst.colsb", dst);
}

// After a TDP instruction: bytes beyond colsb in each written row
// (write_row_and_zero) and the rows beyond the configured ones
// (zero_upper_rows) read as zero.
inline void ZeroUpperRows(int t) {
  TileState& s = State();
  for (int r = s.rows[t]; r < kMaxRows; ++r) std::memset(s.data[t][r], 0, kMaxColsb);
  for (int r = 0; r < s.rows[t]; ++r) {
    std::memset(s.data[t][r] + s.colsb[t], 0, kMaxColsb - s.colsb[t]);
  }
  s.start_row = 0;
}

// round(c + a·b) once, as an FMA. a and b come from bf16, so their product
// has at most 16 significant bits and is exact in f32 unless it under- or
// overflows: then c + a·b in f32 rounds once too. Only the rare tiny products
// need the fused operation itself.
inline float FmaBf16Product(float a, float b, float c) {
  const float p = a * b;
  if (std::isnormal(p) || a == 0.0f || b == 0.0f || !std::isfinite(p)) return c + p;
  return std::fma(a, b, c);
}

inline void DotBf16Ps(int dst, int a, int b) {
  CheckDotShapes("TDPBF16PS", dst, a, b);
  DotInstructionCount().fetch_add(1, std::memory_order_relaxed);
  TileState& s = State();
  const int rows = s.rows[dst], n_count = s.colsb[dst] / 4, k_count = s.colsb[a] / 4;
  // Both sources as f32 with DAZ applied, once per instruction.
  float af[kMaxRows][kMaxColsb / 2], bf[kMaxRows][kMaxColsb / 2];
  for (int r = 0; r < kMaxRows; ++r) {
    uint16_t arow[kMaxColsb / 2], brow[kMaxColsb / 2];
    std::memcpy(arow, s.data[a][r], sizeof arow);
    std::memcpy(brow, s.data[b][r], sizeof brow);
    for (int i = 0; i < kMaxColsb / 2; ++i) {
      af[r][i] = Bf16ToF32Daz(arow[i]);
      bf[r][i] = Bf16ToF32Daz(brow[i]);
    }
  }
  for (int m = 0; m < rows; ++m) {
    // temp1 of the SDM: even[n] is temp1.fp32[2n], odd[n] is temp1.fp32[2n+1].
    float even[kMaxColsb / 4] = {}, odd[kMaxColsb / 4] = {};
    for (int k = 0; k < k_count; ++k) {
      const float a0 = af[m][2 * k], a1 = af[m][2 * k + 1];
      for (int n = 0; n < n_count; ++n) {
        even[n] = FlushDenormal(FmaBf16Product(a0, bf[k][2 * n], even[n]));
        odd[n] = FlushDenormal(FmaBf16Product(a1, bf[k][2 * n + 1], odd[n]));
      }
    }
    float c[kMaxColsb / 4];
    std::memcpy(c, s.data[dst][m], sizeof c);
    for (int n = 0; n < n_count; ++n) {
      const float sum = FlushDenormal(even[n] + odd[n]);
      c[n] = FlushDenormal(FlushDenormal(c[n]) + sum);
    }
    std::memcpy(s.data[dst][m], c, sizeof c);
  }
  ZeroUpperRows(dst);
}

// TDPBSSD (signed a, signed b), TDPBSUD, TDPBUSD (unsigned a, signed b), TDPBUUD.
template <bool kSignedA, bool kSignedB>
void DotInt8(const char* instruction, int dst, int a, int b) {
  CheckDotShapes(instruction, dst, a, b);
  DotInstructionCount().fetch_add(1, std::memory_order_relaxed);
  TileState& s = State();
  const int rows = s.rows[dst], n_count = s.colsb[dst] / 4, k_count = s.colsb[a] / 4;
  auto value = [](uint8_t byte, bool is_signed) -> int32_t {
    return is_signed ? static_cast<int32_t>(static_cast<int8_t>(byte)) : static_cast<int32_t>(byte);
  };
  for (int m = 0; m < rows; ++m) {
    uint32_t c[kMaxColsb / 4];
    std::memcpy(c, s.data[dst][m], sizeof c);
    for (int k = 0; k < k_count; ++k) {
      for (int n = 0; n < n_count; ++n) {
        uint32_t acc = c[n];
        for (int i = 0; i < 4; ++i) {
          const int32_t p = value(s.data[a][m][4 * k + i], kSignedA) *
                            value(s.data[b][k][4 * n + i], kSignedB);
          acc += static_cast<uint32_t>(p);  // int32 wrap-around
        }
        c[n] = acc;
      }
    }
    std::memcpy(s.data[dst][m], c, sizeof c);
  }
  ZeroUpperRows(dst);
}

template <int kTile>
constexpr int TileNumber() {
  static_assert(kTile >= 0 && kTile < kTiles, "palette 1 has tiles tmm0..tmm7");
  return kTile;
}

}  // namespace vlm::amx_emulation

// The intrinsics' names, now on the emulation. _tile_loadconfig,
// _tile_storeconfig and _tile_release are inline functions in GCC's header;
// the macros take precedence over them from here on.
#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#define _tile_loadconfig(config) ::vlm::amx_emulation::LoadConfig(config)
#define _tile_storeconfig(config) ::vlm::amx_emulation::StoreConfig(config)
#define _tile_release() ::vlm::amx_emulation::Release()
#define _tile_loadd(dst, base, stride) \
  ::vlm::amx_emulation::Load("TILELOADD", ::vlm::amx_emulation::TileNumber<dst>(), base, stride)
#define _tile_stream_loadd(dst, base, stride) \
  ::vlm::amx_emulation::Load("TILELOADDT1", ::vlm::amx_emulation::TileNumber<dst>(), base, stride)
#define _tile_stored(src, base, stride) \
  ::vlm::amx_emulation::Store(::vlm::amx_emulation::TileNumber<src>(), base, stride)
#define _tile_zero(dst) ::vlm::amx_emulation::Zero(::vlm::amx_emulation::TileNumber<dst>())
#define _tile_dpbf16ps(dst, a, b)                                                          \
  ::vlm::amx_emulation::DotBf16Ps(::vlm::amx_emulation::TileNumber<dst>(),                 \
                                  ::vlm::amx_emulation::TileNumber<a>(),                   \
                                  ::vlm::amx_emulation::TileNumber<b>())
#define _tile_dpbssd(dst, a, b)                                                            \
  (::vlm::amx_emulation::DotInt8<true, true>("TDPBSSD", ::vlm::amx_emulation::TileNumber<dst>(), \
                                            ::vlm::amx_emulation::TileNumber<a>(),         \
                                            ::vlm::amx_emulation::TileNumber<b>()))
#define _tile_dpbsud(dst, a, b)                                                            \
  (::vlm::amx_emulation::DotInt8<true, false>("TDPBSUD", ::vlm::amx_emulation::TileNumber<dst>(), \
                                             ::vlm::amx_emulation::TileNumber<a>(),        \
                                             ::vlm::amx_emulation::TileNumber<b>()))
#define _tile_dpbusd(dst, a, b)                                                            \
  (::vlm::amx_emulation::DotInt8<false, true>("TDPBUSD", ::vlm::amx_emulation::TileNumber<dst>(), \
                                             ::vlm::amx_emulation::TileNumber<a>(),        \
                                             ::vlm::amx_emulation::TileNumber<b>()))
#define _tile_dpbuud(dst, a, b)                                                            \
  (::vlm::amx_emulation::DotInt8<false, false>("TDPBUUD",                                   \
                                              ::vlm::amx_emulation::TileNumber<dst>(),     \
                                              ::vlm::amx_emulation::TileNumber<a>(),       \
                                              ::vlm::amx_emulation::TileNumber<b>()))
