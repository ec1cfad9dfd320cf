#include "services/worker/tp_leader.h"

#include <spdlog/spdlog.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

// How long one manager pass waits for joining ranks (holding the group's mutex: Acquire waits
// at most this long to learn the group is not formed).
constexpr absl::Duration kJoinSlice = absl::Milliseconds(200);
// How often an idle formed group is checked for dead ranks.
constexpr absl::Duration kWatchInterval = absl::Milliseconds(100);
constexpr absl::Duration kWaitingLogInterval = absl::Seconds(10);

}  // namespace

TpLeader::TpLeader(TpGroupOptions options, GroupCommunicator* group, std::function<void(bool ready)> on_ready)
    : options_(std::move(options)), group_(group), on_ready_(std::move(on_ready)) {}

TpLeader::~TpLeader() {
  stopping_ = true;
  if (manager_.joinable()) manager_.join();
  std::lock_guard<std::mutex> lock(mu_);
  group_->Set(nullptr);
  comm_.reset();  // breaks the group: the followers go back to waiting for one
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
    absl::StatusOr<std::unique_ptr<kernels::ShmCommunicator>> created = kernels::ShmCommunicator::Create(
        kernels::ShmCommunicatorOptions{.name = options_.shm_name,
                                        .rank = 0,
                                        .world_size = world,
                                        .timeout = options_.collective_timeout,
                                        .identity = options_.identity.Serialize(),
                                        .stop = options_.stop},
        ++generation_);
    if (!created.ok()) {
      waiting_for_ = std::string(created.status().message());
      spdlog::error("tensor-parallel group {}: {}", options_.shm_name, created.status().ToString());
      absl::SleepFor(absl::Seconds(1));
      return;
    }
    comm_ = *std::move(created);
    spdlog::info("tensor-parallel group {} (generation {}): waiting for ranks 1..{} to join", options_.shm_name,
                 generation_, world - 1);
  }
  if (!ready_) {
    const absl::Status joined = comm_->WaitForPeers(kJoinSlice);
    for (const std::string& refusal : comm_->TakeRefusals()) {
      spdlog::error("tensor-parallel group {}: refused {}", options_.shm_name, refusal);
    }
    if (joined.ok()) {
      ready_ = true;
      fresh_ = true;
      waiting_for_.clear();
      group_->Set(comm_.get());
      spdlog::info("tensor-parallel group {} (generation {}) formed: {} ranks", options_.shm_name, generation_, world);
      on_ready_(true);
      return;
    }
    waiting_for_ = std::string(joined.message());
    if (joined.code() != absl::StatusCode::kDeadlineExceeded) {
      spdlog::warn("tensor-parallel group {}: {}; forming a new one", options_.shm_name, joined.ToString());
      comm_.reset();
    } else if (absl::Now() - last_waiting_log_ > kWaitingLogInterval) {
      last_waiting_log_ = absl::Now();
      spdlog::info("tensor-parallel group {}: {}", options_.shm_name, waiting_for_);
    }
    return;
  }
  if (const absl::Status alive = comm_->PeersAlive(); !alive.ok()) {
    spdlog::error("tensor-parallel group {} (generation {}): {}; not serving until it re-forms", options_.shm_name,
                  generation_, std::string(alive.message()));
    waiting_for_ = std::string(alive.message());
    ready_ = false;
    group_->Set(nullptr);
    comm_.reset();
    on_ready_(false);
  }
}

absl::StatusOr<TpLeader::Lease> TpLeader::Acquire() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!ready_) {
    return absl::UnavailableError(absl::StrCat("the tensor-parallel group of ", options_.identity.world_size,
                                               " ranks is not formed (", waiting_for_, ")"));
  }
  // A group that broke since the manager's last look: fail now, not in the first collective.
  RETURN_IF_ERROR(comm_->PeersAlive());
  const bool fresh = std::exchange(fresh_, false);
  return Lease(std::move(lock), fresh);
}

absl::Status TpLeader::Mirror(const StepCommand& command) {
  // Called under a Lease: comm_ is the formed group.
  if (comm_ == nullptr || !ready_) return absl::UnavailableError("the tensor-parallel group is not formed");
  std::vector<std::byte> header = EncodeStepHeader(command);
  RETURN_IF_ERROR(comm_->BroadcastBytes(header, 0, options_.collective_timeout));
  if (!command.tokens.empty() || !command.slot_updates.empty()) {
    std::vector<std::byte> payload = EncodeStepPayload(command);
    RETURN_IF_ERROR(comm_->BroadcastBytes(payload, 0, options_.collective_timeout));
  }
  return absl::OkStatus();
}

}  // namespace nq::worker
