// SlotLoader (services/streamer/slot_loader.h) driven directly, as a worker session would: routing
// reports in, slot-table updates out, acknowledgements back, records read from a synthetic
// release (tests/format/test_release.h) into an in-memory arena. Issue #14: the bounce-buffer
// cache, cancellation of reads no longer wanted, and the metrics that show both.
//
// Geometry: layer 3 (and 4 where said), 2 slots per layer, the first holding the fixed expert
// (2 for layer 3, 1 for layer 4), the second the single floating slot (F = 1, no staging slot).
// So a floating load can only land once the floating slot is FREE: a replacement waits for its
// victim's unmap to be acknowledged, and a cancelled read must give its slot back.
#include "services/streamer/slot_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "services/common/metrics/registry.h"
#include "services/format/release_reader.h"
#include "tests/common/status_matchers.h"
#include "tests/common/wait_until.h"
#include "tests/format/test_release.h"
#include "tests/streamer/memory_arena.h"
#include "tests/streamer/routing_report.h"

namespace nq::streamer {
namespace {
namespace fs = std::filesystem;
using ::nq::testing::IsOk;

constexpr uint32_t kLayer = 3;
constexpr uint32_t kFixedExpert = 2;  // TestManifest: layer 3's fixed set starts with 2
constexpr uint32_t kA = 3;
constexpr uint32_t kB = 1;
constexpr uint32_t kFloatingSlot = 1;

using ::nq::testing::WaitUntil;

class SlotLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = format::testing::MakeTempDir();
    release_dir_ = root_ + "/release";
    ASSERT_NO_FATAL_FAILURE(format::testing::WriteTestRelease(release_dir_));
    auto release = format::Release::Open(release_dir_);
    ASSERT_THAT(release.status(), IsOk());
    for (uint32_t layer : {3u, 4u}) {
      for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
        auto record = release->ReadRecord(0, layer, e);
        ASSERT_THAT(record.status(), IsOk());
        records_[{layer, e}] = *std::move(record);
      }
    }
  }
  void TearDown() override {
    if (loader_) loader_->Stop();
    loader_.reset();
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  // Opens the release (after any damage the test did) and starts a loader for rank 0.
  void StartLoader(std::vector<uint32_t> layers, bool auto_ack = true) {
    auto_ack_ = auto_ack;
    auto files = RecordFiles::Open({release_dir_});
    ASSERT_THAT(files.status(), IsOk());
    if (after_open_) ASSERT_NO_FATAL_FAILURE(after_open_(**files));
    auto rec_bytes = (*files)->RecordBytes(0, kLayer);
    ASSERT_THAT(rec_bytes.status(), IsOk());
    auto worker = std::make_shared<RegisteredWorker>();
    worker->worker_id = "test-worker";
    worker->rank = 0;
    worker->geometry = SlotGeometry::Packed(std::move(layers), 2, *rec_bytes, format::testing::kExperts, 1);
    ASSERT_THAT(worker->geometry.Validate(), IsOk());
    ASSERT_EQ(worker->geometry.FloatingSlots(), 1u);
    auto arena = std::make_unique<MemoryArena>(worker->geometry.ArenaBytes());
    arena_ = arena.get();
    worker->arena = std::move(arena);
    geometry_ = worker->geometry;
    SlotLoaderOptions options;
    options.files = *files;
    options.store.queue_depth = queue_depth_;
    options.store.buffers = buffers_;
    options.store.verifier = verifier_;
    // Quick to change its mind: no hysteresis and no static prior, so 16 tokens of an expert
    // make it the desired floating expert.
    options.predictor.hysteresis_margin = 0;
    options.predictor.static_weight = 0;
    if (read_budget_ > 0) {
      options.pace_reads = false;
      options.predictor.read_budget = read_budget_;
    }
    // Past every wait below: a path that worked only because the loader wakes up anyway
    // (SlotLoaderOptions::max_sleep) fails here.
    options.max_sleep = absl::Seconds(60);
    metrics_ = std::make_unique<LoaderMetrics>(registry_);
    auto loader = SlotLoader::Create(worker, options, metrics_.get(),
                                     [this](const nq::v1::StreamerMessage& m) { return OnMessage(m); });
    ASSERT_THAT(loader.status(), IsOk());
    loader_ = *std::move(loader);
    ASSERT_THAT(loader_->Start(nq::v1::SessionHello()), IsOk());
  }

  // Runs on the files before the loader starts (e.g. hashes a layer file, then damages it).
  std::function<void(RecordFiles&)> after_open_;
  std::shared_ptr<RecordVerifier> verifier_;

  // The worker's side of the session: applies updates to its table and acknowledges unmaps
  // (at once, or when the test says).
  bool OnMessage(const nq::v1::StreamerMessage& message) {
    const nq::v1::SlotTableUpdate& update = message.update();
    nq::v1::UnmapAck ack;
    ack.set_generation(update.generation());
    {
      absl::MutexLock lock(&mu_);
      updates_.push_back(update);
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
      if (ack.slots_size() > 0 && !auto_ack_) {
        held_acks_.push_back(ack);
        return true;
      }
    }
    if (ack.slots_size() > 0) loader_->OnUnmapAck(ack);
    return true;
  }

  void ReleaseHeldAcks() {
    std::vector<nq::v1::UnmapAck> acks;
    {
      absl::MutexLock lock(&mu_);
      acks.swap(held_acks_);
      auto_ack_ = true;
    }
    for (nq::v1::UnmapAck& ack : acks) loader_->OnUnmapAck(ack);
  }

  // The expert READY in (layer, slot), or -1.
  int64_t ReadyIn(uint32_t layer, uint32_t slot) {
    absl::MutexLock lock(&mu_);
    auto it = ready_.find({layer, slot});
    return it == ready_.end() ? int64_t{-1} : int64_t{it->second};
  }
  int Announcements(uint32_t layer, uint32_t expert) {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(std::count(announced_.begin(), announced_.end(), std::make_pair(layer, expert)));
  }

  // `tokens` decode tokens of layer kLayer all routed to `expert`.
  void Route(uint32_t expert, uint32_t tokens) {
    loader_->OnRouting(TopOneReport(next_token_, kLayer, expert, tokens));
    next_token_ += tokens;
  }

  // One report of 32 tokens of kLayer, the first 16 routed to kA and the rest to kB: two
  // refreshes, the second of which no longer wants A.
  static nq::v1::RoutingReport SwitchFromAToB() {
    nq::v1::RoutingReport report;
    report.set_sequence_id(1);
    report.set_num_tokens(32);
    for (uint32_t t = 0; t < 32; ++t) {
      nq::v1::LayerRouting* entry = report.add_layer_entries();
      entry->set_layer(kLayer);
      entry->add_experts(t < 16 ? kA : kB);
      entry->add_weights(1.0f);
    }
    return report;
  }

  std::vector<std::byte> Slot(uint32_t layer, uint32_t slot) {
    const std::vector<std::byte>& record = records_.at({layer, 0});
    return arena_->Read(geometry_.SlotOffset(*geometry_.LayerIndex(layer), slot), record.size());
  }

  // A sample of the loader's metrics, e.g. `nq_streamer_record_cache_total{result="hit"}`.
  double Metric(const std::string& sample) {
    const std::string text = registry_.Serialize();
    const size_t at = text.find("\n" + sample + " ");
    return at == std::string::npos ? -1 : std::stod(text.substr(at + sample.size() + 2));
  }

  unsigned queue_depth_ = 2;
  unsigned buffers_ = 4;
  uint32_t read_budget_ = 0;  // > 0: a fixed budget per refresh, no pacing
  std::string root_;
  std::string release_dir_;
  std::map<std::pair<uint32_t, uint32_t>, std::vector<std::byte>> records_;
  metrics::Registry registry_;
  std::unique_ptr<LoaderMetrics> metrics_;
  SlotGeometry geometry_;
  MemoryArena* arena_ = nullptr;
  std::unique_ptr<SlotLoader> loader_;
  uint64_t next_token_ = 0;

  absl::Mutex mu_;
  bool auto_ack_ ABSL_GUARDED_BY(mu_) = true;
  std::vector<nq::v1::SlotTableUpdate> updates_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> ready_ ABSL_GUARDED_BY(mu_);  // (layer, slot) -> expert
  std::vector<std::pair<uint32_t, uint32_t>> announced_ ABSL_GUARDED_BY(mu_);    // every READY (layer, expert)
  std::vector<nq::v1::UnmapAck> held_acks_ ABSL_GUARDED_BY(mu_);
};

// An expert evicted and wanted again while its record still sits in a bounce buffer is copied
// into its slot with no disk read. To tell a cached copy from a fresh read, the record on disk
// is overwritten after the first read (records are checked one by one, so the file's other
// records still read): the slot must hold the original bytes.
TEST_F(SlotLoaderTest, CachedRecordLoadsASlotWithoutADiskRead) {
  ASSERT_NO_FATAL_FAILURE(StartLoader({kLayer}, /*auto_ack=*/false));
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, 0) == kFixedExpert; }));
  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kA; }));
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kA}));
  EXPECT_EQ(loader_->stats().disk_reads, 2u);  // the fixed expert and A

  // Overwrite A's record on disk; a read from disk would now bring these bytes.
  {
    auto release = format::Release::Open(release_dir_);
    ASSERT_THAT(release.status(), IsOk());
    auto entry = release->Layer(0, kLayer);
    ASSERT_THAT(entry.status(), IsOk());
    const uint64_t offset = (*entry)->records.offset + uint64_t{kA} * (*entry)->layout.rec_bytes;
    std::fstream f(release_dir_ + "/" + (*entry)->records.file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(offset));
    const std::string junk(records_.at({kLayer, kA}).size(), '\x77');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
    f.close();
    auto reread = release->ReadRecord(0, kLayer, kA);
    ASSERT_THAT(reread.status(), IsOk());
    ASSERT_NE(*reread, records_.at({kLayer, kA})) << "the disk still holds A's record";
  }

  // B replaces A: A's slot is unmapped first (no FREE floating slot), and the worker's
  // acknowledgement is what frees it.
  Route(kB, 16);
  ASSERT_TRUE(WaitUntil([&] { return Metric("nq_streamer_unacked_generations") == 1; }))
      << "an unmap sent and not acknowledged is mailbox lag the gauge must show";
  EXPECT_EQ(ReadyIn(kLayer, kFloatingSlot), -1);
  ReleaseHeldAcks();
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kB; }));
  EXPECT_EQ(loader_->stats().disk_reads, 3u);

  // A again: copied from its bounce buffer.
  Route(kA, 32);
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kA; }));
  const SlotLoader::Stats stats = loader_->stats();
  EXPECT_EQ(stats.disk_reads, 3u) << "the cached record was read from disk again";
  EXPECT_EQ(stats.cache_hits, 1u);
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kA}));
  EXPECT_EQ(Announcements(kLayer, kA), 2);

  EXPECT_EQ(Metric("nq_streamer_record_cache_total{result=\"hit\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_record_cache_total{result=\"miss\"}"), 3);
  EXPECT_EQ(Metric("nq_streamer_read_latency_seconds_count"), 3);  // one per disk read
  EXPECT_EQ(Metric("nq_streamer_load_latency_seconds_count"), 4);  // one per READY
  EXPECT_EQ(Metric("nq_streamer_slot_loads_total{result=\"ready\"}"), 4);
  ASSERT_TRUE(WaitUntil([&] { return Metric("nq_streamer_unacked_generations") == 0; }));
  EXPECT_EQ(Metric("nq_streamer_unmap_ack_latency_seconds_count"), 2);  // A's and B's unmaps
  EXPECT_EQ(Metric("nq_streamer_reads_cancelled_total{stage=\"in_flight\"}"), 0);
}

// One report switches the predictor from A to B between two refreshes: A's read is issued at
// the first and, before the loader ever reaps it, the second no longer wants A. The read is
// cancelled: A is never announced or written, and its slot is FREE at once, which is the only
// way B (whose slot is the same single floating slot) can load without an unmap.
TEST_F(SlotLoaderTest, CancelledReadFreesItsSlotAndIsNeverAnnounced) {
  ASSERT_NO_FATAL_FAILURE(StartLoader({kLayer}));
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, 0) == kFixedExpert; }));
  loader_->OnRouting(SwitchFromAToB());
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kB; }));
  // Both reads reached the disk (A's was cancelled in flight, not dropped from the queue).
  ASSERT_TRUE(WaitUntil([&] { return Metric("nq_streamer_read_queue_depth") == 0; }));
  const SlotLoader::Stats stats = loader_->stats();
  EXPECT_EQ(stats.disk_reads, 3u);
  EXPECT_EQ(stats.reads_cancelled, 1u);
  EXPECT_EQ(Announcements(kLayer, kA), 0);
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kB}));
  const uint64_t floating_offset = geometry_.SlotOffset(0, kFloatingSlot);
  const std::vector<uint64_t> writes = arena_->writes();
  EXPECT_EQ(std::count(writes.begin(), writes.end(), floating_offset), 1) << "A was copied into the slot";
  {
    absl::MutexLock lock(&mu_);
    for (const nq::v1::SlotTableUpdate& update : updates_) {
      for (const nq::v1::SlotChange& change : update.changes()) {
        EXPECT_NE(change.kind(), nq::v1::SlotChange::KIND_UNMAP) << "B waited for an unmap: A's slot was not freed";
      }
    }
  }
  EXPECT_EQ(Metric("nq_streamer_reads_cancelled_total{stage=\"in_flight\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_reads_cancelled_total{stage=\"queued\"}"), 0);
  EXPECT_EQ(Metric("nq_streamer_slot_loads_total{result=\"ready\"}"), 2);
  EXPECT_EQ(Metric("nq_streamer_slot_loads_total{result=\"failed\"}"), 0);
}

// The same switch with one bounce buffer: B cannot start until A's cancelled read lands and its
// buffer comes back, and nothing arrives after that (no report, no acknowledgement) to wake the
// loader. B must still load: landing reads free buffers, and the loads waiting for them start
// then. (It once waited for the next report: a churning plan whose reads were all held up by
// cancelled ones never loaded.)
TEST_F(SlotLoaderTest, ALoadWaitingForACancelledReadsBufferStartsWhenItLands) {
  queue_depth_ = 1;
  buffers_ = 1;
  ASSERT_NO_FATAL_FAILURE(StartLoader({kLayer}));
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, 0) == kFixedExpert; }));
  loader_->OnRouting(SwitchFromAToB());
  EXPECT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kB; }, std::chrono::seconds(5)))
      << "B never loaded after A's cancelled read landed";
  EXPECT_EQ(Announcements(kLayer, kA), 0);
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kB}));
  EXPECT_EQ(loader_->stats().reads_cancelled, 1u);
}

// A plan the read budget cuts short is finished without another report: here the budget is one
// load per refresh and one report makes a floating expert desired in each of two layers. The
// refresh loads one; once it is READY the loader refreshes on its own and loads the other. (It
// once left the other at 2 bits until the next report, which never comes when decode stops.)
TEST_F(SlotLoaderTest, APlanCutByTheReadBudgetIsFinishedWithoutAnotherReport) {
  read_budget_ = 1;
  ASSERT_NO_FATAL_FAILURE(StartLoader({3, 4}));
  constexpr uint32_t kFixedOfLayer4 = 1;
  constexpr uint32_t kWantedInLayer4 = 3;
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(3, 0) == kFixedExpert && ReadyIn(4, 0) == kFixedOfLayer4; }));
  nq::v1::RoutingReport report;
  report.set_sequence_id(1);
  report.set_num_tokens(16);
  for (uint32_t t = 0; t < 16; ++t) {
    for (uint32_t layer : {3u, 4u}) {
      nq::v1::LayerRouting* entry = report.add_layer_entries();
      entry->set_layer(layer);
      entry->add_experts(layer == 3 ? kA : kWantedInLayer4);
      entry->add_weights(1.0f);
    }
  }
  loader_->OnRouting(std::move(report));
  EXPECT_TRUE(WaitUntil([&] { return ReadyIn(3, kFloatingSlot) == kA && ReadyIn(4, kFloatingSlot) == kWantedInLayer4; },
                        std::chrono::seconds(10)))
      << "layer 3: " << ReadyIn(3, kFloatingSlot) << ", layer 4: " << ReadyIn(4, kFloatingSlot);
  EXPECT_EQ(loader_->stats().refreshes, 2u) << "the report's refresh and one of the loader's own";
  EXPECT_EQ(Metric("nq_streamer_predictor_idle_refreshes_total"), 1);
  // The plan is whole: no more refreshes of its own.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(loader_->stats().refreshes, 2u);
}

// A record that fails its check fails its load and leaves its bounce buffer empty: of the two
// fixed loads (layer 3's record damaged, layer 4's whole) only layer 4's record is cached. The
// record is checked on its own (no whole-file hash, reason "checksum"), so only that expert is
// lost: another expert of the same layer file still loads, intact.
TEST_F(SlotLoaderTest, CorruptRecordIsNeverCached) {
  {
    auto release = format::Release::Open(release_dir_);
    ASSERT_THAT(release.status(), IsOk());
    auto entry = release->Layer(0, kLayer);
    ASSERT_THAT(entry.status(), IsOk());
    format::testing::FlipByte(release_dir_ + "/rank0/L3.bin",
                              (*entry)->records.offset + uint64_t{kFixedExpert} * (*entry)->layout.rec_bytes + 100);
  }
  ASSERT_NO_FATAL_FAILURE(StartLoader({3, 4}));
  // The loader counts a load READY as it adds the change to the update it sends next, so the
  // announcement reaches this test's session a little later: wait for both.
  ASSERT_TRUE(WaitUntil([&] {
    const SlotLoader::Stats s = loader_->stats();
    return s.loads_ready == 1 && s.loads_failed == 1 && ReadyIn(4, 0) == 1;
  }));
  const SlotLoader::Stats stats = loader_->stats();
  EXPECT_EQ(stats.cached_records, 1u) << "the corrupt record was cached";
  EXPECT_EQ(ReadyIn(4, 0), 1);
  EXPECT_EQ(ReadyIn(3, 0), -1);
  EXPECT_EQ(Announcements(3, kFixedExpert), 0);
  EXPECT_EQ(Metric("nq_streamer_record_cache_total{result=\"miss\"}"), 2);
  EXPECT_EQ(Metric("nq_streamer_record_cache_total{result=\"hit\"}"), 0);
  EXPECT_EQ(Metric("nq_streamer_slot_loads_total{result=\"failed\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_read_errors_total{reason=\"checksum\"}"), 1);
  EXPECT_LT(Metric("nq_streamer_read_errors_total{reason=\"hash\"}"), 1) << "a whole layer file was hashed";

  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return ReadyIn(kLayer, kFloatingSlot) == kA; }))
      << "another expert of the damaged layer file did not load";
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kA}));
  EXPECT_EQ(loader_->stats().cached_records, 2u);
  EXPECT_EQ(Metric("nq_streamer_slot_loads_total{result=\"failed\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_read_errors_total{reason=\"checksum\"}"), 1);
}

// Issue #22: a record that went bad after its layer file was hashed (the file check is cached
// per process, so it would not notice) fails its own checksum: that expert is never announced
// READY, stays out of the cache, and the fault is counted by reason; the other fixed load lands.
TEST_F(SlotLoaderTest, RecordFailingItsChecksumNeverBecomesReady) {
  auto verifier = RecordVerifier::Create(2);
  ASSERT_THAT(verifier.status(), IsOk());
  verifier_ = *verifier;
  after_open_ = [&](RecordFiles& files) {
    ASSERT_THAT(files.VerifyLayer(0, 3), IsOk());
    ASSERT_THAT(files.VerifyLayer(0, 4), IsOk());
    const uint64_t rec_bytes = *files.RecordBytes(0, 3);
    format::testing::FlipByte(release_dir_ + "/rank0/L3.bin", kFixedExpert * rec_bytes + 700);
  };
  ASSERT_NO_FATAL_FAILURE(StartLoader({3, 4}));
  // The loader counts a load READY as it adds the change to the update it sends next, so the
  // announcement reaches this test's session a little later: wait for both.
  ASSERT_TRUE(WaitUntil([&] {
    const SlotLoader::Stats s = loader_->stats();
    return s.loads_ready == 1 && s.loads_failed == 1 && ReadyIn(4, 0) == 1;
  }));
  EXPECT_EQ(ReadyIn(4, 0), 1);
  EXPECT_EQ(ReadyIn(3, 0), -1);
  EXPECT_EQ(Announcements(3, kFixedExpert), 0);
  EXPECT_EQ(loader_->stats().cached_records, 1u) << "the record that failed its checksum was cached";
  EXPECT_EQ(Metric("nq_streamer_read_errors_total{reason=\"checksum\"}"), 1);
  // Absent (-1) until counted: the file matched its hash before the damage; only the record
  // check failed.
  EXPECT_LT(Metric("nq_streamer_read_errors_total{reason=\"hash\"}"), 1) << "the file check should have passed";
  EXPECT_EQ(Metric("nq_streamer_slot_loads_total{result=\"failed\"}"), 1);
  EXPECT_EQ(Metric("nq_streamer_slot_loads_total{result=\"ready\"}"), 1);
}

}  // namespace
}  // namespace nq::streamer
