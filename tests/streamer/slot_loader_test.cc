// SlotLoader (services/streamer/slot_loader.h) driven directly, as a worker session would: routing
// reports in, slot-table updates out, acknowledgements back, records read from a synthetic
// release (tests/format/test_release.h) into an in-memory arena. Issue #14: the bounce-buffer
// cache, cancellation of reads no longer wanted, and the metrics that show both.
//
// Geometry: layer 3 (and 4 where said), 2 slots per layer, the first holding the fixed expert
// (2 for layer 3, 1 for layer 4), the second the single floating slot (F = 1, no staging slot).
// So a floating load can only land once the floating slot is FREE: a replacement waits for its
// victim's unmap to be acknowledged, and a cancelled read must give its slot back.
//
// In mailbox mode (use_mailbox_) the worker has a slot mailbox; the test plays the worker's
// apply with SlotMailbox::ApplyOnHost.
#include "services/streamer/slot_loader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <atomic>
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
#include "absl/strings/str_cat.h"
#include "kernels/slot_mailbox.h"
#include "services/common/metrics/registry.h"
#include "services/common/slot_mailbox.h"
#include "services/format/release_reader.h"
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

  // Opens the release (after any damage the test did) and starts a loader for rank 0. With
  // use_mailbox_ the worker has a slot mailbox (created at the first start, kept across restarts).
  void StartLoader(std::vector<uint32_t> layers, bool auto_ack = true,
                   const nq::v1::SessionHello& hello = nq::v1::SessionHello()) {
    auto_ack_ = auto_ack;
    auto files = RecordFiles::Open({release_dir_});
    ASSERT_THAT(files.status(), IsOk());
    if (after_open_) {
      ASSERT_NO_FATAL_FAILURE(after_open_(**files));
    }
    auto rec_bytes = (*files)->RecordBytes(0, kLayer);
    ASSERT_THAT(rec_bytes.status(), IsOk());
    auto worker = std::make_shared<RegisteredWorker>();
    worker->worker_id = "test-worker";
    worker->rank = 0;
    const uint32_t layer_count = static_cast<uint32_t>(layers.size());
    worker->geometry = SlotGeometry::Packed(std::move(layers), 2, *rec_bytes, format::testing::kExperts, 1);
    ASSERT_THAT(worker->geometry.Validate(), IsOk());
    ASSERT_EQ(worker->geometry.FloatingSlots(), 1u);
    auto arena = std::make_unique<MemoryArena>(worker->geometry.ArenaBytes());
    arena_ = arena.get();
    worker->arena = std::move(arena);
    if (use_mailbox_) {
      if (mailbox_ == nullptr) {
        auto created = SlotMailbox::Create(absl::StrCat("/nq-test-loader-mailbox-", getpid()), layer_count,
                                           format::testing::kExperts);
        ASSERT_THAT(created.status(), IsOk());
        mailbox_ = std::make_unique<SlotMailbox>(*std::move(created));
      }
      // The streamer's own mapping, as the registry opens it.
      auto opened = SlotMailbox::Open(mailbox_->name(), layer_count, format::testing::kExperts);
      ASSERT_THAT(opened.status(), IsOk());
      worker->mailbox = std::make_unique<SlotMailbox>(*std::move(opened));
    }
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
    ASSERT_THAT(loader_->Start(hello), IsOk());
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

  // The worker's mailbox row for (kLayer, expert): what the streamer staged, and what the worker
  // published it applied.
  int32_t Staged(uint32_t expert) {
    const kernels::SlotMailboxRow row = mailbox_->Row(*geometry_.LayerIndex(kLayer));
    // The streamer's thread stores it; atomic_ref needs a mutable object, this load writes nothing.
    return std::atomic_ref<int32_t>(const_cast<int32_t&>(row.staged[expert])).load(std::memory_order_acquire);
  }
  uint64_t Published(uint32_t expert) { return mailbox_->Published(*geometry_.LayerIndex(kLayer), expert); }
  uint32_t PostedSeq(uint32_t expert) { return mailbox_->PostedSeq(*geometry_.LayerIndex(kLayer), expert); }
  size_t Updates() {
    absl::MutexLock lock(&mu_);
    return updates_.size();
  }
  // Writes into (kLayer, slot) so far.
  int64_t WritesInto(uint32_t slot) {
    const std::vector<uint64_t> writes = arena_->writes();
    return std::count(writes.begin(), writes.end(), geometry_.SlotOffset(*geometry_.LayerIndex(kLayer), slot));
  }

  // A sample of the loader's metrics, e.g. `nq_streamer_record_cache_total{result="hit"}`.
  double Metric(const std::string& sample) {
    const std::string text = registry_.Serialize();
    const size_t at = text.find("\n" + sample + " ");
    return at == std::string::npos ? -1 : std::stod(text.substr(at + sample.size() + 2));
  }

  bool use_mailbox_ = false;
  std::unique_ptr<SlotMailbox> mailbox_;  // the worker's side (it owns the name)
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

// Issue #14, mailbox mode: every READY and UNMAP is posted to the worker's slot mailbox (the
// updates on the session carry only their generation and loads in flight), and the floating slot
// A is unmapped from is written again only after the worker applied that unmap: neither an
// UnmapAck over the session nor the loader's own passes free it before. The loader sleeps for
// max_sleep (60 s) when idle, so every wait below that ends sooner shows it polls the mailbox.
TEST_F(SlotLoaderTest, MailboxModeReusesAnUnmappedSlotOnlyOnceTheWorkerAppliedTheUnmap) {
  use_mailbox_ = true;
  ASSERT_NO_FATAL_FAILURE(StartLoader({kLayer}));
  // The fixed expert: posted before the update that rings the worker's doorbell is sent.
  ASSERT_TRUE(WaitUntil([&] { return Updates() >= 1; }));
  EXPECT_EQ(PostedSeq(kFixedExpert), 1u);
  EXPECT_EQ(Staged(kFixedExpert), 0);
  EXPECT_EQ(Published(kFixedExpert), kernels::kMailboxEmptyEntry);
  EXPECT_EQ(Slot(kLayer, 0), records_.at({kLayer, kFixedExpert}));
  EXPECT_LT(Metric("nq_streamer_mailbox_lag_seconds_count"), 1) << "seen applied before the worker applied it";
  EXPECT_EQ(mailbox_->ApplyOnHost(), 1u);
  ASSERT_TRUE(WaitUntil([&] { return Metric("nq_streamer_mailbox_lag_seconds_count") == 1; }))
      << "the loader did not poll the mailbox";
  EXPECT_EQ(Published(kFixedExpert), kernels::PackMailboxEntry(1, 0));

  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return PostedSeq(kA) == 1; }));
  EXPECT_EQ(Staged(kA), static_cast<int32_t>(kFloatingSlot));
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kA}));
  EXPECT_EQ(mailbox_->ApplyOnHost(), 1u);
  ASSERT_TRUE(WaitUntil([&] { return Metric("nq_streamer_mailbox_lag_seconds_count") == 2; }));
  // The fixed expert's READY, the refresh's doorbell (A's read issued), A's READY.
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().updates_sent == 3 && Updates() == 3; }));

  // B wants the only floating slot: A is unmapped through the mailbox, and nothing else.
  Route(kB, 16);
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().updates_sent >= 4 && Updates() >= 4; }));
  EXPECT_EQ(loader_->stats().disk_reads, 2u) << "B's read started before the worker applied A's unmap";
  EXPECT_EQ(PostedSeq(kA), 2u);
  EXPECT_EQ(Staged(kA), -1);
  EXPECT_EQ(Published(kA), kernels::PackMailboxEntry(1, static_cast<int32_t>(kFloatingSlot)));
  uint64_t unmap_generation = 0;
  {
    absl::MutexLock lock(&mu_);
    unmap_generation = updates_.back().generation();
    EXPECT_EQ(updates_.back().loads_in_flight(), 1u) << "B waits for the slot";
  }
  EXPECT_TRUE(WaitUntil([&] { return Metric("nq_streamer_unacked_generations") == 1; }));

  // The worker has not applied the unmap. An UnmapAck over the session would free the slot in
  // the update protocol: here it is ignored. The report after it is the sync point: its refresh
  // runs after the ack was taken and after a mailbox poll, and B's read would be issued in it.
  nq::v1::UnmapAck ack;
  ack.set_generation(unmap_generation);
  nq::v1::SlotRef* ref = ack.add_slots();
  ref->set_layer(kLayer);
  ref->set_slot(kFloatingSlot);
  loader_->OnUnmapAck(ack);
  Route(kB, 16);
  ASSERT_TRUE(WaitUntil([&] { return loader_->stats().updates_sent >= 5 && Updates() >= 5; }));
  EXPECT_EQ(Updates(), 5u);
  EXPECT_EQ(loader_->stats().disk_reads, 2u) << "B's read started before the worker applied A's unmap";
  EXPECT_EQ(WritesInto(kFloatingSlot), 1);
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kA}));
  EXPECT_EQ(PostedSeq(kB), 0u);
  EXPECT_LT(Metric("nq_streamer_unmap_ack_latency_seconds_count"), 1);

  // The worker applies it: B loads into the slot A left, with nothing else waking the loader.
  EXPECT_EQ(mailbox_->ApplyOnHost(), 1u);
  ASSERT_TRUE(WaitUntil([&] { return PostedSeq(kB) == 1; })) << "the slot was not reused after the unmap applied";
  EXPECT_EQ(Staged(kB), static_cast<int32_t>(kFloatingSlot));
  EXPECT_EQ(WritesInto(kFloatingSlot), 2);
  EXPECT_EQ(Slot(kLayer, kFloatingSlot), records_.at({kLayer, kB}));
  EXPECT_EQ(loader_->stats().disk_reads, 3u);
  EXPECT_EQ(Metric("nq_streamer_unmap_ack_latency_seconds_count"), 1);
  ASSERT_TRUE(WaitUntil([&] { return Metric("nq_streamer_unacked_generations") == 0; }));

  EXPECT_EQ(mailbox_->ApplyOnHost(), 1u);
  ASSERT_TRUE(WaitUntil([&] { return Metric("nq_streamer_mailbox_lag_seconds_count") == 4; }));
  EXPECT_EQ(Published(kB), kernels::PackMailboxEntry(1, static_cast<int32_t>(kFloatingSlot)));
  EXPECT_EQ(Metric("nq_streamer_mailbox_posts_total{kind=\"ready\"}"), 3);  // fixed, A, B
  EXPECT_EQ(Metric("nq_streamer_mailbox_posts_total{kind=\"unmap\"}"), 1);  // A
  EXPECT_EQ(Metric("nq_streamer_slot_unmaps_total"), 1);
  absl::MutexLock lock(&mu_);
  uint64_t generation = 0;
  for (const nq::v1::SlotTableUpdate& update : updates_) {
    EXPECT_EQ(update.changes_size(), 0) << "generation " << update.generation() << " carried its changes";
    EXPECT_EQ(update.generation(), generation + 1);
    generation = update.generation();
  }
  EXPECT_TRUE(ready_.empty());
}

// The poster on its own: an update that unmaps expert X from one slot and makes it READY in
// another, listed READY first, leaves X mapped (UNMAPs are posted first), and the unmap counts as
// applied once the worker took the later row.
TEST(MailboxPosterTest, PostsUnmapsFirstAndAcknowledgesOnlyWhatTheWorkerApplied) {
  constexpr uint32_t kX = 3;
  SlotAllocator allocator(SlotGeometry::Packed({kLayer}, 3, 4096, format::testing::kExperts, 1));
  std::optional<uint32_t> first = allocator.Reserve(0, kX, /*fixed=*/false);
  ASSERT_TRUE(first.has_value());
  ASSERT_THAT(allocator.MarkReady(0, *first), IsOk());
  ASSERT_THAT(allocator.MarkUnmapping(0, *first), IsOk());
  std::optional<uint32_t> second = allocator.Reserve(0, kX, /*fixed=*/false);
  ASSERT_TRUE(second.has_value());
  ASSERT_NE(*first, *second);
  ASSERT_THAT(allocator.MarkReady(0, *second), IsOk());
  auto mailbox = SlotMailbox::Create(absl::StrCat("/nq-test-poster-", getpid()), 1, format::testing::kExperts);
  ASSERT_THAT(mailbox.status(), IsOk());
  metrics::Registry registry;
  LoaderMetrics metrics(registry);
  MailboxPoster poster(&*mailbox, &allocator, &metrics);
  EXPECT_FALSE(poster.pending());

  nq::v1::SlotTableUpdate update;
  nq::v1::SlotChange* ready = update.add_changes();
  ready->set_kind(nq::v1::SlotChange::KIND_READY);
  ready->set_layer(kLayer);
  ready->set_slot(*second);
  ready->set_expert(kX);
  nq::v1::SlotChange* unmap = update.add_changes();
  unmap->set_kind(nq::v1::SlotChange::KIND_UNMAP);
  unmap->set_layer(kLayer);
  unmap->set_slot(*first);
  poster.Post(7, update);
  EXPECT_EQ(mailbox->PostedSeq(0, kX), 2u);
  EXPECT_TRUE(poster.pending());
  EXPECT_TRUE(poster.Poll().empty()) << "acknowledged before the worker applied anything";

  EXPECT_EQ(mailbox->ApplyOnHost(), 1u);
  EXPECT_EQ(mailbox->Published(0, kX), kernels::PackMailboxEntry(2, static_cast<int32_t>(*second)));
  const std::vector<nq::v1::UnmapAck> acks = poster.Poll();
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_EQ(acks[0].generation(), 7u);
  ASSERT_EQ(acks[0].slots_size(), 1);
  EXPECT_EQ(acks[0].slots(0).layer(), kLayer);
  EXPECT_EQ(acks[0].slots(0).slot(), *first);
  EXPECT_FALSE(poster.pending());
  EXPECT_TRUE(poster.Poll().empty()) << "a generation acknowledged twice";
  const std::string text = registry.Serialize();
  EXPECT_THAT(text, ::testing::HasSubstr("\nnq_streamer_mailbox_lag_seconds_count 2\n"));
  EXPECT_THAT(text, ::testing::HasSubstr("\nnq_streamer_mailbox_posts_total{kind=\"unmap\"} 1\n"));
}

// A restarted loader drops what its predecessor waited for: the worker applies every posted row
// before its hello, the new loader adopts that table, and its posts continue the mailbox's
// sequence numbers.
TEST_F(SlotLoaderTest, MailboxModeRestartContinuesFromTheMailbox) {
  use_mailbox_ = true;
  ASSERT_NO_FATAL_FAILURE(StartLoader({kLayer}));
  ASSERT_TRUE(WaitUntil([&] { return PostedSeq(kFixedExpert) == 1; }));
  mailbox_->ApplyOnHost();
  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return PostedSeq(kA) == 1; }));
  mailbox_->ApplyOnHost();
  Route(kB, 16);
  ASSERT_TRUE(WaitUntil([&] { return PostedSeq(kA) == 2; }));  // A's unmap, not applied
  // Joins the thread: the update carrying the unmap has been sent.
  loader_->Stop();
  loader_.reset();

  // The worker, before its hello: applies the rows and reports its table.
  EXPECT_EQ(mailbox_->ApplyOnHost(), 1u);
  nq::v1::SessionHello hello;
  {
    absl::MutexLock lock(&mu_);
    hello.set_applied_generation(updates_.back().generation());
  }
  for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
    const int32_t slot = kernels::MailboxEntrySlot(Published(e));
    if (slot < 0) continue;
    nq::v1::SlotEntry* entry = hello.add_ready_slots();
    entry->set_layer(kLayer);
    entry->set_slot(static_cast<uint32_t>(slot));
    entry->set_expert(e);
  }
  ASSERT_EQ(hello.ready_slots_size(), 1) << "only the fixed expert is mapped";
  ASSERT_NO_FATAL_FAILURE(StartLoader({kLayer}, /*auto_ack=*/true, hello));

  // The fixed expert is adopted, not posted again; A comes back into the slot it left.
  Route(kA, 16);
  ASSERT_TRUE(WaitUntil([&] { return PostedSeq(kA) == 3; }));
  EXPECT_EQ(Staged(kA), static_cast<int32_t>(kFloatingSlot));
  EXPECT_EQ(PostedSeq(kFixedExpert), 1u);
  EXPECT_EQ(loader_->stats().disk_reads, 1u) << "the adopted fixed expert was read again";
  EXPECT_EQ(mailbox_->ApplyOnHost(), 1u);
  EXPECT_EQ(Published(kA), kernels::PackMailboxEntry(3, static_cast<int32_t>(kFloatingSlot)));
  ASSERT_TRUE(WaitUntil([&] { return Updates() > 0 && loader_->stats().updates_sent > 0; }));
  absl::MutexLock lock(&mu_);
  EXPECT_GT(updates_.back().generation(), hello.applied_generation());
}

}  // namespace
}  // namespace nq::streamer
