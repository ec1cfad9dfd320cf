#include "services/streamer/worker_registry.h"

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <string>
#include <thread>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "services/common/shared_memory.h"
#include "services/common/status_macros.h"

namespace nq::streamer {
namespace {

// kill(pid, 0) probes without signalling: ESRCH means the process is gone. A zombie (dead,
// not yet reaped by its parent) still answers kill(), so its /proc state counts too.
bool ProcessGone(uint32_t pid) {
  if (pid == 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0) return errno == ESRCH;
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string line;
  if (!std::getline(stat, line)) return true;
  // "pid (comm) S ...": the state follows the last ')' (comm may hold spaces and parens).
  const size_t paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && (line[paren + 2] == 'Z' || line[paren + 2] == 'X');
}

// A killed worker's socket closes while the kernel is still tearing the process down, so
// the session can end a moment before the process is gone: look again for a short while.
bool ProcessGoneWithin(uint32_t pid, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!ProcessGone(pid)) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// The mailbox a request names, mapped; null when it names none.
absl::StatusOr<std::unique_ptr<SlotMailbox>> OpenMailbox(const nq::v1::RegisterWorkerRequest& request,
                                                         const SlotGeometry& geometry) {
  if (!request.has_slot_mailbox()) return nullptr;
  // A rank of a group applies its changes at the step its leader names (step_command.h); a
  // mailbox would apply them at whatever step each rank reaches first, and ranks would disagree.
  if (request.world_size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rank ", request.rank(), " of world size ", request.world_size(),
        " registered a slot mailbox: only a worker of world size 1 may (a tensor-parallel rank applies slot "
        "changes at the step its leader names)"));
  }
  if (request.slot_mailbox().shm().empty()) {
    return absl::InvalidArgumentError("slot_mailbox names no shared-memory object (shm)");
  }
  absl::StatusOr<SlotMailbox> mailbox =
      SlotMailbox::Open(request.slot_mailbox().shm(), static_cast<uint32_t>(geometry.moe_layer_ids.size()),
                        geometry.experts_per_layer);
  if (!mailbox.ok()) return Annotate(mailbox.status(), "slot mailbox");
  return std::make_unique<SlotMailbox>(*std::move(mailbox));
}

}  // namespace

std::string SessionKey(const std::string& tp_group, uint32_t rank) {
  return tp_group.empty() ? absl::StrCat(rank) : absl::StrCat(tp_group, "/", rank);
}

WorkerRegistry::WorkerRegistry(metrics::Registry& metrics, std::string release_id)
    : release_id_(std::move(release_id)),
      workers_gauge_(metrics.Gauge("nq_streamer_workers_registered",
                                   "Worker ranks registered with this streamer").Get()),
      arena_bytes_gauge_(metrics.Gauge("nq_streamer_mapped_arena_bytes",
                                       "Bytes of worker slot arenas mapped by this streamer").Get()),
      registrations_(metrics.Counter("nq_streamer_registrations_total",
                                     "Worker registrations accepted").Get()) {}

absl::StatusOr<std::string> WorkerRegistry::Register(const nq::v1::RegisterWorkerRequest& request) {
  if (request.world_size() == 0 || request.rank() >= request.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", request.rank(), " of world size ",
                                                   request.world_size(), " is out of range"));
  }
  // A group's ranks load together (group_sessions.h): a streaming rank must say which group.
  if (request.world_size() > 1 && !request.release_id().empty() && request.tp_group().empty()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", request.rank(), " of world size ", request.world_size(),
                                                   " streams experts but names no tensor-parallel group (tp_group)"));
  }
  ASSIGN_OR_RETURN(SlotGeometry geometry, SlotGeometry::FromProto(request.geometry()));
  if (!release_id_.empty() && !request.release_id().empty() && request.release_id() != release_id_) {
    return absl::FailedPreconditionError(absl::StrCat("the worker serves release ", request.release_id(),
                                                      ", this streamer release ", release_id_));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SlotMailbox> mailbox, OpenMailbox(request, geometry));
  ASSIGN_OR_RETURN(std::unique_ptr<ArenaWriter> arena, OpenArena(request, geometry.ArenaBytes()));

  auto worker = std::make_shared<RegisteredWorker>();
  worker->rank = request.rank();
  worker->world_size = request.world_size();
  worker->tp_group = request.tp_group();
  worker->pid = request.pid();
  worker->hostname = request.hostname();
  worker->release_id = request.release_id();
  worker->geometry = std::move(geometry);
  worker->arena = std::move(arena);
  worker->mailbox = std::move(mailbox);

  absl::MutexLock lock(&mu_);
  // Every rank of a group must agree on its size and release: one predictor decides for all of
  // them and each loads its own rank's records of the same experts.
  if (!request.tp_group().empty()) {
    for (const auto& [id, other] : workers_) {
      if (other->tp_group != request.tp_group() || other->rank == request.rank()) continue;
      if (other->world_size != request.world_size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor-parallel group ", request.tp_group(), " has world size ", other->world_size, " (rank ",
            other->rank, ", worker ", id, "); rank ", request.rank(), " registered with world size ",
            request.world_size()));
      }
      if (other->release_id != request.release_id()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "tensor-parallel group ", request.tp_group(), " serves release '", other->release_id, "' (rank ",
            other->rank, "); rank ", request.rank(), " registered with release '", request.release_id(), "'"));
      }
    }
  }
  // A second live process claiming a rank that has a session is refused; a restarted worker
  // (its predecessor's process gone, or on another host where we cannot tell) replaces it.
  for (const auto& [id, other] : workers_) {
    if (other->rank == request.rank() && other->tp_group == request.tp_group() && other->session_active && other->pid != request.pid() &&
        other->hostname == request.hostname() && !ProcessGone(other->pid)) {
      return absl::AlreadyExistsError(absl::StrCat("rank ", request.rank(), " is served by live process ", other->pid,
                                                   " (worker ", id, ")"));
    }
  }
  for (auto it = workers_.begin(); it != workers_.end();) {
    if (it->second->rank == request.rank() && it->second->tp_group == request.tp_group()) {
      spdlog::info("rank {} registered again: dropping its earlier registration {}{}", request.rank(), it->first,
                   it->second->session_active ? " and ending its session" : "");
      // Its loader may still be writing the arena (the same one, when the same process
      // reconnects): end the session now; the new session waits for it (OpenSession).
      if (it->second->session_active && it->second->cancel_session) it->second->cancel_session();
      it = workers_.erase(it);
    } else {
      ++it;
    }
  }
  worker->worker_id = request.tp_group().empty()
                          ? absl::StrCat("r", request.rank(), "-", next_id_++)
                          : absl::StrCat(request.tp_group(), ":r", request.rank(), "-", next_id_++);
  const std::string id = worker->worker_id;
  spdlog::info("registered worker {} (pid {}, {} MoE layers x {} slots x {} bytes, arena {}, slot mailbox {})", id,
               worker->pid, worker->geometry.moe_layer_ids.size(), worker->geometry.slots_per_layer,
               worker->geometry.rec_bytes, worker->arena->Describe(),
               worker->mailbox ? worker->mailbox->name() : "none (changes in updates)");
  workers_[id] = std::move(worker);
  registrations_.Increment();
  UpdateGaugesLocked();
  return id;
}

absl::StatusOr<std::shared_ptr<RegisteredWorker>> WorkerRegistry::OpenSession(const std::string& worker_id,
                                                                             std::function<void()> cancel_session,
                                                                             absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    return absl::NotFoundError(absl::StrCat("unknown worker_id '", worker_id,
                                            "': register first (the streamer may have restarted)"));
  }
  if (it->second->session_active) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", worker_id, " already has a session"));
  }
  // One session per rank writes its arena: a replaced registration's session was cancelled by
  // Register, and this one starts once that one has closed.
  const uint32_t rank = it->second->rank;
  const std::string key = SessionKey(it->second->tp_group, rank);
  const auto no_other_session = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto open = open_sessions_.find(key);
    return open == open_sessions_.end() || open->second == 0;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&no_other_session), wait)) {
    return absl::UnavailableError(absl::StrCat("rank ", key, "'s earlier session is still stopping its loader after ",
                                               absl::FormatDuration(wait), "; retry"));
  }
  it = workers_.find(worker_id);  // the lock was released while waiting
  if (it == workers_.end() || it->second->session_active) {
    return absl::AbortedError(absl::StrCat("worker ", worker_id, " registered again while its session waited"));
  }
  it->second->session_active = true;
  it->second->cancel_session = std::move(cancel_session);
  ++open_sessions_[key];
  return it->second;
}

int WorkerRegistry::OpenSessions(uint32_t rank, const std::string& tp_group) const {
  absl::MutexLock lock(&mu_);
  auto open = open_sessions_.find(SessionKey(tp_group, rank));
  return open == open_sessions_.end() ? 0 : open->second;
}

void WorkerRegistry::CloseSession(const std::string& worker_id, uint32_t rank, const std::string& tp_group) {
  std::shared_ptr<RegisteredWorker> dropped;
  {
    absl::MutexLock lock(&mu_);
    if (auto open = open_sessions_.find(SessionKey(tp_group, rank)); open != open_sessions_.end() && open->second > 0) --open->second;
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) return;
    dropped = std::move(it->second);
    workers_.erase(it);
  }
  const std::string name = dropped->arena->shm_name();
  const std::string mailbox_name = dropped->mailbox ? dropped->mailbox->name() : "";
  const bool gone = ProcessGoneWithin(dropped->pid, std::chrono::seconds(2));
  dropped.reset();  // unmaps the arena and the mailbox
  // The worker died without unlinking its objects; nobody else will.
  for (const std::string& object : {name, mailbox_name}) {
    if (!gone || object.empty()) continue;
    if (absl::Status s = SharedMemory::Unlink(object); !s.ok()) {
      spdlog::warn("could not remove dead worker's shared memory {}: {}", object, s.ToString());
    }
  }
  spdlog::info("worker {} session ended{}: arena {} released", worker_id,
               gone ? " (process gone)" : "", name.empty() ? "(device)" : name);
  // The gauges last: a scrape that no longer counts this worker finds its arena unmapped and, if
  // its process is gone, unlinked (before, they dropped first and a test that waited on them
  // could still see the dead worker's shared memory under load).
  absl::MutexLock lock(&mu_);
  UpdateGaugesLocked();
}

size_t WorkerRegistry::size() const {
  absl::MutexLock lock(&mu_);
  return workers_.size();
}

bool WorkerRegistry::Contains(const std::string& worker_id) const {
  absl::MutexLock lock(&mu_);
  return workers_.count(worker_id) != 0;
}

void WorkerRegistry::UpdateGaugesLocked() {
  double bytes = 0;
  for (const auto& [id, worker] : workers_) bytes += static_cast<double>(worker->arena->bytes());
  workers_gauge_.Set(static_cast<double>(workers_.size()));
  arena_bytes_gauge_.Set(bytes);
}

}  // namespace nq::streamer
