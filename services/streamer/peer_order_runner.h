// On a streamer that applies another node's decisions (nq-streamer --decider_address,
// docs/tp_streamers.md): carries out the deciding streamer's load orders for one rank of this
// node. Each order reads the rank's own record of (layer, expert) through a record store of its
// own (io_uring, O_DIRECT, every record checked against its checksum) into a bounce buffer, copies
// it into the rank's slot, and answers: ok only once the bytes are in the slot. A malformed order
// (a layer, slot or expert outside the rank's geometry, or a slot an earlier order is still
// filling) and a failed read are answered with the reason; nothing is retried here (the decider
// keeps the expert at 2 bits on every rank).
//
// The decider only orders a slot no rank maps (it waits for every rank's unmap acknowledgement),
// so writing it is safe; this runner never decides anything.
//
// One thread owns the store; Order may be called from any thread. Stop joins it: once it returns
// nothing more is written to the arena.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.pb.h"
#include "services/streamer/event_fd.h"
#include "services/streamer/loader_metrics.h"
#include "services/streamer/record_files.h"
#include "services/streamer/record_store.h"
#include "services/streamer/worker_registry.h"

namespace nq::streamer {

class PeerOrderRunner {
 public:
  // Sends one answer to the decider (called on the runner's thread).
  using Answer = std::function<void(const nq::v1::LoadResult&)>;

  // A runner for `rank` (registered here, its arena mapped) reading `files` with `store`'s
  // options. FAILED_PRECONDITION when the release lacks the rank's records of a layer of its
  // geometry or they exceed its slots; the errors of RecordStore::Create and eventfd(2).
  static absl::StatusOr<std::unique_ptr<PeerOrderRunner>> Create(std::shared_ptr<RegisteredWorker> rank,
                                                                 std::shared_ptr<const RecordFiles> files,
                                                                 RecordStoreOptions store, LoaderMetrics* metrics,
                                                                 Answer answer);
  ~PeerOrderRunner();
  PeerOrderRunner(const PeerOrderRunner&) = delete;
  PeerOrderRunner& operator=(const PeerOrderRunner&) = delete;

  void Order(nq::v1::LoadOrder order);
  // Stops the thread; reads in flight are cancelled and drained, their orders left unanswered
  // (the link they would answer on is going away). Idempotent.
  void Stop();

  struct Stats {
    uint64_t loaded = 0;
    uint64_t failed = 0;
  };
  Stats stats() const;

 private:
  struct Reading {
    nq::v1::LoadOrder order;
    size_t layer_index = 0;
    unsigned buffer = 0;
  };

  PeerOrderRunner(std::shared_ptr<RegisteredWorker> rank, std::unique_ptr<RecordStore> store, unsigned buffers,
                  EventFd wake, LoaderMetrics* metrics, Answer answer);
  void Run();
  // Checks `order` against the geometry and the slots being filled; the layer's index.
  absl::StatusOr<size_t> Check(const nq::v1::LoadOrder& order) const;
  void Issue();
  void Reap();
  void Reply(const nq::v1::LoadOrder& order, const absl::Status& status);

  const std::shared_ptr<RegisteredWorker> rank_;
  const std::unique_ptr<RecordStore> store_;
  const EventFd wake_;
  LoaderMetrics* const metrics_;
  const Answer answer_;

  mutable absl::Mutex mu_;
  std::deque<nq::v1::LoadOrder> incoming_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Stats stats_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;

  // Runner thread only.
  std::deque<std::pair<nq::v1::LoadOrder, size_t>> waiting_;  // checked, waiting for a buffer
  std::map<uint64_t, Reading> reading_;                        // by read tag
  std::vector<unsigned> idle_buffers_;
  std::vector<unsigned> prepared_buffers_;                     // PrepareSource'd, released at the end
  std::set<std::pair<size_t, uint32_t>> filling_;              // (layer index, slot) of open orders
  uint64_t next_tag_ = 1;
};

}  // namespace nq::streamer
