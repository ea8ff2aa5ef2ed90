// Model fingerprints: a hex SHA-256 that identifies a checkpoint by its
// config.json and its tensor headers (sorted name, dtype, shape) plus the
// files' __metadata__. Tensor values are NOT hashed (reading gigabytes at
// startup would defeat the mmap design): tools that write different random
// weights under the same headers should record something distinguishing (e.g.
// a seed) in __metadata__.
//
// Fingerprints key caches (vision features); they change whenever a hashed
// input changes and are stable across processes, machines and file layouts
// (sharding, tensor order, header padding do not matter).
#pragma once

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "common/safetensors.h"

namespace vlm {

// Over the exact `config_json` bytes and every tensor whose name starts with
// `name_prefix` (all tensors when empty).
std::string ModelFingerprint(std::string_view config_json, const SafetensorsCheckpoint& checkpoint,
                             std::string_view name_prefix = {});

// Reads <model_dir>/config.json and opens the checkpoint in model_dir.
absl::StatusOr<std::string> ModelFingerprintOfDir(const std::string& model_dir);

// Fingerprint of one model part: the `config_key` sub-object of config.json in
// canonical form (sorted keys, no whitespace: reformatting the file or editing
// other parts of it does not change it) plus the tensors under `name_prefix`.
// E.g. ("vision_config", "model.visual.") changes only with the vision tower.
// INVALID_ARGUMENT if config_json is not a JSON object or lacks config_key.
absl::StatusOr<std::string> ComponentFingerprint(std::string_view config_json,
                                                 const SafetensorsCheckpoint& checkpoint,
                                                 std::string_view config_key, std::string_view name_prefix);

}  // namespace vlm
