// The GLM-5-shaped test config the release tests encode (configs/test/glm5_encode.json: hidden
// 128, 16 experts, a dense layer, a MoE layer and an MTP layer).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/statusor.h"
#include "services/model/model_config.h"

namespace nq::release::testing {

inline absl::StatusOr<model::ModelConfig> EncodeTestConfig() {
  std::ifstream in(std::string(NQ_SOURCE_DIR) + "/configs/test/glm5_encode.json");
  std::stringstream text;
  text << in.rdbuf();
  return model::ParseModelConfig(text.str());
}

}  // namespace nq::release::testing
