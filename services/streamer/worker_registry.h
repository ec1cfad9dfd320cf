// The workers registered with this streamer and their mapped slot arenas (and slot mailboxes).
// A worker's arena is dropped when its session ends; if its process is gone, its shared-memory
// names are unlinked too, so a dead worker leaks nothing (DESIGN.md section 4).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "nq/v1/streamer.pb.h"
#include "services/common/metrics/registry.h"
#include "services/common/slot_geometry.h"
#include "services/common/slot_mailbox.h"
#include "services/streamer/arena_writer.h"

namespace nq::streamer {

struct RegisteredWorker {
  std::string worker_id;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  // The tensor-parallel group (RegisterWorkerRequest.tp_group); empty for a single worker.
  std::string tp_group;
  uint32_t pid = 0;
  std::string hostname;
  std::string release_id;
  SlotGeometry geometry;
  std::unique_ptr<ArenaWriter> arena;  // the streamer writes only FREE slots
  // Where the worker takes slot-table changes inside its decode steps (RegisterWorkerRequest.
  // slot_mailbox); null: changes travel in SlotTableUpdate. Only a worker of world size 1 has one.
  std::unique_ptr<SlotMailbox> mailbox;
  // A rank on another node (StreamerPeer.RankLink, peer_service.h): no arena here (arena is
  // null); its node's streamer reads its records on the orders its group's loader sends through
  // this, and the results come back through SlotLoader::OnPeerLoaded. False once the link is gone.
  // Null for a rank registered with this streamer.
  std::function<bool(const nq::v1::LoadOrder&)> order_load;
  bool remote() const { return order_load != nullptr; }
  bool session_active = false;
  // Ends the session (its loader stops before the session closes); set by OpenSession.
  std::function<void()> cancel_session;
};

// Names one rank of one group (a single worker: its rank alone): one session at a time per key.
std::string SessionKey(const std::string& tp_group, uint32_t rank);

class WorkerRegistry {
 public:
  // `release_id`: the release this streamer serves (format::ReleaseId), or empty for none. A
  // worker serving another release is refused.
  explicit WorkerRegistry(metrics::Registry& metrics, std::string release_id = "");

  // Validates the request, maps the arena (and the slot mailbox, when the request names one: its
  // SlotMailbox::Open errors, NOT_FOUND or FAILED_PRECONDITION; INVALID_ARGUMENT from a rank of
  // world size > 1 or without a name), and records the worker under a fresh id,
  // replacing an earlier registration of the same rank of the same group (a restarted or
  // reconnecting worker). A rank naming a group whose other registered ranks have another
  // world size or release is refused (FAILED_PRECONDITION naming both), as is a rank of a
  // streaming group (world_size > 1 with a release_id) that names no group (INVALID_ARGUMENT).
  // ALREADY_EXISTS when another live process on the same host holds that rank with an open
  // session. A replaced registration's open session is cancelled (cancel_session): the arena
  // may be the same one, and two loaders must never write it at once.
  absl::StatusOr<std::string> Register(const nq::v1::RegisterWorkerRequest& request);
  // Marks the session of `worker_id` active and returns the worker, which stays alive (arena
  // mapped) while the caller holds it, even if the rank registers again meanwhile. Waits up
  // to `wait` for an earlier session of the same rank to close (its loader stopped) first.
  // NOT_FOUND for an unknown id, FAILED_PRECONDITION when it already has a session,
  // UNAVAILABLE when the earlier session is still closing after `wait` (retry).
  absl::StatusOr<std::shared_ptr<RegisteredWorker>> OpenSession(
      const std::string& worker_id, std::function<void()> cancel_session = nullptr,
      absl::Duration wait = absl::Seconds(10));
  // The session ended (its loader stopped): drop the worker and unmap its arena, and let a
  // waiting session of the same rank start.
  void CloseSession(const std::string& worker_id, uint32_t rank, const std::string& tp_group = "");
  // Sessions open now for `rank` of `tp_group` (a replaced one counts until it closes).
  int OpenSessions(uint32_t rank, const std::string& tp_group = "") const;
  size_t size() const;
  // The release this streamer serves (empty for none).
  const std::string& release_id() const { return release_id_; }
  // Whether a worker with this id is registered (tests and status).
  bool Contains(const std::string& worker_id) const;

 private:
  void UpdateGaugesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<RegisteredWorker>> workers_ ABSL_GUARDED_BY(mu_);
  // By SessionKey (group and rank), until CloseSession.
  std::map<std::string, int> open_sessions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  const std::string release_id_;
  metrics::Gauge& workers_gauge_;
  metrics::Gauge& arena_bytes_gauge_;
  metrics::Counter& registrations_;
};

}  // namespace nq::streamer
