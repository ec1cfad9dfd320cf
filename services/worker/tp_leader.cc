#include "services/worker/tp_leader.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/metrics/buckets.h"
#include "services/common/metrics/registry.h"
#include "services/common/status_macros.h"
#include "services/worker/tp_control.h"

namespace nq::worker {
namespace {

// How long one manager pass waits for joining ranks (holding the group's mutex: Acquire waits
// at most this long to learn the group is not formed).
constexpr absl::Duration kJoinSlice = absl::Milliseconds(200);
// How often an idle formed group is checked for dead ranks.
constexpr absl::Duration kWatchInterval = absl::Milliseconds(100);
constexpr absl::Duration kWaitingLogInterval = absl::Seconds(10);

metrics::Histogram& CommandSeconds() {
  return metrics::Registry::Default()
      .Histogram("nq_worker_tp_command_seconds",
                 "Time rank 0 spends sending one step command to the other ranks (before the step's forward)",
                 metrics::ExponentialBuckets(1e-5, 2, 18))
      .Get();
}

}  // namespace

TpLeader::TpLeader(TpGroupOptions options, GroupCommunicator* group, std::function<void(bool ready)> on_ready)
    : options_(std::move(options)), group_(group), on_ready_(std::move(on_ready)) {}

TpLeader::~TpLeader() {
  stopping_ = true;
  if (manager_.joinable()) manager_.join();
  std::lock_guard<std::mutex> lock(mu_);
  Dissolve();  // breaks the group: the followers go back to waiting for one
}

void TpLeader::Dissolve() {
  group_->Set(nullptr);
  watchdog_.reset();
  plane_.reset();
  comm_.reset();
}

absl::Status TpLeader::GroupAlive() {
  RETURN_IF_ERROR(comm_->PeersAlive());
  if (plane_ != nullptr) RETURN_IF_ERROR(plane_->Health());
  return absl::OkStatus();
}

bool TpLeader::FormDataPlane() {
  absl::StatusOr<std::unique_ptr<TpDataPlane>> plane =
      LeadDataPlane(*options_.data_plane, *comm_, options_.collective_timeout);
  for (const std::string& refusal : comm_->TakeRefusals()) {
    spdlog::error("tensor-parallel group {}: refused {}", GroupControlName(options_), refusal);
  }
  if (!plane.ok()) {
    SetWaitingFor(std::string(plane.status().message()));
    spdlog::error("tensor-parallel group {} (generation {}): {}; forming a new one", GroupControlName(options_), generation_,
                  plane.status().ToString());
    Dissolve();
    return false;
  }
  plane_ = *std::move(plane);
  watchdog_ = std::make_unique<TpWatchdog>(comm_.get(), plane_.get(), kDataPlaneWatch);
  spdlog::info("tensor-parallel group {} (generation {}): collectives over {}", GroupControlName(options_), generation_,
               std::string(TpTransportName(options_.data_plane->transport)));
  return true;
}

void TpLeader::Start() { manager_ = std::thread([this] { Manage(); }); }

void TpLeader::Manage() {
  while (!stopping_ && !(options_.stop != nullptr && options_.stop->load())) {
    bool ready;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Tick();
      ready = ready_;
    }
    absl::SleepFor(ready ? kWatchInterval : absl::Milliseconds(10));
  }
}

void TpLeader::Tick() {
  const int world = options_.identity.world_size;
  if (comm_ == nullptr) {
    absl::StatusOr<std::unique_ptr<kernels::GroupControl>> created = CreateGroupControl(options_, ++generation_);
    if (!created.ok()) {
      SetWaitingFor(std::string(created.status().message()));
      spdlog::error("tensor-parallel group {}: {}", GroupControlName(options_), created.status().ToString());
      absl::SleepFor(absl::Seconds(1));
      return;
    }
    comm_ = *std::move(created);
    spdlog::info("tensor-parallel group {} (generation {}): waiting for ranks 1..{} to join", GroupControlName(options_),
                 generation_, world - 1);
  }
  if (!ready_) {
    const absl::Status joined = comm_->WaitForPeers(kJoinSlice);
    for (const std::string& refusal : comm_->TakeRefusals()) {
      spdlog::error("tensor-parallel group {}: refused {}", GroupControlName(options_), refusal);
    }
    if (joined.ok()) {
      if (options_.data_plane != nullptr && !FormDataPlane()) return;
      ready_ = true;
      formed_.store(true);
      fresh_ = true;
      {
        absl::MutexLock why(&why_mu_);
        waiting_for_.clear();
        broke_because_.clear();
      }
      group_->Set(plane_ != nullptr ? static_cast<kernels::Communicator*>(plane_.get()) : comm_.get());
      spdlog::info("tensor-parallel group {} (generation {}) formed: {} ranks", GroupControlName(options_), generation_, world);
      on_ready_(true);
      return;
    }
    SetWaitingFor(std::string(joined.message()));
    if (joined.code() != absl::StatusCode::kDeadlineExceeded) {
      spdlog::warn("tensor-parallel group {}: {}; forming a new one", GroupControlName(options_), joined.ToString());
      comm_.reset();
    } else if (absl::Now() - last_waiting_log_ > kWaitingLogInterval) {
      last_waiting_log_ = absl::Now();
      spdlog::info("tensor-parallel group {}: {}", GroupControlName(options_), std::string(joined.message()));
    }
    return;
  }
  if (const absl::Status alive = GroupAlive(); !alive.ok()) {
    spdlog::error("tensor-parallel group {} (generation {}): {}; not serving until it re-forms", GroupControlName(options_),
                  generation_, std::string(alive.message()));
    {
      absl::MutexLock why(&why_mu_);
      waiting_for_ = std::string(alive.message());
      broke_because_ = waiting_for_;
    }
    ready_ = false;
    formed_.store(false);
    Dissolve();
    on_ready_(false);
  }
}

void TpLeader::SetWaitingFor(std::string why) {
  absl::MutexLock lock(&why_mu_);
  waiting_for_ = std::move(why);
}

std::string TpLeader::NotFormedReason() const {
  absl::MutexLock lock(&why_mu_);
  if (broke_because_.empty() || broke_because_ == waiting_for_) return waiting_for_;
  return absl::StrCat(waiting_for_, "; the last group broke: ", broke_because_);
}

absl::StatusOr<TpLeader::Lease> TpLeader::Acquire() {
  if (!formed_.load()) {
    // Not behind the manager's join: a request is refused now, not when the join gives up.
    return absl::UnavailableError(absl::StrCat("the tensor-parallel group of ", options_.identity.world_size,
                                               " ranks is not formed (", NotFormedReason(), ")"));
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (!ready_) {
    return absl::UnavailableError(absl::StrCat("the tensor-parallel group of ", options_.identity.world_size,
                                               " ranks is not formed (", NotFormedReason(), ")"));
  }
  // A group that broke since the manager's last look: fail now, not in the first collective.
  RETURN_IF_ERROR(GroupAlive());
  const bool fresh = std::exchange(fresh_, false);
  return Lease(std::move(lock), fresh);
}

absl::Status TpLeader::Mirror(const StepCommand& command) {
  // Called under a Lease: comm_ is the formed group.
  if (comm_ == nullptr || !ready_) return absl::UnavailableError("the tensor-parallel group is not formed");
  // The step boundary: what the previous command spent in collectives, when it was a decode step.
  const double collective_seconds = group_->TakeCollectiveSeconds();
  if (std::exchange(last_was_decode_, command.op == StepCommand::Op::kForward && command.step > 0)) {
    TpStepCollectiveSeconds().Observe(collective_seconds);
  }
  // A data plane aborted mid-step (a rank died) fails the next step here, by name.
  if (plane_ != nullptr) RETURN_IF_ERROR(plane_->Health());
  const auto started = absl::Now();
  std::vector<std::byte> header = EncodeStepHeader(command);
  RETURN_IF_ERROR(comm_->BroadcastBytes(header, 0, options_.collective_timeout));
  if (!command.tokens.empty() || !command.slot_updates.empty()) {
    std::vector<std::byte> payload = EncodeStepPayload(command);
    RETURN_IF_ERROR(comm_->BroadcastBytes(payload, 0, options_.collective_timeout));
  }
  CommandSeconds().Observe(absl::ToDoubleSeconds(absl::Now() - started));
  return absl::OkStatus();
}

}  // namespace nq::worker
