// Small config.json objects shared by the model_config tests, and helpers to read the
// committed full-size samples (tests/model_config/data, see its README.md).
#pragma once

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

namespace nq::model::testing {

inline std::string DataDir(const std::string& name) {
  return std::string(NQ_MODEL_CONFIG_TEST_DATA) + "/" + name;
}

inline std::string ReadDataConfig(const std::string& name) {
  std::ifstream in(DataDir(name) + "/config.json");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A 4-layer DeepseekV3 with every key the parser requires and a few it defaults.
inline nlohmann::json TinyDeepseekV3() {
  return {
      {"architectures", {"DeepseekV3ForCausalLM"}},
      {"vocab_size", 256},
      {"hidden_size", 64},
      {"intermediate_size", 128},
      {"moe_intermediate_size", 32},
      {"num_hidden_layers", 4},
      {"num_attention_heads", 4},
      {"q_lora_rank", 32},
      {"kv_lora_rank", 16},
      {"qk_nope_head_dim", 16},
      {"qk_rope_head_dim", 8},
      {"v_head_dim", 16},
      {"n_routed_experts", 8},
      {"num_experts_per_tok", 2},
      {"n_group", 2},
      {"topk_group", 1},
      {"first_k_dense_replace", 1},
  };
}

// A 4-layer GlmMoeDsa: TinyDeepseekV3 plus a small DSA indexer.
inline nlohmann::json TinyGlmMoeDsa() {
  nlohmann::json config = TinyDeepseekV3();
  config["architectures"] = {"GlmMoeDsaForCausalLM"};
  config["index_topk"] = 16;
  config["index_head_dim"] = 16;
  config["index_n_heads"] = 2;
  return config;
}

}  // namespace nq::model::testing
