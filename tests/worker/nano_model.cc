#include "tests/worker/nano_model.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "services/common/status_macros.h"

namespace nq::worker::testing {

std::string NanoModelDir() { return std::string(NQ_SOURCE_DIR) + "/models/glm5_nano"; }

absl::StatusOr<LoadedModel> LoadModel(const std::string& dir, int64_t max_tokens) {
  LoadedModel loaded;
  ASSIGN_OR_RETURN(loaded.backend, kernels::CreateBackend("cpu"));
  ASSIGN_OR_RETURN(loaded.model,
                   model::Model::Load(dir, *loaded.backend, nullptr, model::ModelOptions{.max_tokens = max_tokens, .tp = {}}));
  return loaded;
}

std::vector<std::vector<int32_t>> HeldOutPrompts(int count) {
  const std::vector<std::string> domains = {"stdlib_code", "libs_code", "docstrings", "stdlib_tests"};
  std::vector<std::vector<int32_t>> texts;
  for (const std::string& domain : domains) {
    std::ifstream in(NanoModelDir() + "/eval/" + domain + ".tokens.json");
    std::stringstream buffer;
    buffer << in.rdbuf();
    texts.push_back(nlohmann::json::parse(buffer.str()).get<std::vector<int32_t>>());
  }
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < count; ++i) {
    const std::vector<int32_t>& text = texts[static_cast<size_t>(i) % texts.size()];
    const size_t length = 4 + static_cast<size_t>(i * 37) % 97;
    const size_t offset = (static_cast<size_t>(i) * 7919 * 13) % (text.size() - length);
    prompts.emplace_back(text.begin() + static_cast<std::ptrdiff_t>(offset),
                         text.begin() + static_cast<std::ptrdiff_t>(offset + length));
  }
  return prompts;
}

std::vector<int32_t> HeldOutText(size_t offset, size_t length) {
  static const std::vector<int32_t> text = [] {
    std::ifstream in(NanoModelDir() + "/eval/libs_code.tokens.json");
    std::stringstream buffer;
    buffer << in.rdbuf();
    return nlohmann::json::parse(buffer.str()).get<std::vector<int32_t>>();
  }();
  EXPECT_LE(offset + length, text.size());
  return std::vector<int32_t>(text.begin() + static_cast<std::ptrdiff_t>(std::min(offset, text.size())),
                              text.begin() + static_cast<std::ptrdiff_t>(std::min(offset + length, text.size())));
}

absl::StatusOr<RunResult> Generate(SequenceRunner& runner, const SequenceRequest& request) {
  RunResult result;
  ASSIGN_OR_RETURN(SequenceStats stats, runner.Run(
                                            request,
                                            [&](const SequenceStep& step) {
                                              for (const SampledToken& t : step.tokens) {
                                                result.ids.push_back(t.id);
                                                result.logprobs.push_back(t.logprob);
                                              }
                                              if (step.finish != nq::v1::FINISH_REASON_UNSPECIFIED) {
                                                result.finish = step.finish;
                                              }
                                              result.steps.push_back(step);
                                              return true;
                                            },
                                            [] { return false; }));
  if (stats.completion_tokens != result.ids.size()) {
    return absl::InternalError("completion_tokens disagrees with the emitted tokens");
  }
  return result;
}

}  // namespace nq::worker::testing
