// Drafting on the backend (model.h, DraftOnDevice). Each MTP forward's next input is the draft
// its head drew and its own last normed state, both already on the backend, so the chain needs
// the host only to upload its first entries and to read the drafts once at the end: drafting N
// tokens costs one graph replay instead of N forwards, each with a logits download, a host
// softmax and a state upload.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"

namespace nq::model {

using kernels::Shape;
using kernels::StepPosition;
using kernels::Tensor;

bool Model::DraftsOnDevice(size_t rows, int drafts, int index) const {
  // At W > 1 every rank of the group drafts alike (the leader mirrors the call, step_command.h):
  // the head's gathered logits are the same on every rank, and so are the greedy picks.
  return index >= 0 && index < static_cast<int>(weights_.mtp.size()) &&
         (options_.tp.world_size == 1 || comm_ != nullptr) && !lookahead_observer_ && rows >= 1 &&
         rows <= static_cast<size_t>(kMaxStepGraphTokens) && drafts >= 1 && drafts <= kMaxStepGraphTokens;
}

absl::Status Model::EnqueueMtpDrafts(int index, StepGraph& g, int64_t bucket_end) {
  const MtpWeights& m = weights_.mtp[static_cast<size_t>(index)];
  const int64_t T = g.ids.shape().dim(0), D = config_.hidden_size;
  const int drafts = static_cast<int>(g.draft_ids.size());
  // The first forward feeds the kept entries; only its last row drafts.
  ASSIGN_OR_RETURN(Tensor state,
                   EnqueueMtpForward(index, g.ids, g.hidden, StepPosition::OnDevice(g.forward_positions[0], bucket_end - T)));
  if (T > 1) {
    ASSIGN_OR_RETURN(Tensor last, backend_.Allocate(kernels::DType::kF32, Shape{1, D}));
    RETURN_IF_ERROR(backend_.CopyRows(state, T - 1, last, 0, 1));
    state = std::move(last);
  }
  for (int i = 0; i < drafts; ++i) {
    const size_t at = static_cast<size_t>(i);
    if (i > 0) {
      ASSIGN_OR_RETURN(state, EnqueueMtpForward(index, g.draft_ids[at - 1], state,
                                                StepPosition::OnDevice(g.forward_positions[at], bucket_end - 1)));
    }
    ASSIGN_OR_RETURN(Tensor logits, LogitRows(state, m.head));
    RETURN_IF_ERROR(backend_.SampleTokens(logits, g.sample_params, g.draft_ids[at]));
  }
  // step_output_: the last state [D], then the drafts.
  auto* out = static_cast<std::byte*>(step_output_->data());
  RETURN_IF_ERROR(backend_.CopyToHostAsync(state, std::span<std::byte>(out, state.nbytes())));
  for (int i = 0; i < drafts; ++i) {
    const Tensor& id = g.draft_ids[static_cast<size_t>(i)];
    RETURN_IF_ERROR(backend_.CopyToHostAsync(
        id, std::span<std::byte>(out + state.nbytes() + static_cast<size_t>(i) * sizeof(int32_t), id.nbytes())));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> Model::DraftOnDevice(std::span<const int32_t> next_tokens,
                                                          std::span<const float> hidden, int num_drafts,
                                                          const kernels::SampleParams& draw, int index) {
  const int64_t T = static_cast<int64_t>(next_tokens.size()), D = config_.hidden_size;
  if (!DraftsOnDevice(next_tokens.size(), num_drafts, index)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "DraftOnDevice: ", num_drafts, " drafts after ", T, " entries of MTP layer ", index,
        " cannot be drawn on the backend (1 to ", kMaxStepGraphTokens, " of each; ", weights_.mtp.size(),
        " MTP layers, world size ", options_.tp.world_size, lookahead_observer_ ? ", a lookahead observer" : "", ")"));
  }
  if (static_cast<int64_t>(hidden.size()) != T * D) {
    return absl::InvalidArgumentError(absl::StrCat("DraftOnDevice: ", T, " tokens with ", hidden.size(),
                                                   " hidden values (want tokens x ", D, ")"));
  }
  const int64_t entries = T + num_drafts - 1;
  if (mtp_length_ + entries > cache_.max_tokens()) {
    return absl::InvalidArgumentError(absl::StrCat("DraftOnDevice: ", mtp_length_, " MTP entries + ", entries,
                                                   " exceed the cache of ", cache_.max_tokens()));
  }
  RETURN_IF_ERROR(cache_.CheckWritable(mtp_length_, entries, "DraftOnDevice"));
  // One forward for the routing log and the mailbox: sized for all its entries (each MTP
  // forward logs the layer once).
  RETURN_IF_ERROR(BeginGraphedForward(next_tokens, entries, "DraftOnDevice"));
  const int64_t bucket_end = StepGraphBucketEnd(mtp_length_ + entries);
  // Entry positions: the kept entries from mtp_length_, then one per draft fed back. Each is
  // written to its forward's own tensor before the graph runs, so the graph begins with the
  // embedding, as every step graph does.
  std::vector<int32_t> positions(static_cast<size_t>(num_drafts));
  for (int i = 0; i < num_drafts; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(mtp_length_ + T + i - 1);
  positions[0] = static_cast<int32_t>(mtp_length_);
  auto upload = [&](StepGraph& inputs) -> absl::Status {
    if (!inputs.ids.valid()) {
      ASSIGN_OR_RETURN(inputs.ids, backend_.Allocate(kernels::DType::kI32, Shape{T}));
      ASSIGN_OR_RETURN(inputs.hidden, backend_.Allocate(kernels::DType::kF32, Shape{T, D}));
      ASSIGN_OR_RETURN(inputs.sample_params,
                       backend_.Allocate(kernels::DType::kU8, Shape{1, static_cast<int64_t>(sizeof(draw))}));
      for (int i = 0; i < num_drafts; ++i) {
        ASSIGN_OR_RETURN(Tensor position, backend_.Allocate(kernels::DType::kI32, Shape{1}));
        inputs.forward_positions.push_back(std::move(position));
        ASSIGN_OR_RETURN(Tensor id, backend_.Allocate(kernels::DType::kI32, Shape{1}));
        inputs.draft_ids.push_back(std::move(id));
      }
    }
    for (int i = 0; i < num_drafts; ++i) {
      RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(std::span<const int32_t>(&positions[static_cast<size_t>(i)], 1)),
                                            inputs.forward_positions[static_cast<size_t>(i)]));
    }
    RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(next_tokens), inputs.ids));
    RETURN_IF_ERROR(backend_.CopyFromHost(std::as_bytes(hidden), inputs.hidden));
    return backend_.CopyFromHost(std::as_bytes(std::span<const kernels::SampleParams>(&draw, 1)), inputs.sample_params);
  };
  bool ran = false;
  if (StepGraphApplies(next_tokens.size(), index)) {
    StepGraph& g = step_graphs_[{index, T, bucket_end, false, num_drafts}];
    RETURN_IF_ERROR(upload(g));
    ASSIGN_OR_RETURN(ran, RunStepGraph(g, [&] { return EnqueueMtpDrafts(index, g, bucket_end); }));
  }
  if (!ran) {
    // No graphs on this backend, or they are off now (a failed capture dropped every graph, `g`
    // with them): the same ops as they are issued, over inputs of their own.
    StepGraph eager;
    RETURN_IF_ERROR(upload(eager));
    RETURN_IF_ERROR(EnqueueMtpDrafts(index, eager, bucket_end));
    RETURN_IF_ERROR(backend_.Synchronize());
  }
  // A gather the chain held may have been cut short (a peer died): then the staging holds no drafts.
  if (options_.tp.world_size > 1) RETURN_IF_ERROR(comm_->CheckCompleted());
  const auto* out = static_cast<const std::byte*>(step_output_->data());
  const auto* state = reinterpret_cast<const float*>(out);
  last_mtp_hidden_.assign(state, state + D);
  std::vector<int32_t> drafts(static_cast<size_t>(num_drafts));
  std::memcpy(drafts.data(), out + static_cast<size_t>(D) * sizeof(float), drafts.size() * sizeof(int32_t));
  // A row without a finite logit draws kNoFiniteLogit: nothing from there on is a draft.
  const int64_t vocab = weights_.embed.shape().dim(0);
  const auto bad = std::find_if(drafts.begin(), drafts.end(), [&](int32_t id) { return id < 0 || id >= vocab; });
  drafts.erase(bad, drafts.end());
  FlushRoutingLog();
  mtp_length_ += entries;
  return drafts;
}

}  // namespace nq::model
