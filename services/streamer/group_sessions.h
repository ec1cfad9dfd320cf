// The tensor-parallel groups whose ranks hold sessions with this streamer (issue #18, DESIGN.md
// section 4: "one streamer decides for every rank of its node, so ranks never disagree").
//
// A group gets one SlotLoader for all its ranks (slot_loader.h), started once every rank
// 0..W-1 has an open session, and fed by rank 0's routing reports only. Its updates go to rank
// 0's session; rank 0 relays each to the other ranks inside the step command of the step at
// which every rank applies it, so every rank switches an expert between 2 and 4 bits at the
// same decode step. The loader adopts rank 0's READY slots: the other ranks' tables are rank
// 0's, or lag it by updates rank 0 has applied and will relay with its next command (and a
// rank that joins a newly formed group clears its table and registers again).
//
// When any rank's session ends, the group's loader stops (before that rank's arena can be
// unmapped) and the other ranks' sessions are ended too: the loader's picture of rank 0's
// table, taken at its hello, is stale by then, so every rank registers again and the group
// restarts from fresh hellos.
//
// A rank on another node joins through its node's streamer's link (RankLink, remote_rank.h) as a
// remote member: its loads are ordered over the link and its results come back through
// OnPeerLoaded; it leaves when the link ends, like a session (docs/tp_streamers.md).
//
// Thread-safe: every session thread of every group calls in.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nq/v1/streamer.pb.h"
#include "services/streamer/slot_loader.h"
#include "services/streamer/worker_registry.h"

namespace nq::streamer {

class GroupSessions {
 public:
  // Makes (and starts, from rank 0's hello) the loader of a group whose ranks all have
  // sessions; nullptr when there is nothing to load (no release here).
  using StartLoader = std::function<absl::StatusOr<std::unique_ptr<SlotLoader>>(
      std::vector<std::shared_ptr<RegisteredWorker>> members, const nq::v1::SessionHello& leader_hello,
      SlotLoader::Send leader_send)>;

  explicit GroupSessions(StartLoader start_loader) : start_loader_(std::move(start_loader)) {}

  // Rank `worker->rank` of group `worker->tp_group` opened its session (`send` writes on it,
  // `end_session` ends it). Starts the group's loader when this completes the group.
  // FAILED_PRECONDITION when the rank already has a session here or the world size disagrees
  // with the group's; the errors of the loader's start (the caller ends this session, which
  // ends the others).
  absl::Status Join(std::shared_ptr<RegisteredWorker> worker, const nq::v1::SessionHello& hello,
                    SlotLoader::Send send, std::function<void()> end_session);
  // The session of `worker_id` ended: stops the group's loader (joined before this returns, so
  // the caller may unmap the arena; a rank leaving while another's Leave stops it waits for that
  // stop too) and ends the other ranks' sessions (those still open: never a session that has
  // returned).
  void Leave(const std::string& tp_group, uint32_t rank, const std::string& worker_id);

  // Rank 0's reports feed the group's predictor; the other ranks' are dropped (false).
  bool OnRouting(const std::string& tp_group, uint32_t rank, nq::v1::RoutingReport report);
  void OnUnmapAck(const std::string& tp_group, uint32_t rank, nq::v1::UnmapAck ack);
  // A remote rank's answer to one of its group loader's orders.
  void OnPeerLoaded(const std::string& tp_group, uint32_t rank, nq::v1::LoadResult result);

  // Whether the group's loader runs (tests).
  bool Loading(const std::string& tp_group) const;

 private:
  struct Member {
    std::shared_ptr<RegisteredWorker> worker;
    nq::v1::SessionHello hello;
    SlotLoader::Send send;
    std::function<void()> end_session;
  };
  struct Group {
    uint32_t world_size = 0;
    std::map<uint32_t, Member> members;  // by rank: the open sessions
    std::shared_ptr<SlotLoader> loader;  // while every rank has a session
    // The loader the first leaving rank is stopping: every rank that leaves waits for its stop.
    std::shared_ptr<SlotLoader> stopping;
  };

  std::shared_ptr<SlotLoader> LoaderOf(const std::string& tp_group) const;

  const StartLoader start_loader_;
  mutable absl::Mutex mu_;
  std::map<std::string, Group> groups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace nq::streamer
