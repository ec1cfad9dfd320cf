// nq kld --mode live (issue #7): the student served the way nq-worker serves it, through the
// running streamer and predictor v0. The harness registers with the streamer as a worker
// (rank 0, its own shared-memory arena of fixed + F + 1 slots per layer), reports each 16-token
// block's routing, and runs each block with whatever its slots hold READY when the block
// starts: 2-bit base weights, and 4-bit weights for experts whose residual was streamed in.
//
// The harness takes rank 0: point it at a streamer no live worker of rank 0 uses (it is
// refused, ALREADY_EXISTS, rather than displace one).
//
// Timing model: after each report that completes a predictor refresh (every 16 tokens) the
// harness waits (up to 2 s) for the streamer's answer and for the loads it announces to land,
// as if the disk kept up with decoding; a block therefore sees the predictor's choice made
// from every block before it. With a slower disk the live share can only be lower. Decode
// itself does not wait in serving (--slot_wait_tokens aside).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/common/shared_memory.h"
#include "services/eval/kld_harness.h"
#include "services/eval/kld_run.h"
#include "services/eval/kld_student.h"
#include "services/model/model.h"
#include "services/release/release_expert_decoder.h"
#include "services/worker/slot_runtime.h"
#include "services/worker/slot_table.h"
#include "services/worker/streamer_client.h"

namespace nq::eval {

class LiveStudentSource : public StudentSource {
 public:
  // UNAVAILABLE when no streamer answers at request.streamer_address within 10 s, or it does
  // not load the fixed sets; the release's and model's own load errors otherwise.
  static absl::StatusOr<std::unique_ptr<LiveStudentSource>> Load(const KldRequest& request, int64_t max_tokens,
                                                                 kernels::Backend& backend);
  ~LiveStudentSource() override;

  int64_t vocab_size() const override { return model_->config().vocab_size; }
  absl::Status BeginWindow() override;
  absl::StatusOr<std::vector<float>> Next(std::span<const int32_t> block) override;

  const ExpertUsage& usage() const override { return usage_; }
  const ExpertBytes& bytes() const override { return bytes_; }

 private:
  LiveStudentSource() = default;
  void OnRouting(int64_t layer, const model::MoeRouting& routing);
  // Waits for the streamer's response to the last report to land (see the header comment).
  void AwaitAnnouncedLoads(uint64_t generation_before);

  std::unique_ptr<release::ReleaseExpertDecoder> decoder_;
  std::unique_ptr<model::Model> model_;
  SharedMemory arena_;
  std::unique_ptr<worker::SlotTable> table_;
  std::unique_ptr<worker::SlotRuntime> runtime_;
  std::unique_ptr<worker::StreamerClient> client_;
  std::vector<uint32_t> moe_layers_;             // main-model MoE layers
  std::vector<model::MoeRouting> block_routing_;  // this block's, one per MoE layer
  uint64_t sequence_id_ = 0;
  uint64_t tokens_ = 0;    // in this window
  uint64_t reported_ = 0;  // over the session, as the streamer's predictor counts them
  uint32_t step_ = 0;
  ExpertUsage usage_;
  ExpertBytes bytes_;
};

}  // namespace nq::eval
