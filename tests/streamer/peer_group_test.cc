// A tensor-parallel group spanning two nodes (docs/tp_streamers.md, issue #18), without the
// network: rank 0 is the deciding streamer's own (an in-memory arena), rank 1 is a remote member
// (remote_rank.h) whose orders a PeerOrderRunner carries out into rank 1's arena, as the applying
// streamer of the other node does. The link between them is a pair of function calls the test
// can hold, so it decides when rank 1's answers reach the decider.
//
// Geometry as group_loader_test.cc: layer 3, 2 slots, slot 0 for the fixed expert 2, slot 1 the
// single floating slot, no staging slot.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "services/common/metrics/registry.h"
#include "services/format/release_reader.h"
#include "services/streamer/peer_order_runner.h"
#include "services/streamer/read_faults.h"
#include "services/streamer/remote_rank.h"
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
using ::nq::testing::WaitUntil;
using ::testing::HasSubstr;

constexpr char kGroup[] = "/nq-tp-peer-test";

class PeerGroupTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = format::testing::MakeTempDir();
    release_dir_ = root_ + "/release";
    ASSERT_NO_FATAL_FAILURE(format::testing::WriteTestRelease(release_dir_));
    auto release = format::Release::Open(release_dir_);
    ASSERT_THAT(release.status(), IsOk());
    release_id_ = release->id();
    for (uint32_t rank = 0; rank < format::testing::kTpSize; ++rank) {
      for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
        auto record = release->ReadRecord(rank, kLayer, e);
        ASSERT_THAT(record.status(), IsOk());
        records_[{rank, e}] = *std::move(record);
      }
    }
    auto files = RecordFiles::Open({release_dir_});
    ASSERT_THAT(files.status(), IsOk());
    files_ = *files;
    auto rec_bytes = files_->RecordBytes(0, kLayer);
    ASSERT_THAT(rec_bytes.status(), IsOk());
    geometry_ = SlotGeometry::Packed({kLayer}, 2, *rec_bytes, format::testing::kExperts, 1);
    metrics_ = std::make_unique<LoaderMetrics>(registry_);
  }
  void TearDown() override {
    if (loader_) loader_->Stop();
    if (runner_) runner_->Stop();
    loader_.reset();
    runner_.reset();
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::shared_ptr<RegisteredWorker> LocalRank(uint32_t rank, MemoryArena** arena) {
    auto worker = std::make_shared<RegisteredWorker>();
    worker->worker_id = absl::StrCat("local:r", rank);
    worker->rank = rank;
    worker->world_size = format::testing::kTpSize;
    worker->tp_group = kGroup;
    worker->release_id = release_id_;
    worker->geometry = geometry_;
    auto memory = std::make_unique<MemoryArena>(geometry_.ArenaBytes());
    *arena = memory.get();
    worker->arena = std::move(memory);
    return worker;
  }

  // What rank 1's node streamer would send in its link's hello.
  nq::v1::PeerRankHello RankOneHello() {
    nq::v1::PeerRankHello hello;
    nq::v1::RegisterWorkerRequest* r = hello.mutable_registration();
    r->set_rank(1);
    r->set_world_size(format::testing::kTpSize);
    r->set_tp_group(kGroup);
    r->set_release_id(release_id_);
    r->set_hostname("node-b");
    *r->mutable_geometry() = geometry_.ToProto();
    return hello;
  }

  // Rank 0 here; rank 1 on "node B": its runner reads into its own arena and answers the loader
  // (unless the test holds the answers).
  void StartGroup(ReadFaults rank_one_faults = {}) {
    std::shared_ptr<RegisteredWorker> rank0 = LocalRank(0, &arena0_);
    std::shared_ptr<RegisteredWorker> rank1_there = LocalRank(1, &arena1_);
    RecordStoreOptions store;
    store.queue_depth = 2;
    store.buffers = 2;
    store.faults = rank_one_faults;
    auto runner = PeerOrderRunner::Create(rank1_there, files_, store, metrics_.get(),
                                          [this](const nq::v1::LoadResult& result) { Answer(result); });
    ASSERT_THAT(runner.status(), IsOk());
    runner_ = *std::move(runner);
    auto rank1_here = RemoteRank(RankOneHello(), release_id_, [this](const nq::v1::LoadOrder& order) {
      {
        absl::MutexLock lock(&mu_);
        orders_.push_back(order);
      }
      runner_->Order(order);
      return true;
    });
    ASSERT_THAT(rank1_here.status(), IsOk());
    ASSERT_TRUE((*rank1_here)->remote());

    SlotLoaderOptions options;
    options.files = files_;
    options.store.queue_depth = 2;
    options.store.buffers = 4;
    options.predictor.hysteresis_margin = 0;
    options.predictor.static_weight = 0;
    auto loader = SlotLoader::CreateForGroup({rank0, *rank1_here}, options, metrics_.get(),
                                             [this](const nq::v1::StreamerMessage& m) { return OnLeaderMessage(m); });
    ASSERT_THAT(loader.status(), IsOk());
    loader_ = *std::move(loader);
    ASSERT_THAT(loader_->Start(nq::v1::SessionHello()), IsOk());
  }

  void Answer(const nq::v1::LoadResult& result) {
    {
      absl::MutexLock lock(&mu_);
      if (hold_answers_) {
        held_.push_back(result);
        return;
      }
    }
    loader_->OnPeerLoaded(1, result);
  }
  void HoldAnswers() {
    absl::MutexLock lock(&mu_);
    hold_answers_ = true;
  }
  // Delivers the held answers and lets later ones through.
  void ReleaseAnswers() {
    std::vector<nq::v1::LoadResult> held;
    {
      absl::MutexLock lock(&mu_);
      hold_answers_ = false;
      held.swap(held_);
    }
    for (const nq::v1::LoadResult& result : held) loader_->OnPeerLoaded(1, result);
  }
  size_t HeldAnswers() {
    absl::MutexLock lock(&mu_);
    return held_.size();
  }
  std::vector<nq::v1::LoadOrder> Orders() {
    absl::MutexLock lock(&mu_);
    return orders_;
  }

  // Rank 0 applies each update and acknowledges unmaps; rank 1's acknowledgements come forwarded
  // from its node (here at once, as its session would send them).
  bool OnLeaderMessage(const nq::v1::StreamerMessage& message) {
    const nq::v1::SlotTableUpdate& update = message.update();
    nq::v1::UnmapAck ack;
    ack.set_generation(update.generation());
    {
      absl::MutexLock lock(&mu_);
      for (const nq::v1::SlotChange& change : update.changes()) {
        if (change.kind() == nq::v1::SlotChange::KIND_READY) {
          ready_[{change.layer(), change.slot()}] = change.expert();
          announced_.push_back(change.expert());
        } else if (change.kind() == nq::v1::SlotChange::KIND_UNMAP) {
          ready_.erase({change.layer(), change.slot()});
          nq::v1::SlotRef* ref = ack.add_slots();
          ref->set_layer(change.layer());
          ref->set_slot(change.slot());
        }
      }
    }
    if (ack.slots_size() > 0) {
      loader_->OnUnmapAck(0, ack);
      loader_->OnUnmapAck(1, ack);
    }
    return true;
  }
  int64_t ReadyIn(uint32_t slot) {
    absl::MutexLock lock(&mu_);
    auto it = ready_.find({kLayer, slot});
    return it == ready_.end() ? int64_t{-1} : int64_t{it->second};
  }
  std::vector<uint32_t> Announced() {
    absl::MutexLock lock(&mu_);
    return announced_;
  }
  void Route(uint32_t expert, uint32_t tokens) {
    loader_->OnRouting(TopOneReport(next_token_, kLayer, expert, tokens));
    next_token_ += tokens;
  }
  std::vector<std::byte> Slot(MemoryArena* arena, uint32_t slot) {
    return arena->Read(geometry_.SlotOffset(0, slot), records_.at({0, 0}).size());
  }

  std::string root_;
  std::string release_dir_;
  std::string release_id_;
  std::shared_ptr<RecordFiles> files_;
  std::map<std::pair<uint32_t, uint32_t>, std::vector<std::byte>> records_;  // (rank, expert) of layer 3
  SlotGeometry geometry_;
  metrics::Registry registry_;
  std::unique_ptr<LoaderMetrics> metrics_;
  MemoryArena* arena0_ = nullptr;
  MemoryArena* arena1_ = nullptr;
  std::unique_ptr<PeerOrderRunner> runner_;
  std::unique_ptr<SlotLoader> loader_;
  uint64_t next_token_ = 0;

  absl::Mutex mu_;
  bool hold_answers_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<nq::v1::LoadResult> held_ ABSL_GUARDED_BY(mu_);
  std::vector<nq::v1::LoadOrder> orders_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> ready_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> announced_ ABSL_GUARDED_BY(mu_);
};

TEST_F(PeerGroupTest, ARemoteRanksOwnRecordLandsOnItsNodeAndTheLoadWaitsForItsAnswer) {
  HoldAnswers();
  ASSERT_NO_FATAL_FAILURE(StartGroup());
  // Rank 1's node read rank 1's record into rank 1's slot; rank 0's own read landed here.
  ASSERT_TRUE(WaitUntil([&] { return HeldAnswers() == 1; }));
  EXPECT_EQ(Slot(arena1_, 0), records_.at({1, kFixedExpert}));
  ASSERT_TRUE(WaitUntil([&] { return Slot(arena0_, 0) == records_.at({0, kFixedExpert}); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(Announced().empty()) << "announced before the remote rank answered";
  ReleaseAnswers();
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(0) == kFixedExpert; }));
  // One order for the one load, naming the slot every rank fills.
  ASSERT_EQ(Orders().size(), 1u);
  EXPECT_EQ(Orders()[0].layer(), kLayer);
  EXPECT_EQ(Orders()[0].expert(), kFixedExpert);
  EXPECT_EQ(Orders()[0].slot(), 0u);
  // The decider read only its own rank's record.
  EXPECT_EQ(loader_->stats().disk_reads, 1u);
  EXPECT_EQ(runner_->stats().loaded, 1u);
  EXPECT_EQ(metrics_->peer_orders_ok.Value(), 1);
}

TEST_F(PeerGroupTest, ARemoteRanksFailedReadsKeepTheExpertFromEveryRank) {
  ASSERT_NO_FATAL_FAILURE(StartGroup(ReadFaults{.eio = 1.0, .rank = 1}));
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().loads_failed >= 1; }));
  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().loads_failed >= 2; }));
  EXPECT_TRUE(Announced().empty()) << "a load was announced though rank 1's node could not read it";
  EXPECT_EQ(loader_->stats().loads_ready, 0u);
  EXPECT_GE(runner_->stats().failed, 2u);
  EXPECT_GE(metrics_->read_errors.WithLabels({"peer"}).Value(), 2);
  EXPECT_GE(metrics_->peer_orders_failed.Value(), 2);
}

TEST_F(PeerGroupTest, ALoadNoLongerWantedKeepsItsSlotUntilTheRemoteAnswerAndIsNotAFailure) {
  ASSERT_NO_FATAL_FAILURE(StartGroup());
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(0) == kFixedExpert; }));
  HoldAnswers();
  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return HeldAnswers() == 1; }));  // A's order answered, held on the way
  // B takes over before A's answer is in: A is no longer wanted, but rank 1's node may still be
  // writing the slot, so B must not be ordered into it yet.
  Route(kB, 48);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(Orders().size(), 2u) << "a second order went to a slot whose remote answer is still out";
  ReleaseAnswers();
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kFloatingSlot) == kB; }));
  EXPECT_EQ(Slot(arena0_, kFloatingSlot), records_.at({0, kB}));
  EXPECT_EQ(Slot(arena1_, kFloatingSlot), records_.at({1, kB}));
  EXPECT_EQ(Announced(), (std::vector<uint32_t>{kFixedExpert, kB})) << "A was announced after it was unwanted";
  EXPECT_EQ(loader_->stats().loads_failed, 0u) << "an unwanted load was counted as a failed record";
  // A is not marked failed: wanted again, it loads.
  Route(kA, 96);
  EXPECT_TRUE(WaitUntil([&] { return ReadyIn(kFloatingSlot) == kA; }));
}

TEST_F(PeerGroupTest, AnswersToNoOrderAreIgnored) {
  HoldAnswers();
  ASSERT_NO_FATAL_FAILURE(StartGroup());
  ASSERT_TRUE(WaitUntil([&] { return HeldAnswers() == 1; }));
  nq::v1::LoadResult stray;
  stray.set_load_id(987654);
  stray.set_ok(true);
  loader_->OnPeerLoaded(1, stray);
  // The real load's answer, but from rank 0, which was never ordered anything.
  nq::v1::LoadResult wrong_rank;
  wrong_rank.set_load_id(Orders()[0].load_id());
  wrong_rank.set_ok(true);
  loader_->OnPeerLoaded(0, wrong_rank);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_TRUE(Announced().empty());
  ReleaseAnswers();
  EXPECT_TRUE(WaitUntil([&] { return ReadyIn(0) == kFixedExpert; }));
}

TEST_F(PeerGroupTest, OrdersOutsideTheRanksGeometryAreAnsweredWithTheReason) {
  ASSERT_NO_FATAL_FAILURE(StartGroup());
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(0) == kFixedExpert; }));
  HoldAnswers();
  nq::v1::LoadOrder order;
  order.set_load_id(1001);
  order.set_layer(kLayer);
  order.set_expert(kA);
  order.set_slot(7);
  runner_->Order(order);
  order.set_load_id(1002);
  order.set_slot(kFloatingSlot);
  order.set_expert(99);
  runner_->Order(order);
  order.set_load_id(1003);
  order.set_layer(5);
  order.set_expert(kA);
  runner_->Order(order);
  ASSERT_TRUE(WaitUntil([&] { return HeldAnswers() == 3; }));
  absl::MutexLock lock(&mu_);
  EXPECT_FALSE(held_[0].ok());
  EXPECT_THAT(held_[0].error(), HasSubstr("slot 7"));
  EXPECT_THAT(held_[1].error(), HasSubstr("expert 99"));
  EXPECT_THAT(held_[2].error(), HasSubstr("5"));
  EXPECT_EQ(held_[2].load_id(), 1003u);
}

TEST_F(PeerGroupTest, ARemoteRankZeroAnotherReleaseOrAMalformedHelloIsRefused) {
  auto order = [](const nq::v1::LoadOrder&) { return true; };
  nq::v1::PeerRankHello hello = RankOneHello();
  EXPECT_THAT(RemoteRank(hello, "another-release", order).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another-release")));
  EXPECT_THAT(RemoteRank(hello, "", order).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no release")));
  hello.mutable_registration()->set_rank(0);
  EXPECT_THAT(RemoteRank(hello, release_id_, order).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 0")));
  hello = RankOneHello();
  hello.mutable_registration()->set_world_size(1);
  EXPECT_THAT(RemoteRank(hello, release_id_, order).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world size 1")));
  hello = RankOneHello();
  hello.mutable_registration()->clear_tp_group();
  EXPECT_THAT(RemoteRank(hello, release_id_, order).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no group")));
  hello = RankOneHello();
  hello.mutable_registration()->mutable_geometry()->set_slots_per_layer(0);
  EXPECT_FALSE(RemoteRank(hello, release_id_, order).ok());

  // A group whose rank 0 is remote has nobody here to send its updates to.
  hello = RankOneHello();
  hello.mutable_registration()->set_rank(0);
  auto remote_zero = std::make_shared<RegisteredWorker>();
  remote_zero->rank = 0;
  remote_zero->tp_group = kGroup;
  remote_zero->geometry = geometry_;
  remote_zero->order_load = order;
  MemoryArena* arena = nullptr;
  SlotLoaderOptions options;
  options.files = files_;
  EXPECT_THAT(SlotLoader::CreateForGroup({remote_zero, LocalRank(1, &arena)}, options, metrics_.get(), nullptr)
                  .status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("rank 0 is served by another streamer")));
}

}  // namespace
}  // namespace nq::streamer
