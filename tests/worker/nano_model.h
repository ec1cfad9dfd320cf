// glm5_nano (models/glm5_nano: trained, with an MTP layer) on the CPU backend for the worker's
// speculative decoding tests, and prompts cut from its held-out text.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/model/model.h"
#include "services/worker/sequence_runner.h"

namespace nq::worker::testing {

std::string NanoModelDir();

// A CPU backend and one model instance on it (each instance holds its own KV cache).
struct LoadedModel {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<model::Model> model;
};
absl::StatusOr<LoadedModel> LoadModel(const std::string& dir, int64_t max_tokens = 1024);

// `count` prompts of varied lengths (4 to ~100 tokens) from varied offsets of the held-out
// eval domains (models/glm5_nano/eval/*.tokens.json), deterministic.
std::vector<std::vector<int32_t>> HeldOutPrompts(int count);

// `length` tokens of the libs_code held-out domain (about 18k tokens) from `offset`: long prompts
// and conversations cut from one text.
std::vector<int32_t> HeldOutText(size_t offset, size_t length);

// What a run emitted: every step's tokens, the finish reason, and each step as the runner
// reported it.
struct RunResult {
  std::vector<int32_t> ids;
  std::vector<float> logprobs;
  nq::v1::FinishReason finish = nq::v1::FINISH_REASON_UNSPECIFIED;
  std::vector<SequenceStep> steps;
};
absl::StatusOr<RunResult> Generate(SequenceRunner& runner, const SequenceRequest& request);

}  // namespace nq::worker::testing
