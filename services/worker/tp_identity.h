// What every rank of a tensor-parallel group must agree on before it may join (DESIGN.md
// "Tensor parallelism"): the same checkpoint and release, the same world size, the same numeric
// settings. Rank 0 publishes its identity; a follower compares its own and refuses to join,
// naming the first field that differs, rather than computing garbage in step with the others.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::worker {

struct TpIdentity {
  std::string model_id;     // served model name
  std::string config_hash;  // FNV-1a of the checkpoint's config.json (same name, other model)
  std::string release_id;   // "" when the experts are the checkpoint's
  std::string expert_bits;  // --expert_bits
  int world_size = 1;
  std::string backend;
  std::string weight_dtype;
  std::string kv_cache_dtype;
  int64_t max_model_len = 0;

  // "key=value" lines, in a fixed order.
  std::string Serialize() const;
  // OK when `leader` (rank 0's Serialize()) equals this identity; else FAILED_PRECONDITION
  // naming the first field that differs: "release: rank 0 serves 'a', this rank 'b'".
  absl::Status CheckAgainstLeader(absl::string_view leader) const;
};

// FNV-1a 64 of `model_dir`/config.json, as 16 hex digits.
absl::StatusOr<std::string> ConfigHash(const std::string& model_dir);

}  // namespace nq::worker
