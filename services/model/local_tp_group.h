// W tensor-parallel ranks of one model inside this process: each rank is a thread with its
// own CPU backend, its own shard of the weights and a CpuCommunicator. This is how the CPU
// backend runs tensor parallelism (tests, `nq logits --tp W`); GPU workers run one rank per
// process over NCCL instead.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/comm/cpu_communicator.h"
#include "services/model/model.h"

namespace nq::model {

class LocalTpGroup {
 public:
  // Loads one rank's model; Model::Load by default (a caller may swap in release experts).
  using RankLoader = std::function<absl::StatusOr<std::unique_ptr<Model>>(kernels::Backend&, kernels::Communicator*,
                                                                          ModelOptions)>;
  // `options` apply to every rank (max_tokens, kv_cache_dtype); options.tp is set per rank.
  static absl::StatusOr<std::unique_ptr<LocalTpGroup>> Load(const std::string& model_dir, int world_size,
                                                            ModelOptions options = {}, RankLoader loader = nullptr);

  // Runs Forward on every rank at once; returns rank 0's logits after checking that every
  // rank produced the same ones (they must: the last step is an all-gather).
  absl::StatusOr<std::vector<float>> Forward(std::span<const int32_t> tokens);
  // ForwardMtp on every rank, with rank 0's last hidden states.
  absl::StatusOr<std::vector<float>> ForwardMtp(std::span<const int32_t> next_tokens,
                                                std::span<const float> hidden);
  // DraftOnDevice on every rank (what the worker's kDraftOnDevice command makes followers do);
  // rank 0's drafts after checking that every rank drew the same.
  absl::StatusOr<std::vector<int32_t>> DraftOnDevice(std::span<const int32_t> next_tokens,
                                                     std::span<const float> hidden, int num_drafts,
                                                     const kernels::SampleParams& draw);
  Model& rank0() { return *models_[0]; }
  int world_size() const { return static_cast<int>(models_.size()); }

 private:
  // fn on every rank at once (each a thread); rank 0's result once every rank's equals it.
  template <typename Fn>
  auto OnEveryRank(Fn fn) -> decltype(fn(std::declval<Model&>()));

  std::vector<std::unique_ptr<kernels::Backend>> backends_;
  std::vector<std::unique_ptr<kernels::CpuCommunicator>> comms_;
  std::vector<std::unique_ptr<Model>> models_;
};

}  // namespace nq::model
