// Decode steps as captured graphs (model.h, "Step graphs", says when they apply and how buckets
// work). A step's host inputs are its first position and its token ids; both live in device
// memory (step_position_, StepGraph::ids) that is written before each run, so the captured ops
// never change. What the step hands back, the logits and the final hidden states, is copied into
// host staging by the graph itself.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"

namespace nq::model {

using kernels::Shape;
using kernels::StepPosition;
using kernels::Tensor;

bool Model::StepGraphApplies(size_t tokens) const {
  if (!options_.step_graphs || !backend_.CanCapture() || !step_graph_stats_.disabled.ok()) return false;
  if (tokens == 0 || tokens > static_cast<size_t>(kMaxStepGraphTokens) || options_.tp.world_size != 1) return false;
  return std::all_of(weights_.layers.begin(), weights_.layers.end(),
                     [&](const LayerWeights& lw) { return !lw.moe.has_value() || RoutesOnBackend(*lw.moe); });
}

int64_t Model::StepGraphBucketEnd(int64_t end) const {
  // A quarter of the power of two at or below `end`, 256 positions at least: the attention and
  // indexer launches are sized for the bucket's end, so at most about a quarter of their key
  // splits find nothing to do, and a long decode captures about four graphs per doubling.
  int64_t power = 1;
  while (power <= end / 2) power *= 2;
  const int64_t step = std::max<int64_t>(256, power / 4);
  return std::min((end + step - 1) / step * step, cache_.max_tokens());
}

absl::Status Model::EnqueueStep(const Tensor& ids, int64_t start_bound) {
  const int64_t T = ids.shape().dim(0), D = config_.hidden_size;
  const StepPosition start = StepPosition::OnDevice(step_position_, start_bound);
  ASSIGN_OR_RETURN(Tensor x, backend_.Allocate(kernels::DType::kF32, Shape{T, D}));
  RETURN_IF_ERROR(backend_.Embedding(ids, weights_.embed, x));
  selection_.reset();
  for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
    RETURN_IF_ERROR(RunLayer(weights_.layers[static_cast<size_t>(layer)], layer, static_cast<size_t>(layer), x, start));
  }
  selection_.reset();  // memory allocated in a capture must be freed in it
  RETURN_IF_ERROR(backend_.RmsNorm(x, weights_.final_norm, static_cast<float>(config_.rms_norm_eps), x));
  const int64_t V = weights_.lm_head.shape().dim(0);
  ASSIGN_OR_RETURN(Tensor logits, backend_.Allocate(kernels::DType::kF32, Shape{T, V}));
  RETURN_IF_ERROR(backend_.MatMul(x, weights_.lm_head, logits));
  auto* out = static_cast<std::byte*>(step_output_->data());
  RETURN_IF_ERROR(backend_.CopyToHostAsync(logits, std::span<std::byte>(out, logits.nbytes())));
  return backend_.CopyToHostAsync(x, std::span<std::byte>(out + logits.nbytes(), x.nbytes()));
}

absl::StatusOr<std::vector<float>> Model::GraphedForward(std::span<const int32_t> tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size()), start = cache_.length();
  const int64_t D = config_.hidden_size, V = weights_.lm_head.shape().dim(0);
  const int64_t vocab = weights_.embed.shape().dim(0);
  if (start + T > cache_.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: ", start, " cached + ", T,
                                                   " new tokens exceed the cache of ", cache_.max_tokens()));
  }
  // The graph's embedding cannot refuse an id: check them here, as the host-ids path does.
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("Forward: token ", i, " is ", tokens[i], ", outside the vocabulary of ", vocab));
    }
  }
  RETURN_IF_ERROR(RefreshSlotTables());
  RETURN_IF_ERROR(BeginRoutingLog(T));
  if (!step_position_.valid()) {
    ASSIGN_OR_RETURN(step_position_, backend_.Allocate(kernels::DType::kI32, Shape{1}));
  }
  if (step_output_ == nullptr) {
    const size_t bytes = static_cast<size_t>(kMaxStepGraphTokens * (V + D)) * sizeof(float);
    ASSIGN_OR_RETURN(step_output_, backend_.AllocateHostStaging(bytes));
  }
  const int64_t bucket_end = StepGraphBucketEnd(start + T);
  StepGraph& g = step_graphs_[{T, bucket_end}];
  if (!g.ids.valid()) {
    ASSIGN_OR_RETURN(g.ids, backend_.Allocate(kernels::DType::kI32, Shape{T}));
  }
  const int32_t position = static_cast<int32_t>(start);
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const int32_t>(&position, 1)), step_position_));
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(tokens), g.ids));

  // Memory the warm-up sized or a graph reads was replaced since (a workspace grew, the routing
  // staging was reallocated): warm up and capture again.
  if (g.backend_generation != backend_.CaptureGeneration() || g.staging_generation != routing_staging_generation_) {
    g.graph.reset();
    g.warmed = false;
  }
  if (g.graph == nullptr && g.warmed) {
    // The second step of the bucket: every scratch and workspace has its size, so the same ops
    // can be recorded. Nothing runs during the capture.
    RETURN_IF_ERROR(backend_.BeginCapture());
    const absl::Status enqueued = EnqueueStep(g.ids, bucket_end - T);
    selection_.reset();
    std::vector<LoggedRouting> log = std::move(routing_log_);
    routing_log_.clear();
    routing_staging_used_ = 0;
    absl::StatusOr<std::unique_ptr<kernels::Backend::Graph>> graph = backend_.EndCapture();
    if (!enqueued.ok() || !graph.ok()) {
      // Turn graphs off for this model and run the step op by op: nothing of it ran yet.
      step_graph_stats_.disabled = enqueued.ok() ? graph.status() : enqueued;
      step_graphs_.clear();
      return Forward(tokens);
    }
    g.graph = std::move(*graph);
    g.routing_log = std::move(log);
    ++step_graph_stats_.captured;
  }
  if (g.graph != nullptr) {
    RETURN_IF_ERROR(g.graph->Run());
    routing_log_ = g.routing_log;
    ++step_graph_stats_.replayed;
  } else {
    // The bucket's first step: the same ops, run as they are enqueued, size everything the
    // capture will need.
    RETURN_IF_ERROR(EnqueueStep(g.ids, bucket_end - T));
    RETURN_IF_ERROR(backend_.Synchronize());
    g.warmed = true;
    g.backend_generation = backend_.CaptureGeneration();
    g.staging_generation = routing_staging_generation_;
    ++step_graph_stats_.warmups;
  }
  const auto* out = static_cast<const float*>(step_output_->data());
  std::vector<float> logits(out, out + T * V);
  last_hidden_.assign(out + T * V, out + T * V + T * D);
  FlushRoutingLog();
  cache_.set_length(start + T);
  return logits;
}

}  // namespace nq::model
