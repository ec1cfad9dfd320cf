#include "services/model/local_tp_group.h"

#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::model {

absl::StatusOr<std::unique_ptr<LocalTpGroup>> LocalTpGroup::Load(const std::string& model_dir, int world_size,
                                                                 ModelOptions options, RankLoader loader) {
  auto group = std::unique_ptr<LocalTpGroup>(new LocalTpGroup());
  ASSIGN_OR_RETURN(group->comms_, kernels::CpuCommunicatorGroup::Create(world_size));
  // Share the cores between the ranks.
  const int threads = std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(world_size));
  for (int r = 0; r < world_size; ++r) {
    ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend,
                     kernels::CreateBackend("cpu", kernels::BackendOptions{.cpu_threads = threads}));
    options.tp = {r, world_size};
    ASSIGN_OR_RETURN(std::unique_ptr<Model> model,
                     loader ? loader(*backend, group->comms_[r].get(), options)
                            : Model::Load(model_dir, *backend, group->comms_[r].get(), options));
    group->backends_.push_back(std::move(backend));
    group->models_.push_back(std::move(model));
  }
  return group;
}

template <typename Fn>
auto LocalTpGroup::OnEveryRank(Fn fn) -> decltype(fn(std::declval<Model&>())) {
  const int W = world_size();
  std::vector<decltype(fn(std::declval<Model&>()))> results(W, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 1; r < W; ++r) threads.emplace_back([&, r] { results[r] = fn(*models_[r]); });
  results[0] = fn(*models_[0]);
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < W; ++r) {
    if (!results[r].ok()) return Annotate(results[r].status(), absl::StrCat("rank ", r));
  }
  for (int r = 1; r < W; ++r) {
    if (*results[r] != *results[0]) {
      return absl::InternalError(absl::StrCat("rank ", r, " computed another result than rank 0"));
    }
  }
  return std::move(results[0]);
}

absl::StatusOr<std::vector<float>> LocalTpGroup::Forward(std::span<const int32_t> tokens) {
  return OnEveryRank([&](Model& m) { return m.Forward(tokens); });
}

absl::StatusOr<std::vector<float>> LocalTpGroup::ForwardMtp(std::span<const int32_t> next_tokens,
                                                            std::span<const float> hidden) {
  return OnEveryRank([&](Model& m) { return m.ForwardMtp(next_tokens, hidden); });
}

absl::StatusOr<std::vector<int32_t>> LocalTpGroup::DraftOnDevice(std::span<const int32_t> next_tokens,
                                                                 std::span<const float> hidden, int num_drafts,
                                                                 const kernels::SampleParams& draw) {
  return OnEveryRank([&](Model& m) { return m.DraftOnDevice(next_tokens, hidden, num_drafts, draw); });
}

}  // namespace nq::model
