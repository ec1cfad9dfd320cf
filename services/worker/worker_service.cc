#include "services/worker/worker_service.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "services/common/metrics/buckets.h"
#include "services/common/metrics/registry.h"
#include "services/common/status_grpc.h"
#include "services/worker/mtp_drafter.h"
#include "services/worker/queued_stream_writer.h"
#include "services/worker/routing_report.h"

namespace nq::worker {
namespace {

// Decode tokens per routing report (DESIGN.md section 7).
constexpr int kReportIntervalTokens = 16;

metrics::CounterFamily& StepGraphEvents() {
  return metrics::Registry::Default().Counter(
      "nq_worker_step_graphs_total",
      "Forwards by how their CUDA step graph ran: warmup (the first forward of a (tokens, drafts, context "
      "bucket) key, op by op), capture (its second, recorded), replay (every graphed forward); zero on a "
      "backend without graphs",
      {"event"});
}

// How long Generate waits for a cancelled sequence to reach its step boundary.
constexpr std::chrono::seconds kBusyWait{5};

}  // namespace

WorkerService::WorkerService(WorkerIdentity identity, SlotRuntime* slots, model::Model* model)
    : identity_(std::move(identity)),
      slots_(slots),
      model_(model),
      step_seconds_(metrics::Registry::Default().Histogram(
          "nq_worker_step_seconds",
          "Time of a sequence step on the decode thread: the forward, MTP drafting and sampling (prefill: the "
          "prompt); phase draft: the MTP drafting part of a step",
          metrics::ExponentialBuckets(1e-4, 2, 18), {"phase"})),
      graph_warmups_(StepGraphEvents().WithLabels({"warmup"})),
      graph_captures_(StepGraphEvents().WithLabels({"capture"})),
      graph_replays_(StepGraphEvents().WithLabels({"replay"})),
      graphs_off_(metrics::Registry::Default()
                      .Gauge("nq_worker_step_graphs_off",
                             "1 once a failed CUDA graph capture turned step graphs off: every later step runs op "
                             "by op, several times slower (the log says why); 0 otherwise")
                      .Get()) {
  graphs_off_.Set(0);
  if (model_ != nullptr) {
    std::vector<int32_t> eos(model_->config().eos_token_ids.begin(), model_->config().eos_token_ids.end());
    runner_ = std::make_unique<SequenceRunner>(model_, std::move(eos));
    runner_->SetSlotRuntime(slots_);
    const model::ModelConfig& config = model_->config();
    for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
      if (config.IsMoeLayer(l)) moe_layers_.push_back(static_cast<uint32_t>(l));
    }
    // The decoder's layers only: the MTP layer's routing belongs to the drafts, not to the
    // sequence, and the streamer's predictor models the main layers.
    model_->SetRoutingObserver([this](int64_t layer, const model::MoeRouting& routing) { OnRouting(layer, routing); },
                               /*mtp_layers=*/false);
    runner_->SetKeptTokensObserver([this](int64_t kept) { OnKeptTokens(kept); });
  }
}

absl::Status WorkerService::EnableSpeculation(int num_drafts) {
  if (num_drafts < 0) return absl::InvalidArgumentError(absl::StrCat("--speculative_tokens=", num_drafts, " is negative"));
  if (num_drafts == 0 || model_ == nullptr) return absl::OkStatus();
  if (!model_->has_mtp()) {
    return absl::FailedPreconditionError(absl::StrCat("--speculative_tokens=", num_drafts,
                                                      " needs an MTP layer, and the model has none",
                                                      model_->mtp_missing().empty() ? "" : ": ", model_->mtp_missing()));
  }
  drafter_ = std::make_unique<MtpDrafter>(model_);
  drafter_->SetDraftOnDevice(device_sampling_);
  spec_metrics_ = std::make_unique<SpecDecodeMetrics>(metrics::Registry::Default(), num_drafts);
  runner_->SetDrafter(drafter_.get(), num_drafts);
  num_drafts_ = num_drafts;
  return absl::OkStatus();
}

absl::Status WorkerService::EnableLookahead(int depth, LookaheadReporter::Sink sink) {
  if (depth < 0) return absl::InvalidArgumentError(absl::StrCat("--lookahead_layers=", depth, " is negative"));
  if (depth == 0) return absl::OkStatus();
  if (model_ == nullptr) return absl::InvalidArgumentError(absl::StrCat("--lookahead_layers=", depth, " needs --model"));
  if (moe_layers_.empty() || static_cast<int64_t>(moe_layers_.back()) < depth) {
    return absl::InvalidArgumentError(absl::StrCat("--lookahead_layers=", depth, ": the model has no MoE layer ", depth,
                                                   " layers after another"));
  }
  // A decode step runs 1 token, or 1 + the drafts when verifying them.
  lookahead_ = std::make_unique<LookaheadReporter>(
      depth, 1 + num_drafts_,
      [this](int64_t layer, int32_t expert) { return slots_ != nullptr && slots_->RunsAtFourBitNow(layer, expert); },
      std::move(sink), metrics::Registry::Default());
  model_->SetLookaheadObserver(
      depth,
      [this](int64_t target, const model::MoeRouting& predicted) {
        // The first prediction of a forward (targets grow within one): its token is the next to
        // report.
        if (last_lookahead_target_ < 0 || target <= last_lookahead_target_) {
          lookahead_->BeginForward(sequence_id_, sequence_tokens_);
        }
        last_lookahead_target_ = target;
        lookahead_->OnPredicted(target, predicted);
      },
      [this](int64_t layer) {
        // Before the model applies the slot mailbox again: the table this layer ran with.
        if (slots_ != nullptr) slots_->NoteLayerRan(layer);
        lookahead_->LayerRan(layer);
      });
  return absl::OkStatus();
}

void WorkerService::SetDeviceLogitAdjust(bool on) {
  if (runner_ != nullptr) runner_->SetDeviceLogitAdjust(on);
}

void WorkerService::SetDeviceSampling(bool on) {
  device_sampling_ = on;
  if (runner_ != nullptr) runner_->SetDeviceSampling(on);
  if (drafter_ != nullptr) drafter_->SetDraftOnDevice(on);
}

absl::Status WorkerService::SetPrefillOptions(PrefillOptions options) {
  if (runner_ == nullptr) return absl::OkStatus();
  return runner_->SetPrefillOptions(std::move(options));
}

void WorkerService::SetTensorParallelLeader(TpLeader* leader) {
  tp_leader_ = leader;
  if (runner_ != nullptr) runner_->SetStepMirror(leader);
}

void WorkerService::OnRouting(int64_t layer, const model::MoeRouting& routing) {
  if (lookahead_ != nullptr) {
    lookahead_->OnRouting(layer, routing);
    if (!moe_layers_.empty() && static_cast<uint32_t>(layer) == moe_layers_.back()) {
      lookahead_->EndForward();
      last_lookahead_target_ = -1;
    }
  }
  if ((!routing_sink_ && watchers_.empty()) || moe_layers_.empty()) return;
  // The first MoE layer starts a forward: drop what a failed one may have left.
  if (static_cast<uint32_t>(layer) == moe_layers_.front()) forward_routing_.clear();
  forward_routing_.push_back(routing);
}

void WorkerService::OnKeptTokens(int64_t kept) {
  if (forward_routing_.empty()) return;
  // Append the kept tokens, token-major, and report full blocks.
  if (forward_routing_.size() != moe_layers_.size()) {
    forward_routing_.clear();  // not one whole forward: nothing consistent to report
    return;
  }
  const int tokens = static_cast<int>(std::min<int64_t>(kept, forward_routing_[0].num_tokens));
  for (int t = 0; t < tokens; ++t) {
    if (pending_.num_tokens() == 0) {
      pending_.set_first_token(sequence_tokens_);
      pending_.set_sequence_id(sequence_id_);
    }
    AppendTokenRouting(moe_layers_, forward_routing_, t, &pending_);
    pending_.set_num_tokens(pending_.num_tokens() + 1);
    ++sequence_tokens_;
    if (pending_.num_tokens() == kReportIntervalTokens) EmitPendingRouting();
  }
  forward_routing_.clear();
}

void WorkerService::ReportStepGraphs() {
  if (model_ == nullptr) return;
  // The model's counts only grow: add what each grew by since the last step.
  const model::Model::StepGraphStats& now = model_->step_graph_stats();
  auto add = [](metrics::Counter& counter, int64_t value, int64_t& reported) {
    if (value > reported) counter.Increment(static_cast<double>(value - reported));
    reported = value;
  };
  add(graph_warmups_, now.warmups, graphs_reported_.warmups);
  add(graph_captures_, now.captured, graphs_reported_.captured);
  add(graph_replays_, now.replayed, graphs_reported_.replayed);
  if (!now.disabled.ok()) graphs_off_.Set(1);
}

void WorkerService::EmitPendingRouting() {
  watchers_.Publish(pending_);
  if (routing_sink_) routing_sink_(std::move(pending_));
  pending_.Clear();
}

void WorkerService::SetReady() {
  absl::MutexLock lock(&mu_);
  if (state_ != nq::v1::WORKER_STATE_LOADING) return;
  state_ = nq::v1::WORKER_STATE_READY;
  ready_unix_ = std::chrono::duration_cast<std::chrono::seconds>(
                    std::chrono::system_clock::now().time_since_epoch())
                    .count();
}

void WorkerService::SetDraining() {
  absl::MutexLock lock(&mu_);
  state_ = nq::v1::WORKER_STATE_DRAINING;
}

nq::v1::WorkerState WorkerService::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

grpc::Status WorkerService::Generate(grpc::ServerContext* context,
                                     const nq::v1::WorkerGenerateRequest* request,
                                     grpc::ServerWriter<nq::v1::WorkerGenerateResponse>* writer) {
  if (state() != nq::v1::WORKER_STATE_READY) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker is not ready (loading or draining)");
  }
  if (runner_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "this worker has no model loaded (--model)");
  }
  if (request->prompt_token_ids().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt_token_ids is empty");
  }
  if (request->num_speculative_tokens() > 0) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        absl::StrCat("num_speculative_tokens ", request->num_speculative_tokens(),
                                     ": MTP speculative decoding is not wired into generation; send 0 or leave it "
                                     "unset"));
  }
  const nq::v1::SamplingParams& sampling = request->sampling();
  SequenceRequest sequence;
  sequence.prompt.assign(request->prompt_token_ids().begin(), request->prompt_token_ids().end());
  sequence.sampling.temperature = sampling.has_temperature() ? sampling.temperature() : 1.0f;
  sequence.sampling.top_p = sampling.has_top_p() ? sampling.top_p() : 1.0f;
  sequence.sampling.top_k = static_cast<int>(sampling.top_k());
  sequence.sampling.seed = sampling.has_seed() ? sampling.seed() : std::random_device{}();
  sequence.sampling.top_logprobs = static_cast<int>(sampling.top_logprobs());
  sequence.sampling.logprobs = !sampling.has_logprobs() || sampling.logprobs() || sampling.top_logprobs() > 0;
  sequence.sampling.presence_penalty = sampling.presence_penalty();
  sequence.sampling.frequency_penalty = sampling.frequency_penalty();
  for (const auto& [id, bias] : sampling.logit_bias()) {
    // An id past int32 is outside every vocabulary: clamped, it still fails the sampler's check.
    sequence.sampling.logit_bias.emplace_back(
        static_cast<int32_t>(std::min<uint32_t>(id, std::numeric_limits<int32_t>::max())), bias);
  }
  sequence.max_tokens = sampling.max_tokens();
  sequence.stop_token_ids.assign(sampling.stop_token_ids().begin(), sampling.stop_token_ids().end());
  sequence.ignore_eos = sampling.ignore_eos();

  // One sequence at a time. The router serializes requests, so a busy worker here is the
  // tail of a sequence the router just cancelled (its client went away): wait briefly for it
  // to stop at its next step boundary rather than failing the next request.
  const auto give_up = std::chrono::steady_clock::now() + kBusyWait;
  while (!run_mu_.TryLock()) {
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled while waiting");
    if (std::chrono::steady_clock::now() > give_up) {
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "another sequence is running");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  // The tensor-parallel group, held for the whole sequence (the manager re-forms it between).
  std::optional<TpLeader::Lease> lease;
  if (tp_leader_ != nullptr) {
    absl::StatusOr<TpLeader::Lease> acquired = tp_leader_->Acquire();
    if (!acquired.ok()) {
      run_mu_.Unlock();
      return ToGrpcStatus(acquired.status());
    }
    lease.emplace(*std::move(acquired));
    // A group formed anew: its other ranks start with empty caches; so must this one.
    if (lease->fresh()) runner_->ForgetCache();
  }
  {
    absl::MutexLock lock(&mu_);
    running_request_id_ = request->request_id();
    abort_requested_ = false;
  }
  // A new sequence: its routing starts a new report stream (the predictor separates them).
  ++sequence_id_;
  sequence_tokens_ = 0;
  pending_.Clear();
  auto cancelled = [&] {
    absl::MutexLock lock(&mu_);
    return abort_requested_ || context->IsCancelled();
  };
  // The last step's tokens are held back so finish_reason and usage travel with them.
  nq::v1::WorkerGenerateResponse last;
  last.set_finish_reason(nq::v1::FINISH_REASON_ABORT);
  QueuedStreamWriter queued(writer);
  uint64_t response_count = 0;
  absl::StatusOr<SequenceStats> stats = runner_->Run(
      sequence,
      [&](const SequenceStep& step) {
        nq::v1::WorkerGenerateResponse response;
        for (const SampledToken& token : step.tokens) {
          nq::v1::TokenLogprob* out = response.add_tokens();
          out->set_token_id(static_cast<uint32_t>(token.id));
          out->set_logprob(token.logprob);
          for (const auto& [id, logprob] : token.top) {
            nq::v1::TokenAlternative* alt = out->add_top();
            alt->set_token_id(static_cast<uint32_t>(id));
            alt->set_logprob(logprob);
          }
        }
        response.set_step_seconds(step.seconds);
        step_seconds_.WithLabels({response_count++ == 0 ? "prefill" : "decode"}).Observe(step.seconds);
        if (step.draft_seconds > 0) step_seconds_.WithLabels({"draft"}).Observe(step.draft_seconds);
        ReportStepGraphs();
        if (spec_metrics_ != nullptr) spec_metrics_->RecordStep(step.drafts, step.accepted);
        if (step.finish != nq::v1::FINISH_REASON_UNSPECIFIED) {
          response.set_finish_reason(step.finish);
          last = std::move(response);
          return true;
        }
        return queued.Push(std::move(response));
      },
      cancelled);
  queued.Finish();
  // The sequence's last, partial block of routing.
  if (pending_.num_tokens() > 0) EmitPendingRouting();
  {
    absl::MutexLock lock(&mu_);
    running_request_id_.clear();
  }
  lease.reset();
  run_mu_.Unlock();
  if (!stats.ok()) return ToGrpcStatus(stats.status());
  last.mutable_usage()->set_prompt_tokens(stats->prompt_tokens);
  last.mutable_usage()->set_completion_tokens(stats->completion_tokens);
  last.mutable_usage()->set_cached_prompt_tokens(stats->cached_prompt_tokens);
  writer->Write(last);
  return grpc::Status::OK;
}

grpc::Status WorkerService::Abort(grpc::ServerContext* context, const nq::v1::AbortRequest* request,
                                  nq::v1::AbortResponse* response) {
  absl::MutexLock lock(&mu_);
  if (running_request_id_.empty() || running_request_id_ != request->request_id()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        absl::StrCat("no running sequence with request_id '", request->request_id(), "'"));
  }
  abort_requested_ = true;
  return grpc::Status::OK;
}

grpc::Status WorkerService::GetInfo(grpc::ServerContext* context,
                                    const nq::v1::GetInfoRequest* request,
                                    nq::v1::WorkerInfo* response) {
  {
    absl::MutexLock lock(&mu_);
    response->set_state(state_);
    response->set_ready_unix(ready_unix_);
    response->set_running_request_id(running_request_id_);
  }
  response->set_backend(identity_.backend);
  response->set_model_id(identity_.model_id);
  response->set_release_id(identity_.release_id);
  // MTP speculative decoding is not wired into generation (README "Not yet"), so every
  // sequence decodes one token per step; Generate refuses a request that asks for drafts.
  response->set_num_speculative_tokens(0);
  if (model_ != nullptr) {
    const model::ModelConfig& config = model_->config();
    response->set_architecture(std::string(model::ArchitectureName(config.architecture)));
    response->set_vocab_size(static_cast<uint32_t>(config.vocab_size));
    response->set_max_model_len(static_cast<uint32_t>(model_->max_tokens()));
    for (int64_t id : config.eos_token_ids) response->add_eos_token_ids(static_cast<uint32_t>(id));
  }
  response->set_tensor_parallel_size(identity_.world_size);
  response->set_streamer_connected(streamer_connected_.load());
  const SlotGeometry& geometry = slots_->table().geometry();
  response->set_num_moe_layers(static_cast<uint32_t>(geometry.moe_layer_ids.size()));
  response->set_slots_per_layer(geometry.slots_per_layer);
  response->set_rec_bytes(geometry.rec_bytes);
  if (model_ != nullptr) response->set_experts_per_layer(static_cast<uint32_t>(model_->config().n_routed_experts));
  return grpc::Status::OK;
}

grpc::Status WorkerService::WatchRouting(grpc::ServerContext* context, const nq::v1::WatchRoutingRequest* request,
                                         grpc::ServerWriter<nq::v1::RoutingReport>* writer) {
  if (model_ == nullptr) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "no model loaded");
  std::shared_ptr<RoutingWatchers::Watcher> watcher = watchers_.Add();
  while (!context->IsCancelled() && state() != nq::v1::WORKER_STATE_DRAINING) {
    std::optional<nq::v1::RoutingReport> report = watcher->Next(absl::Milliseconds(200));
    if (report.has_value() && !writer->Write(*report)) break;
  }
  watchers_.Remove(watcher);
  return grpc::Status::OK;
}

}  // namespace nq::worker
