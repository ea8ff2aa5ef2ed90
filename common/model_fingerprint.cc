#include "common/model_fingerprint.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/sha256.h"
#include "nlohmann/json.hpp"

namespace vlm {
namespace {

// Netstring framing ("<len>:<bytes>,") keeps the hashed stream unambiguous.
void Field(Sha256Hasher& h, std::string_view s) {
  h.Update(absl::StrCat(s.size(), ":"));
  h.Update(s);
  h.Update(",");
}

std::string Fingerprint(std::string_view kind, std::string_view config_part,
                        const SafetensorsCheckpoint& checkpoint, std::string_view name_prefix) {
  Sha256Hasher h;
  Field(h, "vlm-model-fingerprint-v1");
  Field(h, kind);
  Field(h, config_part);
  Field(h, name_prefix);
  for (const auto& [key, value] : checkpoint.metadata()) {  // std::map: sorted
    Field(h, key);
    Field(h, value);
  }
  Field(h, "tensors");
  for (const std::string& name : checkpoint.Names()) {  // sorted
    if (name.compare(0, name_prefix.size(), name_prefix) != 0) continue;
    const TensorInfo* info = *checkpoint.Info(name);
    Field(h, name);
    Field(h, StDTypeName(info->dtype));
    Field(h, absl::StrJoin(info->shape, ","));
  }
  return h.FinishHex();
}

}  // namespace

std::string ModelFingerprint(std::string_view config_json, const SafetensorsCheckpoint& checkpoint,
                             std::string_view name_prefix) {
  return Fingerprint("model", config_json, checkpoint, name_prefix);
}

absl::StatusOr<std::string> ModelFingerprintOfDir(const std::string& model_dir) {
  const std::string config_path = absl::StrCat(model_dir, "/config.json");
  std::ifstream in(config_path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(config_path, ": cannot open"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) return absl::InternalError(absl::StrCat(config_path, ": read failed"));
  auto checkpoint = SafetensorsCheckpoint::Open(model_dir);
  if (!checkpoint.ok()) return checkpoint.status();
  return ModelFingerprint(buffer.str(), **checkpoint);
}

absl::StatusOr<std::string> ComponentFingerprint(std::string_view config_json,
                                                 const SafetensorsCheckpoint& checkpoint,
                                                 std::string_view config_key, std::string_view name_prefix) {
  nlohmann::json config = nlohmann::json::parse(config_json.begin(), config_json.end(), nullptr,
                                                /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::InvalidArgumentError("config.json: not a JSON object");
  }
  auto it = config.find(std::string(config_key));
  if (it == config.end()) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: ", std::string(config_key), ": missing"));
  }
  // nlohmann::json keeps object keys sorted, so dump() is canonical.
  const std::string canonical = it->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return Fingerprint(absl::StrCat("component:", std::string(config_key)), canonical, checkpoint, name_prefix);
}

}  // namespace vlm
