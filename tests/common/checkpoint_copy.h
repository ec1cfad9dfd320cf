// Test helper: a copy of a checkpoint directory with some tensors left out (a checkpoint as
// transformers' save_pretrained writes it without the MTP layer, or a broken one).
#pragma once

#include <functional>
#include <string>

#include "absl/status/status.h"

namespace nq::testing {

// Writes `to` (created if missing) holding `from`'s JSON files and one model.safetensors with
// every tensor of `from`'s checkpoint for which `drop(name)` is false, bytes unchanged.
absl::Status CopyCheckpointWithout(const std::string& from, const std::string& to,
                                   const std::function<bool(const std::string& name)>& drop);

}  // namespace nq::testing
