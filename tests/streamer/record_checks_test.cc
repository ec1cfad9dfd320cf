// Issue #22: every record the streamer reads is checked against its own checksum in the rank
// index (XXH3-128, or SHA-256 where asked or where the index predates XXH3) before it can be
// handed out (RecordStore + RecordVerifier), and injected slow reads
// (read_faults.h, slow=P:MS) hold their record in the ring for the time asked, cancellable like
// any read. Reads through a small synthetic release (tests/format/test_release.h).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "services/format/file_io.h"
#include "services/format/release_reader.h"
#include "services/streamer/record_store.h"
#include "services/streamer/record_verifier.h"
#include "tests/common/status_matchers.h"
#include "tests/format/test_release.h"

namespace nq::streamer {
namespace {
namespace fs = std::filesystem;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint32_t kLayer = 3;
constexpr uint32_t kBadExpert = 2;

struct Buffer {
  explicit Buffer(size_t n) : data(static_cast<std::byte*>(std::aligned_alloc(kDirectIoAlign, n))), size(n) {}
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  std::span<std::byte> span() { return {data, size}; }
  std::byte* data;
  size_t size;
};

class RecordChecksTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = format::testing::MakeTempDir();
    dir_ = root_ + "/release";
    ASSERT_NO_FATAL_FAILURE(format::testing::WriteTestRelease(dir_));
    auto release = format::Release::Open(dir_);
    ASSERT_THAT(release.status(), IsOk());
    rec_bytes_ = (*release->Layer(0, kLayer))->layout.rec_bytes;
    for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
      auto record = release->ReadRecord(0, kLayer, e);
      ASSERT_THAT(record.status(), IsOk());
      expected_.push_back(*std::move(record));
    }
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  // Reads every record of rank 0's layer 3 through `store` at once; completions by expert.
  std::map<uint32_t, RecordCompletion> ReadLayer(RecordStore& store, std::vector<std::unique_ptr<Buffer>>& out) {
    std::map<uint32_t, RecordCompletion> done;
    for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
      out.push_back(std::make_unique<Buffer>(rec_bytes_));
      EXPECT_THAT(store.Submit({.rank = 0, .layer = kLayer, .expert = e, .destination = out.back()->span(), .tag = e}),
                  IsOk());
    }
    while (done.size() < format::testing::kExperts) {
      absl::StatusOr<RecordCompletion> c = store.Wait();
      if (!c.ok()) {
        ADD_FAILURE() << c.status();
        break;
      }
      done[static_cast<uint32_t>(c->tag)] = *c;
    }
    return done;
  }

  std::string root_, dir_;
  uint64_t rec_bytes_ = 0;
  std::vector<std::vector<std::byte>> expected_;
};

// A record that changes after its layer file was hashed (the file check is cached per process)
// is caught by its own checksum: that read fails with DATA_LOSS, reason "checksum", and hands
// out no bytes; the layer's other records land intact. Inline and on a verifier pool alike.
// The check is the index's XXH3-128 by default and SHA-256 when asked; the error names it.
TEST_F(RecordChecksTest, RecordChangedAfterItsFileWasHashedFailsItsChecksum) {
  for (const auto& [threads, check] : {std::pair{0u, RecordCheck::kFastest}, std::pair{2u, RecordCheck::kFastest},
                                       std::pair{0u, RecordCheck::kSha256}, std::pair{2u, RecordCheck::kSha256}}) {
    const std::string name = check == RecordCheck::kFastest ? "xxh3" : "sha256";
    SCOPED_TRACE((threads == 0 ? "checked on the owner thread with " : "checked on a verifier pool with ") + name);
    std::shared_ptr<RecordVerifier> verifier;
    if (threads > 0) {
      auto created = RecordVerifier::Create(threads);
      ASSERT_THAT(created.status(), IsOk());
      verifier = *created;
    }
    auto store = RecordStore::Open(
        {dir_}, {.queue_depth = 4, .read_piece_bytes = 4096, .record_check = check, .verifier = verifier});
    ASSERT_THAT(store.status(), IsOk());
    ASSERT_THAT((*store)->VerifyLayer(0, kLayer), IsOk());  // the whole file matches now
    format::testing::FlipByte(dir_ + "/rank0/L3.bin", kBadExpert * rec_bytes_ + 100);
    std::vector<std::unique_ptr<Buffer>> out;
    std::map<uint32_t, RecordCompletion> done = ReadLayer(**store, out);
    ASSERT_EQ(done.size(), format::testing::kExperts);
    for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
      if (e == kBadExpert) {
        EXPECT_THAT(done[e].status, StatusIs(absl::StatusCode::kDataLoss,
                                             AllOf(HasSubstr("expert 2 of layer 3"), HasSubstr("rank0/L3.bin"),
                                                   HasSubstr("does not match its " + name + " in the index"))));
        EXPECT_EQ(done[e].failure, "checksum");
        EXPECT_EQ(done[e].bytes, 0u);
      } else {
        ASSERT_THAT(done[e].status, IsOk()) << "expert " << e;
        EXPECT_EQ(done[e].bytes, rec_bytes_);
        EXPECT_TRUE(std::equal(expected_[e].begin(), expected_[e].end(), out[e]->data)) << "expert " << e;
      }
    }
    // The synchronous path checks too.
    Buffer one(rec_bytes_);
    EXPECT_THAT((*store)->ReadRecord(0, kLayer, kBadExpert, one.span()),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not match its " + name)));
    EXPECT_THAT((*store)->ReadRecord(0, kLayer, kBadExpert + 1, one.span()), IsOk());
    format::testing::FlipByte(dir_ + "/rank0/L3.bin", kBadExpert * rec_bytes_ + 100);  // whole again
  }
}

// A release written before XXH3 record checksums is still checked, with SHA-256: the default
// falls back per file, and a changed record is caught all the same.
TEST_F(RecordChecksTest, ReleaseWithoutXxh3ChecksumsIsCheckedWithSha256) {
  ASSERT_NO_FATAL_FAILURE(format::testing::DropRecordXxh3(dir_));
  auto files = RecordFiles::Open({dir_});
  ASSERT_THAT(files.status(), IsOk());
  EXPECT_FALSE((*files)->all_have_record_xxh3());
  auto store = RecordStore::Create(*files, {.queue_depth = 4});
  ASSERT_THAT(store.status(), IsOk());
  ASSERT_THAT((*store)->VerifyLayer(0, kLayer), IsOk());
  format::testing::FlipByte(dir_ + "/rank0/L3.bin", kBadExpert * rec_bytes_ + 100);
  Buffer one(rec_bytes_);
  EXPECT_THAT((*store)->ReadRecord(0, kLayer, kBadExpert, one.span()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not match its sha256 in the index")));
  EXPECT_THAT((*store)->ReadRecord(0, kLayer, kBadExpert + 1, one.span()), IsOk());
}

// The record checksums are only as good as the index they come from: an index edited after the
// release was written (COMPLETE not matching it) is refused when the files open, by name.
TEST_F(RecordChecksTest, AnIndexThatDiffersFromCompleteIsRefusedAtOpen) {
  std::string index = format::testing::ReadAll(dir_ + "/rank0.json");
  const size_t at = index.find("record_xxh3");
  ASSERT_NE(at, std::string::npos);
  const size_t digit = index.find_first_of("0123456789abcdef", index.find('"', at + 13) + 1);
  index[digit] = index[digit] == '0' ? '1' : '0';  // still a valid index, a different checksum
  format::testing::WriteAll(dir_ + "/rank0.json", index);
  EXPECT_THAT(RecordFiles::Open({dir_}).status(),
              StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr("rank0.json"), HasSubstr("sha256 differs"))));
}

// Checking can be turned off (the bench's before/after): the changed record then lands as read.
TEST_F(RecordChecksTest, UncheckedStoreHandsOutWhatTheDiskReturned) {
  auto store = RecordStore::Open({dir_}, {.verify_records = false});
  ASSERT_THAT(store.status(), IsOk());
  ASSERT_THAT((*store)->VerifyLayer(0, kLayer), IsOk());
  format::testing::FlipByte(dir_ + "/rank0/L3.bin", kBadExpert * rec_bytes_ + 100);
  Buffer one(rec_bytes_);
  EXPECT_THAT((*store)->ReadRecord(0, kLayer, kBadExpert, one.span()), IsOk());
  EXPECT_FALSE(std::equal(expected_[kBadExpert].begin(), expected_[kBadExpert].end(), one.data));
}

// A slow read holds its record for the time asked, then lands intact (checked), marked injected.
TEST_F(RecordChecksTest, InjectedSlowReadsLandAfterTheirDelay) {
  auto verifier = RecordVerifier::Create(1);
  ASSERT_THAT(verifier.status(), IsOk());
  auto store = RecordStore::Open(
      {dir_}, {.queue_depth = 2, .read_piece_bytes = 4096, .verifier = *verifier,
               .faults = {.slow = 1.0, .slow_ms = 300}});
  ASSERT_THAT(store.status(), IsOk());
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<Buffer>> out;
  std::map<uint32_t, RecordCompletion> done = ReadLayer(**store, out);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(done.size(), format::testing::kExperts);
  for (uint32_t e = 0; e < format::testing::kExperts; ++e) {
    ASSERT_THAT(done[e].status, IsOk()) << "expert " << e;
    EXPECT_TRUE(done[e].injected_slow);
    EXPECT_GE(done[e].latency_seconds, 0.3);
    EXPECT_TRUE(std::equal(expected_[e].begin(), expected_[e].end(), out[e]->data)) << "expert " << e;
  }
  // 4 records at 2 in flight: two rounds of 300 ms at least.
  EXPECT_GE(seconds, 0.6);
}

// A slow read a refresh no longer wants is cancelled like any other: its timer stops, and its
// completion comes at once, marked cancelled, not after the delay.
TEST_F(RecordChecksTest, SlowReadIsCancelledWithoutWaitingOutItsDelay) {
  auto store = RecordStore::Open({dir_}, {.queue_depth = 2, .faults = {.slow = 1.0, .slow_ms = 20000}});
  ASSERT_THAT(store.status(), IsOk());
  Buffer out(rec_bytes_);
  ASSERT_THAT((*store)->Submit({.rank = 0, .layer = kLayer, .expert = 1, .destination = out.span(), .tag = 9}),
              IsOk());
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<CancelOutcome> outcome = (*store)->Cancel(9);
  ASSERT_THAT(outcome.status(), IsOk());
  EXPECT_EQ(*outcome, CancelOutcome::kInFlight);
  absl::StatusOr<RecordCompletion> done = (*store)->Wait();
  ASSERT_THAT(done.status(), IsOk());
  EXPECT_TRUE(done->cancelled);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
}

TEST(ReadFaultsTest, ParsesSlowReads) {
  absl::StatusOr<ReadFaults> faults = ParseReadFaults("slow=0.5:2000,eio=0.1,seed=3");
  ASSERT_THAT(faults.status(), IsOk());
  EXPECT_EQ(faults->slow, 0.5);
  EXPECT_EQ(faults->slow_ms, 2000u);
  EXPECT_TRUE(faults->any());
  EXPECT_THAT(ParseReadFaults("slow=0.5").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slow=P:MS")));
  EXPECT_THAT(ParseReadFaults("slow=0.5:0").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("[1, 60000]")));
  EXPECT_THAT(ParseReadFaults("slow=0.5:60001").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slow")));
  EXPECT_THAT(ParseReadFaults("slow=2:10").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slow=2:10")));
  EXPECT_THAT(ParseReadFaults("eio=0.6,slow=0.6:10").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("add up to more than 1")));
}

TEST(RecordVerifierTest, ChecksOnItsThreads) {
  EXPECT_THAT(RecordVerifier::Create(0).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 threads")));
  auto verifier = RecordVerifier::Create(2);
  ASSERT_THAT(verifier.status(), IsOk());
  const std::vector<std::byte> bytes(1000, std::byte{7});
  struct Tally {
    absl::Mutex mu;
    int good = 0, bad = 0;
  } tally;
  auto count = [&tally](bool ok) {
    absl::MutexLock lock(&tally.mu);
    ++(ok ? tally.good : tally.bad);
  };
  using Kind = RecordDigest::Kind;
  (*verifier)->Submit(bytes, {.kind = Kind::kSha256, .hex = std::string(64, '0')}, count);
  (*verifier)->Submit(bytes, {.kind = Kind::kSha256, .hex = format::Sha256Hex(bytes)}, count);
  (*verifier)->Submit(bytes, {.kind = Kind::kXxh3, .hex = std::string(32, '0')}, count);
  (*verifier)->Submit(bytes, {.kind = Kind::kXxh3, .hex = format::Xxh3Hex(bytes)}, count);
  // A checksum of the other kind never matches.
  (*verifier)->Submit(bytes, {.kind = Kind::kXxh3, .hex = format::Sha256Hex(bytes)}, count);
  absl::MutexLock lock(&tally.mu);
  tally.mu.Await(absl::Condition(+[](Tally* t) { return t->good + t->bad == 5; }, &tally));
  EXPECT_EQ(tally.good, 2);
  EXPECT_EQ(tally.bad, 3);
}

}  // namespace
}  // namespace nq::streamer
