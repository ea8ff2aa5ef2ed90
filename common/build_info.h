// What was built: version, git commit (at CMake configure time) and compiler.
#ifndef VLM_COMMON_BUILD_INFO_H_
#define VLM_COMMON_BUILD_INFO_H_

namespace vlm {

struct BuildInfo {
  const char* version;     // e.g. "0.1.0"
  const char* git_commit;  // short hash, "unknown" outside a git checkout
  const char* compiler;    // e.g. "GNU 12.2.0"
};

const BuildInfo& GetBuildInfo();

}  // namespace vlm

#endif  // VLM_COMMON_BUILD_INFO_H_
