// Decode steps as captured graphs (model.h, "Step graphs", says when they apply and how buckets
// work). A step's host inputs are its first position and its token ids; both live in device
// memory (step_position_, StepGraph::ids) that is written before each run, so the captured ops
// never change. What the step hands back, the logits (or, for a step that samples on the device,
// the sampled ids) and the final hidden states, is copied into host staging by the graph itself.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <functional>
#include <span>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"

namespace nq::model {

using kernels::Shape;
using kernels::StepPosition;
using kernels::Tensor;

bool Model::StepGraphApplies(size_t tokens, int mtp_index) const {
  const bool captures = backend_.CanCapture() || options_.uncaptured_step_graphs;
  if (!options_.step_graphs || !captures || !step_graph_stats_.disabled.ok()) return false;
  if (lookahead_observer_) return false;  // the lookahead routes on the host between layers
  if (tokens == 0 || tokens > static_cast<size_t>(kMaxStepGraphTokens)) return false;
  if (options_.tp.world_size > 1) {
    // A tensor-parallel rank graphs its decode, verification and MTP steps when its collectives
    // can be recorded (NCCL): a vocabulary-sharded head's gather [W, T, Vr] becomes logits rows on
    // the device (InterleaveRankBlocks). Every rank takes the same path for the same step, so the
    // collectives match.
    const bool records = comm_ != nullptr && (comm_->CanCapture() || options_.uncaptured_step_graphs);
    if (!records) return false;
  }
  // Packed and NVFP4 layers both route on the device (NVFP4's graphed tokens were checked against
  // op-by-op ones on the H200: scripts/device/run_side_streams.sh's nvfp4 section).
  auto routes_on_backend = [&](const LayerWeights& lw) { return !lw.moe.has_value() || RoutesOnBackend(*lw.moe); };
  if (mtp_index >= 0) {
    return mtp_index < static_cast<int>(weights_.mtp.size()) && routes_on_backend(weights_.mtp[mtp_index].block);
  }
  return std::all_of(weights_.layers.begin(), weights_.layers.end(), routes_on_backend);
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

absl::Status Model::EnqueueStep(const Tensor& ids, int64_t start_bound, const StepSampling* sample) {
  const int64_t T = ids.shape().dim(0), D = config_.hidden_size;
  const StepPosition start = StepPosition::OnDevice(step_position_, start_bound);
  ASSIGN_OR_RETURN(Tensor x, backend_.Allocate(kernels::DType::kF32, Shape{T, D}));
  RETURN_IF_ERROR(backend_.Embedding(ids, weights_.embed, x));
  selection_.reset();
  // Each layer's last residual is added by the next norm (the final one after the last layer).
  PendingResidual residual;
  for (int64_t layer = 0; layer < config_.num_hidden_layers; ++layer) {
    RETURN_IF_ERROR(RunLayer(weights_.layers[static_cast<size_t>(layer)], layer, static_cast<size_t>(layer), x, start,
                             &residual));
  }
  selection_.reset();  // memory allocated in a capture must be freed in it
  RETURN_IF_ERROR(NormWithResidual(x, residual, weights_.final_norm, x));
  ASSIGN_OR_RETURN(Tensor logits, LogitRows(x, weights_.lm_head));
  auto* out = static_cast<std::byte*>(step_output_->data());
  // The step's result ahead of the final states: the sampled ids, or the logits.
  const Tensor* result = &logits;
  if (sample != nullptr) {
    if (sample->logit_delta != nullptr) RETURN_IF_ERROR(backend_.Add(logits, *sample->logit_delta, logits));
    RETURN_IF_ERROR(backend_.SampleTokens(logits, *sample->sample_params, *sample->sampled));
    result = sample->sampled;
  }
  RETURN_IF_ERROR(backend_.CopyToHostAsync(*result, std::span<std::byte>(out, result->nbytes())));
  return backend_.CopyToHostAsync(x, std::span<std::byte>(out + logits.nbytes(), x.nbytes()));
}

absl::StatusOr<Tensor> Model::EnqueueMtpForward(int index, const Tensor& ids, const Tensor& hidden,
                                                 StepPosition position) {
  const MtpWeights& m = weights_.mtp[static_cast<size_t>(index)];
  const int64_t T = ids.shape().dim(0), D = config_.hidden_size;
  ASSIGN_OR_RETURN(Tensor e, backend_.Allocate(kernels::DType::kF32, Shape{T, D}));
  RETURN_IF_ERROR(backend_.Embedding(ids, weights_.embed, e));
  // A copy: the input states stay as uploaded (MtpInput normalises in place).
  ASSIGN_OR_RETURN(Tensor h, backend_.Allocate(kernels::DType::kF32, Shape{T, D}));
  RETURN_IF_ERROR(backend_.Copy(hidden, h));
  ASSIGN_OR_RETURN(Tensor u, MtpInput(m, e, h));
  const int64_t layer = config_.num_hidden_layers + index;
  selection_.reset();
  PendingResidual residual;
  RETURN_IF_ERROR(RunLayer(m.block, layer, static_cast<size_t>(layer), u, position, &residual));
  selection_.reset();  // memory allocated in a capture must be freed in it
  RETURN_IF_ERROR(NormWithResidual(u, residual, m.head_norm, u));
  return u;
}

absl::Status Model::EnqueueMtpStep(int index, const Tensor& ids, const Tensor& hidden, int64_t start_bound) {
  const MtpWeights& m = weights_.mtp[static_cast<size_t>(index)];
  ASSIGN_OR_RETURN(Tensor u, EnqueueMtpForward(index, ids, hidden, StepPosition::OnDevice(step_position_, start_bound)));
  // The MTP head is vocabulary-sharded as lm_head is.
  ASSIGN_OR_RETURN(Tensor logits, LogitRows(u, m.head));
  auto* out = static_cast<std::byte*>(step_output_->data());
  RETURN_IF_ERROR(backend_.CopyToHostAsync(logits, std::span<std::byte>(out, logits.nbytes())));
  return backend_.CopyToHostAsync(u, std::span<std::byte>(out + logits.nbytes(), u.nbytes()));
}

int64_t Model::StepGraphVocab() const { return weights_.lm_head.shape().dim(0) * options_.tp.world_size; }

absl::Status Model::PrepareStepGraphs() {
  if (!step_position_.valid()) {
    ASSIGN_OR_RETURN(step_position_, backend_.Allocate(kernels::DType::kI32, Shape{1}));
  }
  if (step_output_ == nullptr) {
    int64_t vocab_rows = StepGraphVocab();
    for (const MtpWeights& m : weights_.mtp) {
      vocab_rows = std::max(vocab_rows, m.head.shape().dim(0) * options_.tp.world_size);  // gathered
    }
    const size_t bytes = static_cast<size_t>(kMaxStepGraphTokens * (vocab_rows + config_.hidden_size)) * sizeof(float);
    ASSIGN_OR_RETURN(step_output_, backend_.AllocateHostStaging(bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> Model::RunStepGraph(StepGraph& g, const std::function<absl::Status()>& enqueue) {
  if (!backend_.CanCapture()) {  // options_.uncaptured_step_graphs: every step as a warm-up runs
    RETURN_IF_ERROR(enqueue());
    RETURN_IF_ERROR(backend_.Synchronize());
    ++step_graph_stats_.warmups;
    return true;
  }
  // Memory the warm-up sized or a graph reads was replaced since (a workspace grew, the routing
  // staging was reallocated): warm up and capture again.
  if (g.backend_generation != backend_.CaptureGeneration() || g.staging_generation != routing_staging_generation_) {
    g.graph.reset();
    g.warmed = false;
  }
  if (g.graph == nullptr && g.warmed) {
    // The bucket's second step: every scratch and workspace has its size, so the same ops can be
    // recorded. Nothing runs during the capture.
    // Memory allocated outside a capture must not be freed inside it: the captured forward resets
    // the selection a forward before it (an op-by-op draft, a prefill) may have left, and
    // cudaFreeAsync of such memory fails, which failed the capture at the next kernel's launch
    // check (N = 2 drafts on the H200 ran op by op for that; bench/README.md).
    selection_.reset();
    RETURN_IF_ERROR(backend_.BeginCapture());
    const absl::Status enqueued = enqueue();
    selection_.reset();
    std::vector<LoggedRouting> log = std::move(routing_log_);
    routing_log_.clear();
    routing_staging_used_ = 0;
    absl::StatusOr<std::unique_ptr<kernels::Backend::Graph>> graph = backend_.EndCapture();
    if (!enqueued.ok() || !graph.ok()) {
      step_graph_stats_.disabled = enqueued.ok() ? graph.status() : enqueued;
      step_graphs_.clear();
      return false;
    }
    g.graph = std::move(*graph);
    g.routing_log = std::move(log);
    ++step_graph_stats_.captured;
  }
  if (g.graph != nullptr) {
    RETURN_IF_ERROR(g.graph->Run());
    routing_log_ = g.routing_log;
    ++step_graph_stats_.replayed;
    return true;
  }
  // The bucket's first step: the same ops, run as they are enqueued, size everything the capture
  // will need.
  RETURN_IF_ERROR(enqueue());
  RETURN_IF_ERROR(backend_.Synchronize());
  g.warmed = true;
  g.backend_generation = backend_.CaptureGeneration();
  g.staging_generation = routing_staging_generation_;
  ++step_graph_stats_.warmups;
  return true;
}

// The graph's embedding cannot refuse an id: check them on the host, as the host-ids path does.
absl::Status Model::CheckTokenIds(std::span<const int32_t> tokens, int64_t vocab, absl::string_view what) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": token ", i, " is ", tokens[i], ", outside the vocabulary of ", vocab));
    }
  }
  return absl::OkStatus();
}

absl::Status Model::BeginGraphedForward(std::span<const int32_t> tokens, int64_t log_rows, absl::string_view what) {
  RETURN_IF_ERROR(CheckTokenIds(tokens, weights_.embed.shape().dim(0), what));
  RETURN_IF_ERROR(RefreshSlotTables());
  RETURN_IF_ERROR(BeginRoutingLog(log_rows));
  return PrepareStepGraphs();
}

absl::StatusOr<std::vector<float>> Model::GraphedForward(std::span<const int32_t> tokens,
                                                         std::span<const kernels::SampleParams> sample,
                                                         std::span<int32_t> sampled,
                                                         std::span<const float> logit_delta) {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point entered = Clock::now();
  const int64_t T = static_cast<int64_t>(tokens.size()), start = cache_.length();
  const int64_t D = config_.hidden_size, V = StepGraphVocab();
  if (start + T > cache_.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("Forward: ", start, " cached + ", T,
                                                   " new tokens exceed the cache of ", cache_.max_tokens()));
  }
  RETURN_IF_ERROR(cache_.CheckWritable(start, T, "Forward"));
  RETURN_IF_ERROR(BeginGraphedForward(tokens, T, "Forward"));
  const int64_t bucket_end = StepGraphBucketEnd(start + T);
  const bool samples = !sample.empty();  // one draw, or one a token (ForwardSampledRows checks)
  // Row r's draw (one entry: every row's).
  auto draw = [&](int64_t row) -> const kernels::SampleParams& { return sample[sample.size() == 1 ? 0 : static_cast<size_t>(row)]; };
  // A draw that adds a logit delta row (ForwardSampled checked: one token, V values) has its
  // own graph, with the Add before the draw.
  const bool adjusted = samples && !logit_delta.empty();
  StepGraph& g = step_graphs_[{-1, T, bucket_end, samples, adjusted ? 1 : 0}];
  if (!g.ids.valid()) {
    ASSIGN_OR_RETURN(g.ids, backend_.Allocate(kernels::DType::kI32, Shape{T}));
  }
  if (samples && !g.sampled.valid()) {
    ASSIGN_OR_RETURN(g.sample_params,
                     backend_.Allocate(kernels::DType::kU8, Shape{T, static_cast<int64_t>(sizeof(kernels::SampleParams))}));
    ASSIGN_OR_RETURN(g.sampled, backend_.Allocate(kernels::DType::kI32, Shape{T}));
  }
  if (adjusted && !g.logit_delta.valid()) {
    ASSIGN_OR_RETURN(g.logit_delta, backend_.Allocate(kernels::DType::kF32, Shape{1, V}));
  }
  const int32_t position = static_cast<int32_t>(start);
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const int32_t>(&position, 1)), step_position_));
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(tokens), g.ids));
  StepSampling sampling;
  if (samples) {
    // Each row with its draw (a plain step uses the last row's id, a verification every row's;
    // the rows run in parallel, so the others cost no time).
    std::array<kernels::SampleParams, kMaxStepGraphTokens> rows;
    for (int64_t row = 0; row < T; ++row) rows[static_cast<size_t>(row)] = draw(row);
    RETURN_IF_ERROR(backend_.CopyFromHost(
        std::as_bytes(std::span<const kernels::SampleParams>(rows).first(static_cast<size_t>(T))), g.sample_params));
    sampling = {.sample_params = &g.sample_params, .sampled = &g.sampled};
  }
  if (adjusted) {
    RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(logit_delta), g.logit_delta));
    sampling.logit_delta = &g.logit_delta;
  }
  const Tensor& ids = g.ids;
  const Clock::time_point launched = Clock::now();
  ASSIGN_OR_RETURN(const bool ran, RunStepGraph(g, [&] {
                     return EnqueueStep(ids, bucket_end - T, samples ? &sampling : nullptr);
                   }));
  const Clock::time_point returned = Clock::now();
  if (!ran) {  // graphs are off now: op by op
    ASSIGN_OR_RETURN(std::vector<float> logits, Forward(tokens));
    if (samples) {
      for (int64_t row = 0; row < T; ++row) {
        const std::span<float> row_logits =
            std::span<float>(logits).subspan(static_cast<size_t>(row * V), static_cast<size_t>(V));
        AddLogitDelta(logit_delta, row_logits);
        sampled[static_cast<size_t>(row)] = kernels::SampleRowHost(row_logits, draw(row));
      }
    }
    return logits;
  }
  // A collective the step held may have been cut short (a peer died, the group aborted): then
  // the staging holds no step, and the cache keeps its length.
  if (options_.tp.world_size > 1) RETURN_IF_ERROR(comm_->CheckCompleted());
  const auto* out = static_cast<const std::byte*>(step_output_->data());
  const auto* hidden = reinterpret_cast<const float*>(out + T * V * static_cast<int64_t>(sizeof(float)));
  last_hidden_.assign(hidden, hidden + T * D);
  std::vector<float> logits;
  if (samples) {
    std::memcpy(sampled.data(), out, static_cast<size_t>(T) * sizeof(int32_t));
  } else {
    const auto* values = reinterpret_cast<const float*>(out);
    logits.assign(values, values + T * V);
  }
  FlushRoutingLog();
  cache_.set_length(start + T);
  auto ns = [](Clock::duration d) { return std::chrono::duration_cast<std::chrono::nanoseconds>(d).count(); };
  ++step_graph_stats_.timed_forwards;
  step_graph_stats_.host_before_launch_ns += ns(launched - entered);
  step_graph_stats_.launch_and_wait_ns += ns(returned - launched);
  step_graph_stats_.host_after_wait_ns += ns(Clock::now() - returned);
  return logits;
}

absl::StatusOr<std::vector<float>> Model::GraphedMtpForward(std::span<const int32_t> next_tokens,
                                                            std::span<const float> hidden, int index) {
  const int64_t T = static_cast<int64_t>(next_tokens.size()), D = config_.hidden_size;
  if (static_cast<int64_t>(hidden.size()) != T * D) {
    return absl::InvalidArgumentError(absl::StrCat("ForwardMtp: ", T, " tokens with ", hidden.size(),
                                                   " hidden values (want tokens x ", D, ")"));
  }
  if (mtp_length_ + T > cache_.max_tokens()) return absl::InvalidArgumentError("ForwardMtp: the MTP cache is full");
  RETURN_IF_ERROR(cache_.CheckWritable(mtp_length_, T, "ForwardMtp"));
  const int64_t V = weights_.mtp[static_cast<size_t>(index)].head.shape().dim(0) * options_.tp.world_size;
  RETURN_IF_ERROR(BeginGraphedForward(next_tokens, T, "ForwardMtp"));
  const int64_t bucket_end = StepGraphBucketEnd(mtp_length_ + T);
  StepGraph& g = step_graphs_[{index, T, bucket_end, false, 0}];
  if (!g.ids.valid()) {
    ASSIGN_OR_RETURN(g.ids, backend_.Allocate(kernels::DType::kI32, Shape{T}));
    ASSIGN_OR_RETURN(g.hidden, backend_.Allocate(kernels::DType::kF32, Shape{T, D}));
  }
  const int32_t position = static_cast<int32_t>(mtp_length_);
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const int32_t>(&position, 1)), step_position_));
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(next_tokens), g.ids));
  RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(hidden), g.hidden));
  const Tensor& ids = g.ids;
  const Tensor& states = g.hidden;
  ASSIGN_OR_RETURN(const bool ran,
                   RunStepGraph(g, [&] { return EnqueueMtpStep(index, ids, states, bucket_end - T); }));
  if (!ran) return ForwardMtp(next_tokens, hidden, index);  // graphs are off now: op by op
  if (options_.tp.world_size > 1) RETURN_IF_ERROR(comm_->CheckCompleted());  // as GraphedForward
  const auto* out = static_cast<const float*>(step_output_->data());
  std::vector<float> logits(out, out + T * V);
  last_mtp_hidden_.assign(out + T * V, out + T * V + T * D);
  FlushRoutingLog();
  mtp_length_ += T;
  return logits;
}

}  // namespace nq::model
