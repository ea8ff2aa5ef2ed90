#include "common/kernels/amx_emulation_support.h"

#include "common/cpu_features.h"
#include "common/kernels/amx_emulation.h"
#include "common/kernels/gemm_internal.h"

namespace vlm::kernels::testing {

uint64_t EmulatedTileDotInstructions() { return amx_emulation::DotInstructionCount().load(); }

bool HaveAmxHardware() { return RequestAmxPermission(); }

void UseAmxEmulation() { internal::SetAmxBlockKernel(internal::EmulatedAmxBlock); }

std::string UseAmxEmulationUnlessHardware() {
  if (HaveAmxHardware()) return "hardware";
  UseAmxEmulation();
  return "emulation";
}

}  // namespace vlm::kernels::testing
