// libFuzzer target for a checkpoint's config.json (scripts/fuzz.sh model_config).
//
// ParseModelConfig reads the config of whatever checkpoint a user points the worker or `nq` at,
// so on any bytes it must return a Status without crashing or tripping a sanitizer (no integer
// overflow in the derived sizes, which UBSan traps), and a config it accepts must have the
// positive dimensions the loader sizes its tensors from.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_require.h"
#include "services/model/model_config.h"

using nq::fuzz::Require;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<nq::model::ModelConfig> config = nq::model::ParseModelConfig(text);
  if (!config.ok()) {
    Require(!config.status().message().empty());
    return 0;
  }
  Require(config->vocab_size > 0 && config->hidden_size > 0 && config->num_hidden_layers > 0);
  Require(config->num_attention_heads > 0 && config->QkHeadDim() > 0 && config->v_head_dim > 0);
  Require(config->qk_rope_head_dim % 2 == 0);
  for (int64_t layer = 0; layer < config->num_hidden_layers; ++layer) {
    if (config->IsMoeLayer(layer)) {
      Require(config->n_routed_experts > 0 && config->num_experts_per_tok > 0);
      Require(config->num_experts_per_tok <= config->n_routed_experts);
    }
  }
  return 0;
}
