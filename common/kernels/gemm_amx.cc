// amx block kernel: 32x32 output blocks in four f32 tiles (C00 C01 C10 C11),
// per 32-wide K block two A tiles (16 rows x 32 bf16, read from x in place)
// and two B tiles (16 k-pairs x 16 columns, read from the blocked panel with a
// 128-byte row stride: the panel's pair rows are exactly the B tile rows).
// Compiled alone with -mamx-tile -mamx-bf16 -mamx-int8; only reached after
// GemmPathSupported(kAmx) (CPUID + arch_prctl permission).
//
// The tile configuration lives in static storage: GCC 12 declares
// _tile_loadconfig as reading 8 bytes, so the stores filling a stack copy
// may be dropped and the first tile instruction would raise SIGILL. Likewise
// GCC 12's _tile_loadd is an asm with no memory operand and no "memory"
// clobber: after the zero-padded copy of x is written, a compiler barrier
// keeps those stores ahead of the tile loads that read them.
//
// Built a second time against the AMX emulation (amx_emulation.h) as
// EmulatedAmxBlock, for tests on CPUs without AMX (gemm_amx_emulated.cc).
#include <cstring>
#include <vector>

#include "common/kernels/gemm_internal.h"

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

namespace vlm::kernels::internal {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// Tiles 0-3: C (16 rows x 16 f32); 4-5: A (16 rows x 32 bf16); 6-7: B (16
// pair rows x 16 columns). Every tile is 16 rows x 64 bytes.
constexpr TileConfig MakeConfig() {
  TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}
alignas(64) static const TileConfig kTileConfig = MakeConfig();

constexpr int kBlockRows = 32;

// Orders the compiler's stores before the tile loads that read them.
inline void CompilerBarrier() { asm volatile("" ::: "memory"); }

}  // namespace

#ifdef VLM_AMX_EMULATION
#define VLM_AMX_BLOCK EmulatedAmxBlock
#else
#define VLM_AMX_BLOCK AmxBlock
#endif

void VLM_AMX_BLOCK(const Problem& p, int64_t m0, int64_t m1, int64_t j0, int64_t j1) {
  _tile_loadconfig(&kTileConfig);
  const int64_t kp = p.w.kpairs;            // multiple of 16
  const int64_t kpad = 2 * kp;              // padded K, multiple of 32
  const bool direct_k = p.w.k == kpad;      // x rows can be read in place
  thread_local std::vector<uint16_t> a_buf;
  alignas(64) float acc[kBlockRows * kPanelCols];
  for (int64_t m = m0; m < m1; m += kBlockRows) {
    const int rows = static_cast<int>(m1 - m < kBlockRows ? m1 - m : kBlockRows);
    const uint16_t* a = p.x + m * p.ld_x;
    int64_t lda = p.ld_x;
    if (rows < kBlockRows || !direct_k) {  // zero-padded copy: 32 rows x kpad
      a_buf.assign(static_cast<size_t>(kBlockRows * kpad), 0);
      for (int r = 0; r < rows; ++r) {
        std::memcpy(a_buf.data() + r * kpad, a + r * p.ld_x, p.w.k * sizeof(uint16_t));
      }
      a = a_buf.data();
      lda = kpad;
      CompilerBarrier();
    }
    const size_t a_stride = static_cast<size_t>(lda) * sizeof(uint16_t);
    for (int64_t j = j0; j < j1; ++j) {
      const uint16_t* b = p.w.panel(j);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < kp; kb += 16) {
        _tile_loadd(4, a + 2 * kb, a_stride);
        _tile_loadd(5, a + 16 * lda + 2 * kb, a_stride);
        _tile_loadd(6, b + kb * 2 * kPanelCols, 2 * kPanelCols * sizeof(uint16_t));
        _tile_loadd(7, b + kb * 2 * kPanelCols + 32, 2 * kPanelCols * sizeof(uint16_t));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      const size_t c_stride = kPanelCols * sizeof(float);
      _tile_stored(0, acc, c_stride);
      _tile_stored(1, acc + 16, c_stride);
      _tile_stored(2, acc + 16 * kPanelCols, c_stride);
      _tile_stored(3, acc + 16 * kPanelCols + 16, c_stride);
      StoreTile(p.epilogue, m, rows, j, acc);
    }
  }
  _tile_release();
}

#undef VLM_AMX_BLOCK

}  // namespace vlm::kernels::internal
