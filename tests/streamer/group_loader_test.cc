// One SlotLoader for a tensor-parallel group of two ranks (SlotLoader::CreateForGroup, issue #18),
// driven directly: the synthetic release has tp_size 2 (tests/format/test_release.h), each rank
// an in-memory arena. A load is announced only once both ranks' own records are in their slots;
// a rank whose reads fail keeps the expert from being announced to anyone; a slot unmapped is
// reused only when both ranks acknowledged it.
//
// Geometry (as slot_loader_test.cc): layer 3, 2 slots, slot 0 for the fixed expert 2, slot 1 the
// single floating slot, no staging slot: a replacement lands only once its victim's slot is FREE.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "services/common/metrics/registry.h"
#include "services/format/release_reader.h"
#include "services/streamer/read_faults.h"
#include "services/streamer/slot_loader.h"
#include "tests/common/status_matchers.h"
#include "tests/common/wait_until.h"
#include "tests/format/test_release.h"
#include "tests/streamer/loader_test_layer.h"
#include "tests/streamer/memory_arena.h"
#include "tests/streamer/routing_report.h"

namespace nq::streamer {
namespace {
namespace fs = std::filesystem;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr uint32_t kRanks = format::testing::kTpSize;

using ::nq::testing::WaitUntil;

class GroupLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = format::testing::MakeTempDir();
    release_dir_ = root_ + "/release";
    ASSERT_NO_FATAL_FAILURE(format::testing::WriteTestRelease(release_dir_));
    auto release = format::Release::Open(release_dir_);
    ASSERT_THAT(release.status(), IsOk());
    for (uint32_t rank = 0; rank < kRanks; ++rank) {
      for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
        auto record = release->ReadRecord(rank, kLayer, e);
        ASSERT_THAT(record.status(), IsOk());
        records_[{rank, e}] = *std::move(record);
      }
    }
    // Each rank holds its own slice of every expert: the two ranks' records differ.
    ASSERT_NE(records_.at({0, kFixedExpert}), records_.at({1, kFixedExpert}));
  }
  void TearDown() override {
    if (loader_) loader_->Stop();
    loader_.reset();
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::vector<std::shared_ptr<RegisteredWorker>> Members(uint64_t rec_bytes) {
    std::vector<std::shared_ptr<RegisteredWorker>> members;
    for (uint32_t rank = 0; rank < kRanks; ++rank) {
      auto worker = std::make_shared<RegisteredWorker>();
      worker->worker_id = absl::StrCat("g:r", rank);
      worker->rank = rank;
      worker->world_size = kRanks;
      worker->tp_group = "/nq-tp-test";
      worker->geometry = SlotGeometry::Packed({kLayer}, 2, rec_bytes, format::testing::kExperts, 1);
      auto arena = std::make_unique<MemoryArena>(worker->geometry.ArenaBytes());
      arenas_.push_back(arena.get());
      worker->arena = std::move(arena);
      members.push_back(std::move(worker));
    }
    return members;
  }

  void StartGroupLoader(ReadFaults faults = {}) {
    auto files = RecordFiles::Open({release_dir_});
    ASSERT_THAT(files.status(), IsOk());
    auto rec_bytes = (*files)->RecordBytes(0, kLayer);
    ASSERT_THAT(rec_bytes.status(), IsOk());
    std::vector<std::shared_ptr<RegisteredWorker>> members = Members(*rec_bytes);
    geometry_ = members[0]->geometry;
    SlotLoaderOptions options;
    options.files = *files;
    options.store.queue_depth = 2;
    options.store.buffers = 4;
    options.store.faults = faults;
    options.predictor.hysteresis_margin = 0;
    options.predictor.static_weight = 0;
    metrics_ = std::make_unique<LoaderMetrics>(registry_);
    auto loader = SlotLoader::CreateForGroup(std::move(members), options, metrics_.get(),
                                             [this](const nq::v1::StreamerMessage& m) { return OnLeaderMessage(m); });
    ASSERT_THAT(loader.status(), IsOk());
    loader_ = *std::move(loader);
    ASSERT_THAT(loader_->Start(nq::v1::SessionHello()), IsOk());
  }

  // Rank 0's session: it applies each update (and, in the cluster, relays it to rank 1 with the
  // next step command). Rank 0 acknowledges unmaps at once; rank 1's acknowledgements wait until
  // the test sends them (ReleaseRankOneAcks).
  bool OnLeaderMessage(const nq::v1::StreamerMessage& message) {
    const nq::v1::SlotTableUpdate& update = message.update();
    nq::v1::UnmapAck ack;
    ack.set_generation(update.generation());
    {
      absl::MutexLock lock(&mu_);
      for (const nq::v1::SlotChange& change : update.changes()) {
        if (change.kind() == nq::v1::SlotChange::KIND_READY) {
          ready_[{change.layer(), change.slot()}] = change.expert();
          announced_.push_back({change.layer(), change.expert()});
        } else if (change.kind() == nq::v1::SlotChange::KIND_UNMAP) {
          ready_.erase({change.layer(), change.slot()});
          nq::v1::SlotRef* ref = ack.add_slots();
          ref->set_layer(change.layer());
          ref->set_slot(change.slot());
        }
      }
      if (ack.slots_size() > 0) rank_one_acks_.push_back(ack);
    }
    if (ack.slots_size() > 0) loader_->OnUnmapAck(0, ack);
    return true;
  }

  void ReleaseRankOneAcks() {
    std::vector<nq::v1::UnmapAck> acks;
    {
      absl::MutexLock lock(&mu_);
      acks.swap(rank_one_acks_);
    }
    for (nq::v1::UnmapAck& ack : acks) loader_->OnUnmapAck(1, ack);
  }

  int64_t ReadyIn(uint32_t layer, uint32_t slot) {
    absl::MutexLock lock(&mu_);
    auto it = ready_.find({layer, slot});
    return it == ready_.end() ? int64_t{-1} : int64_t{it->second};
  }
  size_t Announced() {
    absl::MutexLock lock(&mu_);
    return announced_.size();
  }
  size_t HeldAcks() {
    absl::MutexLock lock(&mu_);
    return rank_one_acks_.size();
  }

  // `tokens` decode tokens of layer kLayer all routed to `expert`.
  void Route(uint32_t expert, uint32_t tokens) {
    loader_->OnRouting(TopOneReport(next_token_, kLayer, expert, tokens));
    next_token_ += tokens;
  }

  // Rank `rank`'s slot bytes.
  std::vector<std::byte> Slot(uint32_t rank, uint32_t slot) {
    return arenas_[rank]->Read(geometry_.SlotOffset(0, slot), records_.at({0, 0}).size());
  }

  std::string root_;
  std::string release_dir_;
  std::map<std::pair<uint32_t, uint32_t>, std::vector<std::byte>> records_;  // (rank, expert) of layer 3
  metrics::Registry registry_;
  std::unique_ptr<LoaderMetrics> metrics_;
  SlotGeometry geometry_;
  std::vector<MemoryArena*> arenas_;  // by rank
  std::unique_ptr<SlotLoader> loader_;
  uint64_t next_token_ = 0;

  absl::Mutex mu_;
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> ready_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<uint32_t, uint32_t>> announced_ ABSL_GUARDED_BY(mu_);
  std::vector<nq::v1::UnmapAck> rank_one_acks_ ABSL_GUARDED_BY(mu_);
};

TEST_F(GroupLoaderTest, LoadIsAnnouncedOnceEveryRankHoldsItsOwnRecord) {
  ASSERT_NO_FATAL_FAILURE(StartGroupLoader());
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, 0) == kFixedExpert; }));
  EXPECT_EQ(Slot(0, 0), records_.at({0, kFixedExpert}));
  EXPECT_EQ(Slot(1, 0), records_.at({1, kFixedExpert}));
  // One read per rank for the one load.
  EXPECT_EQ(loader_->stats().disk_reads, 2u);
  EXPECT_EQ(loader_->stats().loads_ready, 1u);
}

TEST_F(GroupLoaderTest, OneRanksFailedReadsKeepTheExpertFromEveryRank) {
  // Every read of rank 1's records fails; rank 0's all succeed.
  ASSERT_NO_FATAL_FAILURE(StartGroupLoader(ReadFaults{.eio = 1.0, .rank = 1}));
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().loads_failed >= 1; }));
  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().loads_failed >= 2; }));
  EXPECT_EQ(Announced(), 0u) << "a load was announced though rank 1 lacks its bytes";
  EXPECT_EQ(loader_->stats().loads_ready, 0u);
  // Rank 0's reads landed (and were copied into its LOADING slot), rank 1's failed.
  EXPECT_GE(loader_->stats().disk_reads, 4u);
}

TEST_F(GroupLoaderTest, UnmappedSlotIsReusedOnlyOnceEveryRankAcknowledged) {
  ASSERT_NO_FATAL_FAILURE(StartGroupLoader());
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, 0) == kFixedExpert; }));
  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kA; }));
  // B replaces A: A's slot is unmapped; rank 0 acknowledges at once, rank 1 not yet.
  Route(kB, 16);
  ASSERT_TRUE(WaitUntil([&] { return HeldAcks() > 0; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(ReadyIn(kLayer, kFloatingSlot), -1) << "B landed in a slot rank 1 still maps";
  EXPECT_EQ(Slot(1, kFloatingSlot), records_.at({1, kA})) << "rank 1's mapped slot was written";
  EXPECT_GE(metrics_->unacked_generations.Value(), 1) << "rank 1 has not acknowledged the unmap";
  ReleaseRankOneAcks();
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kB; }));
  EXPECT_TRUE(WaitUntil([&] { return metrics_->unacked_generations.Value() == 0; }));
  EXPECT_EQ(Slot(0, kFloatingSlot), records_.at({0, kB}));
  EXPECT_EQ(Slot(1, kFloatingSlot), records_.at({1, kB}));
}

TEST_F(GroupLoaderTest, MembersOfAnotherGeometryOrMissingARankAreRefused) {
  auto files = RecordFiles::Open({release_dir_});
  ASSERT_THAT(files.status(), IsOk());
  SlotLoaderOptions options;
  options.files = *files;
  metrics_ = std::make_unique<LoaderMetrics>(registry_);
  std::vector<std::shared_ptr<RegisteredWorker>> members = Members(*(*files)->RecordBytes(0, kLayer));
  members[1]->geometry.slots_per_layer = 3;
  EXPECT_THAT(SlotLoader::CreateForGroup(members, options, metrics_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 1's slot arena geometry differs")));
  members.pop_back();
  members.push_back(nullptr);
  EXPECT_THAT(SlotLoader::CreateForGroup(members, options, metrics_.get(), nullptr).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 1 is missing")));
}

}  // namespace
}  // namespace nq::streamer
