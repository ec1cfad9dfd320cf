// SlotLoader's gate-lookahead hints (issue #21, slot_loader_lookahead.cc), driven as a worker
// session would: hints in, slot-table updates out, unmaps acknowledged at once. No routing report
// is sent, so no predictor refresh runs: every load here is a hint's.
//
// Geometry: layer 3 with 2 slots, the first holding the fixed expert 2, the second the single
// floating slot (F = 1, no staging slot), as in slot_loader_test.cc.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "services/common/metrics/registry.h"
#include "services/format/release_reader.h"
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
using ::nq::testing::WaitUntil;


nq::v1::LookaheadHint Hint(uint64_t sequence, uint64_t token, uint32_t layer, std::vector<uint32_t> experts) {
  nq::v1::LookaheadHint hint;
  hint.set_sequence_id(sequence);
  hint.set_token(token);
  hint.set_layer(layer);
  hint.set_source_layer(layer - 1);
  for (uint32_t e : experts) hint.add_experts(e);
  return hint;
}

class LookaheadHintTest : public ::testing::Test {
 protected:
  // Faults injected into the loader's reads (none here).
  virtual ReadFaults Faults() const { return {}; }

  void SetUp() override {
    root_ = format::testing::MakeTempDir();
    release_dir_ = root_ + "/release";
    ASSERT_NO_FATAL_FAILURE(format::testing::WriteTestRelease(release_dir_));
    auto files = RecordFiles::Open({release_dir_});
    ASSERT_THAT(files.status(), IsOk());
    auto rec_bytes = (*files)->RecordBytes(0, kLayer);
    ASSERT_THAT(rec_bytes.status(), IsOk());
    auto worker = std::make_shared<RegisteredWorker>();
    worker->worker_id = "test-worker";
    worker->rank = 0;
    worker->geometry = SlotGeometry::Packed({kLayer}, 2, *rec_bytes, format::testing::kExperts, 1);
    ASSERT_THAT(worker->geometry.Validate(), IsOk());
    ASSERT_EQ(worker->geometry.FloatingSlots(), 1u);
    worker->arena = std::make_unique<MemoryArena>(worker->geometry.ArenaBytes());
    SlotLoaderOptions options;
    options.files = *files;
    options.store.queue_depth = 2;
    options.store.buffers = 4;
    options.store.faults = Faults();
    // Quick to change its mind (as in slot_loader_test.cc): 16 tokens of an expert make it the
    // desired floating expert.
    options.predictor.hysteresis_margin = 0;
    options.predictor.static_weight = 0;
    // Past every wait below: a path that only works because the loader wakes up anyway fails.
    options.max_sleep = absl::Seconds(60);
    metrics_ = std::make_unique<LoaderMetrics>(registry_);
    auto loader = SlotLoader::Create(worker, options, metrics_.get(),
                                     [this](const nq::v1::StreamerMessage& m) { return OnMessage(m); });
    ASSERT_THAT(loader.status(), IsOk());
    loader_ = *std::move(loader);
    ASSERT_THAT(loader_->Start(nq::v1::SessionHello()), IsOk());
    // The fixed set lands first.
    ASSERT_TRUE(WaitUntil([&] { return ReadyIn(0) == kFixedExpert; }));
  }
  int Cancelled() { return static_cast<int>(loader_->stats().reads_cancelled); }
  void TearDown() override {
    if (loader_) loader_->Stop();
    loader_.reset();
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  // The worker: applies updates and acknowledges unmaps at once.
  bool OnMessage(const nq::v1::StreamerMessage& message) {
    nq::v1::UnmapAck ack;
    ack.set_generation(message.update().generation());
    {
      absl::MutexLock lock(&mu_);
      for (const nq::v1::SlotChange& change : message.update().changes()) {
        if (change.kind() == nq::v1::SlotChange::KIND_READY) {
          ready_[change.slot()] = change.expert();
          ++announced_[change.expert()];
        } else if (change.kind() == nq::v1::SlotChange::KIND_UNMAP) {
          ready_.erase(change.slot());
          ++unmaps_;
          nq::v1::SlotRef* ref = ack.add_slots();
          ref->set_layer(change.layer());
          ref->set_slot(change.slot());
        }
      }
    }
    if (ack.slots_size() > 0) loader_->OnUnmapAck(ack);
    return true;
  }
  int64_t ReadyIn(uint32_t slot) {
    absl::MutexLock lock(&mu_);
    auto it = ready_.find(slot);
    return it == ready_.end() ? int64_t{-1} : int64_t{it->second};
  }
  int Announced(uint32_t expert) {
    absl::MutexLock lock(&mu_);
    return announced_[expert];
  }
  int Unmaps() {
    absl::MutexLock lock(&mu_);
    return unmaps_;
  }
  // Every hint sent so far has been handled (accepted or refused).
  bool Handled(uint64_t hints) {
    const SlotLoader::Stats s = loader_->stats();
    return s.hints_accepted + s.hints_refused == hints;
  }
  double Metric(const std::string& sample) {
    const std::string text = registry_.Serialize();
    const size_t at = text.find("\n" + sample + " ");
    return at == std::string::npos ? -1 : std::stod(text.substr(at + sample.size() + 2));
  }

  std::string root_;
  std::string release_dir_;
  metrics::Registry registry_;
  std::unique_ptr<LoaderMetrics> metrics_;
  std::unique_ptr<SlotLoader> loader_;
  absl::Mutex mu_;
  std::map<uint32_t, uint32_t> ready_ ABSL_GUARDED_BY(mu_);  // slot -> expert
  std::map<uint32_t, int> announced_ ABSL_GUARDED_BY(mu_);   // expert -> READY announcements
  int unmaps_ ABSL_GUARDED_BY(mu_) = 0;
};

TEST_F(LookaheadHintTest, AHintedExpertThatIsNotResidentIsLoadedWithoutAnyRoutingReport) {
  loader_->OnLookahead(Hint(1, 0, kLayer, {kA}));
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kFloatingSlot) == kA; }));
  const SlotLoader::Stats s = loader_->stats();
  EXPECT_EQ(s.hints_accepted, 1u);
  EXPECT_EQ(s.hint_loads_queued, 1u);
  EXPECT_EQ(s.hint_loads_ready, 1u);
  EXPECT_EQ(s.refreshes, 0u);  // not the predictor's doing
  EXPECT_EQ(Metric("nq_streamer_lookahead_hints_total{result=\"accepted\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_lookahead_loads_total{stage=\"queued\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_lookahead_loads_total{stage=\"ready\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_lookahead_load_latency_seconds_count"), 1);
}

TEST_F(LookaheadHintTest, AHintWhoseExpertsAreAllResidentCostsNothing) {
  const uint64_t reads_before = loader_->stats().disk_reads;
  loader_->OnLookahead(Hint(1, 0, kLayer, {kFixedExpert}));
  ASSERT_TRUE(WaitUntil([&] { return Handled(1); }));
  const SlotLoader::Stats s = loader_->stats();
  EXPECT_EQ(s.hints_accepted, 1u);
  EXPECT_EQ(s.hint_loads_queued, 0u);
  EXPECT_EQ(s.disk_reads, reads_before);
  EXPECT_EQ(Announced(kFixedExpert), 1);  // the session start's load only
}

TEST_F(LookaheadHintTest, RepeatedHintsNeverLoadAnExpertTwice) {
  // Three layers' worth of hints for the same token and the next, all naming A.
  for (uint64_t token = 0; token < 3; ++token) loader_->OnLookahead(Hint(1, token, kLayer, {kA}));
  ASSERT_TRUE(WaitUntil([&] { return Handled(3) && ReadyIn(kFloatingSlot) == kA; }));
  loader_->OnLookahead(Hint(1, 3, kLayer, {kA}));
  ASSERT_TRUE(WaitUntil([&] { return Handled(4); }));
  EXPECT_EQ(Announced(kA), 1);
  EXPECT_EQ(loader_->stats().hint_loads_queued, 1u);
  EXPECT_EQ(loader_->stats().loads_ready, 2u);  // the fixed expert and A
}

TEST_F(LookaheadHintTest, MalformedAndStaleHintsAreRefusedAndTheNextGoodOneStillLoads) {
  loader_->OnLookahead(Hint(5, 0, /*layer=*/99, {kA}));                        // no slots for that layer
  loader_->OnLookahead(Hint(5, 0, kLayer, {format::testing::kExperts}));      // expert id out of range
  loader_->OnLookahead(Hint(5, 0, kLayer, {kA, kA}));                         // named twice
  loader_->OnLookahead(Hint(5, 0, kLayer, {}));                               // nothing named
  nq::v1::LookaheadHint weights = Hint(5, 0, kLayer, {kA});
  weights.add_weights(0.5f);
  weights.add_weights(0.5f);
  loader_->OnLookahead(weights);                                              // 2 weights, 1 expert
  ASSERT_TRUE(WaitUntil([&] { return Handled(5); }));
  EXPECT_EQ(loader_->stats().hints_refused, 5u);
  EXPECT_EQ(loader_->stats().hints_accepted, 0u);
  // A later sequence is accepted (resident expert: nothing to load), then an older one refused.
  loader_->OnLookahead(Hint(6, 0, kLayer, {kFixedExpert}));
  loader_->OnLookahead(Hint(5, 1, kLayer, {kA}));
  ASSERT_TRUE(WaitUntil([&] { return Handled(7); }));
  EXPECT_EQ(loader_->stats().hints_refused, 6u);
  EXPECT_EQ(loader_->stats().hint_loads_queued, 0u);
  EXPECT_EQ(Metric("nq_streamer_lookahead_hints_total{result=\"refused\"}"), 6);
  // Nothing was lost: the session's next good hint loads.
  loader_->OnLookahead(Hint(6, 1, kLayer, {kA}));
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kFloatingSlot) == kA; }));
  EXPECT_EQ(ReadyIn(0), kFixedExpert);
}

TEST_F(LookaheadHintTest, AHintNeverEvictsAnExpertTheSameTokenWasHintedToUse) {
  loader_->OnLookahead(Hint(1, 0, kLayer, {kA}));
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kFloatingSlot) == kA; }));
  // The same token now also wants B: the only floating slot holds A, which this token uses.
  loader_->OnLookahead(Hint(1, 0, kLayer, {kB, kA}));
  ASSERT_TRUE(WaitUntil([&] { return Handled(2); }));
  EXPECT_EQ(loader_->stats().hint_loads_unplaced, 1u);
  EXPECT_EQ(Metric("nq_streamer_lookahead_loads_total{stage=\"unplaced\"}"), 1);
  EXPECT_EQ(Unmaps(), 0);
  EXPECT_EQ(ReadyIn(kFloatingSlot), kA);
  // The next token does not name A: A makes room for B (unmapped, acknowledged, then loaded).
  loader_->OnLookahead(Hint(1, 1, kLayer, {kB}));
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kFloatingSlot) == kB; }));
  EXPECT_EQ(Unmaps(), 1);
  EXPECT_EQ(ReadyIn(0), kFixedExpert);  // the fixed slot is never a hint's victim
  EXPECT_EQ(loader_->stats().hint_loads_ready, 2u);
}

}  // namespace
}  // namespace nq::streamer

namespace nq::streamer {
namespace {

// Every read takes at least 300 ms, so a hinted read is still out when a refresh comes.
class LookaheadHintSlowReadsTest : public LookaheadHintTest {
 protected:
  ReadFaults Faults() const override { return ReadFaults{.slow = 1.0, .slow_ms = 300}; }
};

// A refresh made from the reports (16 tokens routed to B) does not want A, whose hinted read is in
// flight: it would cancel a planned read, but a hint names what the running token needs, so A's
// read is kept and A announced. (B then replaces A through the ordinary eviction.)
TEST_F(LookaheadHintSlowReadsTest, ARefreshThatDoesNotWantAHintedLoadNeverCancelsIt) {
  loader_->OnLookahead(Hint(1, 0, kLayer, {kA}));
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().hint_loads_queued == 1; }));
  nq::v1::RoutingReport report = TopOneReport(0, kLayer, kB, 16);
  report.set_sequence_id(1);
  loader_->OnRouting(report);
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().refreshes >= 1; }));
  EXPECT_EQ(ReadyIn(kFloatingSlot), -1);  // A's read was still out at the refresh
  ASSERT_TRUE(WaitUntil([&] { return Announced(kA) == 1; }, std::chrono::seconds(20)));
  EXPECT_EQ(Cancelled(), 0);
  EXPECT_EQ(loader_->stats().hint_loads_ready, 1u);
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kFloatingSlot) == kB; }, std::chrono::seconds(20)));
}

}  // namespace
}  // namespace nq::streamer
