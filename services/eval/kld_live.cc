#include "services/eval/kld_live.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/status_macros.h"
#include "services/model/model_weights.h"
#include "services/model/safetensors.h"
#include "services/release/release_experts.h"
#include "services/worker/arena_geometry.h"
#include "services/worker/routing_report.h"

namespace nq::eval {
namespace {

bool WaitUntil(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!condition()) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<LiveStudentSource>> LiveStudentSource::Load(const KldRequest& request,
                                                                           int64_t max_tokens,
                                                                           kernels::Backend& backend) {
  if (request.streamer_address.empty()) {
    return absl::InvalidArgumentError("--mode live needs --streamer HOST:PORT (an nq-streamer serving the release)");
  }
  std::unique_ptr<LiveStudentSource> s(new LiveStudentSource());
  // 2-bit bases only: residuals come from the slots the streamer fills.
  ASSIGN_OR_RETURN(ReleaseStudent student,
                   LoadReleaseStudent(request.teacher_dir, request.release_dir, release::ExpertBits::k2Bit, backend));
  model::ModelConfig config = std::move(student.config);
  model::ModelWeights weights = std::move(student.weights);
  s->decoder_ = std::move(student.decoder);
  s->bytes_ = student.bytes;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsMoeLayer(l)) s->moe_layers_.push_back(static_cast<uint32_t>(l));
  }
  ASSIGN_OR_RETURN(s->model_, model::Model::Create(std::move(config), std::move(weights), backend, nullptr,
                                                   {.max_tokens = max_tokens}));

  // The arena a worker would size for `--slots` floating slots: per decode MoE layer the
  // fixed set's slots, F floating, one staging (worker/arena_geometry.h; no MTP layer).
  ASSIGN_OR_RETURN(const SlotGeometry geometry,
                   worker::ReleaseArenaGeometry(*s->decoder_, s->model_->config(),
                                                {.floating_slots = static_cast<uint32_t>(request.slots)}));
  size_t fixed_total = 0;
  for (uint32_t layer : geometry.moe_layer_ids) {
    fixed_total += std::min<size_t>(s->decoder_->FixedSet(layer).size(), geometry.fixed_slots_per_layer);
  }
  std::mt19937_64 rng(std::random_device{}());
  ASSIGN_OR_RETURN(s->arena_, SharedMemory::Create(absl::StrFormat("/nq-kld-%d-%08x", getpid(),
                                                                   static_cast<uint32_t>(rng())),
                                                   geometry.ArenaBytes()));
  s->table_ = std::make_unique<worker::SlotTable>(geometry);
  s->runtime_ = std::make_unique<worker::SlotRuntime>(
      s->table_.get(),
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(s->arena_.data()), s->arena_.size()),
      s->decoder_.get());
  worker::StreamerClientOptions client;
  client.address = request.streamer_address;
  client.release_id = s->decoder_->release().id();
  client.arena_request.set_pid(static_cast<uint32_t>(getpid()));
  char hostname[256] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) == 0) client.arena_request.set_hostname(hostname);
  client.arena_request.mutable_shm()->set_name(s->arena_.name());
  client.arena_request.mutable_shm()->set_bytes(s->arena_.size());
  s->client_ = std::make_unique<worker::StreamerClient>(std::move(client), s->runtime_.get(), nullptr);
  s->client_->Start();
  if (!WaitUntil([&] { return s->client_->connected(); }, std::chrono::seconds(10))) {
    return absl::UnavailableError(absl::StrCat("no nq-streamer session at ", request.streamer_address,
                                               " within 10 s (is it serving this release?)"));
  }
  if (!WaitUntil([&] { return s->runtime_->ready_slots() >= fixed_total; }, std::chrono::seconds(10))) {
    return absl::UnavailableError(absl::StrCat("the streamer at ", request.streamer_address, " loaded ",
                                               s->runtime_->ready_slots(), " of ", fixed_total,
                                               " fixed-set experts in 10 s"));
  }
  LiveStudentSource* raw = s.get();
  s->model_->SetSlotArena(
      worker::ModelSlotArena(geometry, reinterpret_cast<const std::byte*>(s->arena_.data())));
  s->model_->SetExpertSlotTables(s->runtime_->SlotTables());
  s->model_->SetRoutingObserver(
      [raw](int64_t layer, const model::MoeRouting& routing) { raw->OnRouting(layer, routing); });
  return s;
}

LiveStudentSource::~LiveStudentSource() {
  if (client_) client_->Stop();
}

absl::Status LiveStudentSource::BeginWindow() {
  model_->ResetCache();
  ++sequence_id_;
  tokens_ = 0;
  step_ = 0;
  return absl::OkStatus();
}

void LiveStudentSource::OnRouting(int64_t layer, const model::MoeRouting& routing) {
  // During the step: the table is stable, so "at 4 bits" here is what the expert ran at.
  block_routing_.push_back(routing);
  for (int t = 0; t < routing.num_tokens; ++t) {
    for (int j = 0; j < routing.top_k; ++j) {
      const int32_t e = routing.experts[t * routing.top_k + j];
      const double w = routing.weights[t * routing.top_k + j];
      const bool four = runtime_->RunsAtFourBit(layer, e);
      usage_.calls += 1;
      usage_.weight += w;
      usage_.calls_4bit += four ? 1 : 0;
      usage_.weight_4bit += four ? w : 0;
    }
  }
  const int32_t experts = static_cast<int32_t>(model_->config().n_routed_experts);
  for (int32_t e = 0; e < experts; ++e) usage_.held_4bit += runtime_->RunsAtFourBit(layer, e) ? 1 : 0;
  usage_.held_total += experts;
}

absl::StatusOr<std::vector<float>> LiveStudentSource::Next(std::span<const int32_t> block) {
  block_routing_.clear();
  runtime_->BeginStep(step_++);
  absl::StatusOr<std::vector<float>> logits = model_->Forward(block);
  runtime_->EndStep();
  if (!logits.ok()) return logits.status();
  if (block_routing_.size() != moe_layers_.size()) return absl::InternalError("a MoE layer reported no routing");
  // The block's routing, token-major, as the worker reports it.
  nq::v1::RoutingReport report;
  report.set_first_token(tokens_);
  report.set_num_tokens(static_cast<uint32_t>(block.size()));
  report.set_sequence_id(sequence_id_);
  for (size_t t = 0; t < block.size(); ++t) {
    worker::AppendTokenRouting(moe_layers_, block_routing_, static_cast<int>(t), &report);
  }
  tokens_ += block.size();
  // The streamer's predictor refreshes every kKldBlockTokens reported tokens (the worker's
  // report interval) and answers each refresh with an update.
  const bool refresh_due = (reported_ + block.size()) / kKldBlockTokens > reported_ / kKldBlockTokens;
  reported_ += block.size();
  const uint64_t generation = table_->applied_generation();
  client_->EnqueueRoutingReport(std::move(report));
  if (refresh_due) AwaitAnnouncedLoads(generation);
  return logits;
}

void LiveStudentSource::AwaitAnnouncedLoads(uint64_t generation_before) {
  if (!WaitUntil([&] { return table_->applied_generation() > generation_before; }, std::chrono::seconds(2))) return;
  WaitUntil([&] { return runtime_->loads_in_flight() == 0; }, std::chrono::seconds(2));
}

}  // namespace nq::eval
