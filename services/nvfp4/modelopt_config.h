// The quantization config NVIDIA ModelOpt writes with an NVFP4 checkpoint, in both places
// readers look: hf_quant_config.json next to the weights, and config.json's
// "quantization_config" (quant_method "modelopt"). vLLM and SGLang read either.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::nvfp4 {

inline constexpr absl::string_view kHfQuantConfigName = "hf_quant_config.json";
inline constexpr absl::string_view kQuantAlgo = "NVFP4";
inline constexpr absl::string_view kProducerName = "nestquant-serve";

struct ModeloptConfig {
  nlohmann::json quantization_config;  // for config.json
  nlohmann::json hf_quant_config;      // hf_quant_config.json
};

// exclude_modules lists the modules left unquantized. Each kept module name has its numeric
// path components replaced by '*' ("model.layers.*.self_attn.o_proj") so the list stays short
// on a 78-layer model; a generalised pattern that would also match a quantized module is
// replaced by the exact names it stood for.
ModeloptConfig BuildModeloptConfig(const std::vector<std::string>& kept_modules,
                                   const std::vector<std::string>& quantized_modules);

// What a reader needs from hf_quant_config.json.
struct ModeloptInfo {
  std::string quant_algo;
  int group_size = 0;
  std::vector<std::string> exclude_modules;
};

// Reads `dir`/hf_quant_config.json. NOT_FOUND without it; INVALID_ARGUMENT naming the file for
// malformed JSON or a missing/mistyped "quantization" {"quant_algo", "group_size"}.
absl::StatusOr<ModeloptInfo> ReadHfQuantConfig(const std::string& dir);

// Writes `text` to `path` through a temporary file in the same directory and a rename, so a
// reader never sees half a file. INTERNAL on I/O failure.
absl::Status WriteTextFileAtomically(const std::string& path, const std::string& text);

}  // namespace nq::nvfp4
