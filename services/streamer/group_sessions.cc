#include "services/streamer/group_sessions.h"

#include <utility>

#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"

namespace nq::streamer {

absl::Status GroupSessions::Join(std::shared_ptr<RegisteredWorker> worker, const nq::v1::SessionHello& hello,
                                 SlotLoader::Send send, std::function<void()> end_session) {
  const std::string group_name = worker->tp_group;
  const uint32_t rank = worker->rank;
  absl::MutexLock lock(&mu_);
  Group& group = groups_[group_name];
  if (group.members.empty()) group.world_size = worker->world_size;
  if (group.world_size != worker->world_size) {
    return absl::FailedPreconditionError(absl::StrCat("tensor-parallel group ", group_name, " has world size ",
                                                      group.world_size, "; rank ", rank, " has ",
                                                      worker->world_size));
  }
  if (group.members.count(rank) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("rank ", rank, " of tensor-parallel group ", group_name, " already has a session"));
  }
  group.members[rank] = Member{.worker = std::move(worker),
                               .hello = hello,
                               .send = std::move(send),
                               .end_session = std::move(end_session)};
  if (group.members.size() < group.world_size) {
    spdlog::info("tensor-parallel group {}: rank {} joined, {} of {} ranks have sessions", group_name, rank,
                 group.members.size(), group.world_size);
    return absl::OkStatus();
  }
  std::vector<std::shared_ptr<RegisteredWorker>> members;
  for (const auto& [r, member] : group.members) members.push_back(member.worker);
  const Member& leader = group.members.at(0);
  absl::StatusOr<std::unique_ptr<SlotLoader>> loader = start_loader_(std::move(members), leader.hello, leader.send);
  if (!loader.ok()) {
    group.members.erase(rank);
    return loader.status();
  }
  group.loader = *std::move(loader);
  group.stopping.reset();  // stopped: every rank that left waited for it before its session closed
  if (group.loader == nullptr) {
    spdlog::info("tensor-parallel group {}: all {} ranks have sessions; this streamer has no release, so they stay "
                 "at 2 bits",
                 group_name, group.world_size);
    return absl::OkStatus();
  }
  size_t remote = 0;
  for (const auto& [r, member] : group.members) remote += member.worker->remote() ? 1 : 0;
  spdlog::info("tensor-parallel group {}: all {} ranks have sessions; one loader decides for them ({} READY slots of "
               "rank 0 adopted, applied generation {}; {} ranks served by other nodes' streamers)",
               group_name, group.world_size, leader.hello.ready_slots_size(), leader.hello.applied_generation(),
               remote);
  return absl::OkStatus();
}

void GroupSessions::Leave(const std::string& tp_group, uint32_t rank, const std::string& worker_id) {
  std::shared_ptr<SlotLoader> loader;
  std::vector<std::pair<uint32_t, std::string>> others;  // (rank, worker id) of the sessions to end
  {
    absl::MutexLock lock(&mu_);
    auto group = groups_.find(tp_group);
    if (group == groups_.end()) return;
    auto member = group->second.members.find(rank);
    if (member == group->second.members.end() || member->second.worker->worker_id != worker_id) return;
    group->second.members.erase(member);
    if (group->second.loader != nullptr) {
      // The first rank to leave stops the loader and ends the others' sessions.
      group->second.stopping = std::move(group->second.loader);
      for (const auto& [r, other] : group->second.members) others.emplace_back(r, other.worker->worker_id);
    }
    // Every leaving rank waits for the loader's stop (a rank leaving at the same time as another
    // must not unmap its arena while the loader may still write it).
    loader = group->second.stopping;
    if (group->second.members.empty()) groups_.erase(group);
  }
  if (loader == nullptr) return;
  loader->Stop();  // safe beside another rank's Stop: returns once the loader thread is gone
  if (others.empty()) return;
  spdlog::info("tensor-parallel group {}: rank {}'s session ended; the group's loader stopped and its {} other "
               "sessions end, so every rank registers again with its current table",
               tp_group, rank, others.size());
  // Under the lock, and only sessions still here: one that left meanwhile has returned, and its
  // end callback (its RPC's context) must not be touched again.
  absl::MutexLock lock(&mu_);
  auto group = groups_.find(tp_group);
  if (group == groups_.end()) return;
  for (const auto& [r, id] : others) {
    auto member = group->second.members.find(r);
    if (member != group->second.members.end() && member->second.worker->worker_id == id &&
        member->second.end_session) {
      member->second.end_session();
    }
  }
}

std::shared_ptr<SlotLoader> GroupSessions::LoaderOf(const std::string& tp_group) const {
  absl::MutexLock lock(&mu_);
  auto group = groups_.find(tp_group);
  return group == groups_.end() ? nullptr : group->second.loader;
}

bool GroupSessions::OnRouting(const std::string& tp_group, uint32_t rank, nq::v1::RoutingReport report) {
  // Every rank routes the same tokens the same way (the router runs on all-reduced hidden
  // states); rank 0's reports alone are the group's.
  if (rank != 0) return false;
  std::shared_ptr<SlotLoader> loader = LoaderOf(tp_group);
  if (loader == nullptr) return false;
  loader->OnRouting(std::move(report));
  return true;
}

void GroupSessions::OnUnmapAck(const std::string& tp_group, uint32_t rank, nq::v1::UnmapAck ack) {
  std::shared_ptr<SlotLoader> loader = LoaderOf(tp_group);
  if (loader != nullptr) loader->OnUnmapAck(rank, std::move(ack));
}

void GroupSessions::OnPeerLoaded(const std::string& tp_group, uint32_t rank, nq::v1::LoadResult result) {
  std::shared_ptr<SlotLoader> loader = LoaderOf(tp_group);
  if (loader != nullptr) loader->OnPeerLoaded(rank, std::move(result));
}

bool GroupSessions::Loading(const std::string& tp_group) const { return LoaderOf(tp_group) != nullptr; }

}  // namespace nq::streamer
