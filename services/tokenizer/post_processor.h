// Post-processors of tokenizer.json ("post_processor"): the ids a single sequence is wrapped in
// when add_special_tokens is set. ByteLevel adds nothing; TemplateProcessing's "single"
// template, BertProcessing / RobertaProcessing ([cls] A [sep]) and Sequence of these are
// reduced to a prefix and a suffix.
//
// Note: the reference reads only tokenizer.json here. The three model tokenizers we test
// have a ByteLevel post-processor, so add_special_tokens adds no BOS, even where
// tokenizer_config.json says add_bos_token (DeepSeek-V3): chat templates write the BOS.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::tokenizer {

struct PostProcessor {
  std::vector<int32_t> prefix;
  std::vector<int32_t> suffix;
};

// `token_id` resolves a token string (vocabulary or added token) to its id.
absl::StatusOr<PostProcessor> MakePostProcessor(
    const nlohmann::json& config, const std::function<std::optional<int32_t>(const std::string&)>& token_id);

}  // namespace nq::tokenizer
