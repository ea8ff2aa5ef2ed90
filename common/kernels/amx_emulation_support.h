// Test support: runs GemmPath::kAmx through the AMX emulation where the CPU
// (or the OS) gives no AMX. Links only into tests (vlm_amx_emulation).
#pragma once

#include <cstdint>
#include <string>

namespace vlm::kernels::testing {

// Installs internal::EmulatedAmxBlock as the AMX block kernel unless real AMX
// tiles are usable; returns "hardware" or "emulation". Idempotent.
std::string UseAmxEmulationUnlessHardware();
// Installs the emulated kernel even where real AMX runs.
void UseAmxEmulation();
// TDP tile instructions the emulation has executed in this process.
uint64_t EmulatedTileDotInstructions();
// Whether the real tiles are usable here (CPUID + the kernel's permission).
bool HaveAmxHardware();

}  // namespace vlm::kernels::testing
