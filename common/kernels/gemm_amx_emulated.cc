// The AMX block kernel compiled against the AMX emulation: the same source as
// gemm_amx.cc, its tile intrinsics replaced by amx_emulation.h, defining
// internal::EmulatedAmxBlock. Test-only (library vlm_amx_emulation); no
// service links it.
#define VLM_AMX_EMULATION 1
#include "common/kernels/amx_emulation.h"

#include "common/kernels/gemm_amx.cc"  // NOLINT(build/include): compiled again on purpose
