// RecordStore (services/streamer/record_store.h) against a small synthetic release written
// with format::ReleaseWriter: every record read back through io_uring must equal what
// format::Release::ReadRecord (plain pread) returns.
#include "services/streamer/record_store.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/match.h"
#include "services/format/release_writer.h"
#include "services/model/safetensors_writer.h"
#include "services/streamer/event_fd.h"
#include "tests/format/test_release.h"
#include "tests/common/status_matchers.h"

namespace nq::streamer {
namespace {
namespace fs = std::filesystem;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::_;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr uint32_t kTp = 2;
constexpr uint32_t kExperts = 6;
const std::vector<uint32_t> kLayers = {3, 4};

// Records of two segments (~9 KiB -> rec_bytes 12 KiB), every byte from (rank, layer,
// expert, index).
absl::Status WriteRelease(const std::string& dir) {
  format::Manifest m;
  m.source_model = "test/tiny-moe";
  m.config_hash = std::string(64, 'a');
  m.tp_size = kTp;
  m.experts_per_layer = kExperts;
  m.codec = "scalar-nested";
  for (uint32_t layer : kLayers) {
    format::ManifestLayer ml{.layer = layer, .rotation = {128, layer}, .fixed_4bit = {0},
                             .ranking = {}};
    for (uint32_t e = 0; e < kExperts; ++e) ml.ranking.push_back(e);
    m.layers.push_back(ml);
  }
  auto writer = format::ReleaseWriter::Create(dir, m);
  if (!writer.ok()) return writer.status();
  std::vector<format::SegmentSpec> specs = {{"gate_up.residual", 8000}, {"down.residual", 1500}};
  auto layout = format::RecordLayout::Build(specs);
  if (!layout.ok()) return layout.status();
  for (uint32_t layer : kLayers) {
    for (uint32_t rank = 0; rank < kTp; ++rank) {
      std::vector<std::vector<std::byte>> records;
      for (uint32_t e = 0; e < kExperts; ++e) {
        std::vector<std::vector<std::byte>> segs;
        for (const format::Segment& s : layout->segments) {
          std::vector<std::byte> bytes(s.bytes);
          for (size_t i = 0; i < bytes.size(); ++i) {
            bytes[i] = std::byte((i * 7 + e * 13 + rank * 31 + layer * 5) & 0xff);
          }
          segs.push_back(std::move(bytes));
        }
        std::vector<std::span<const std::byte>> views(segs.begin(), segs.end());
        auto packed = layout->Pack(views);
        if (!packed.ok()) return packed.status();
        records.push_back(*std::move(packed));
      }
      model::SafetensorsWriter resident;
      std::vector<float> values(16, float(layer + rank));
      if (auto s = resident.AddFloat32("experts.base_codes", {4, 4}, values); !s.ok()) return s;
      if (auto s = writer->WriteLayer(rank, layer, *layout, records, resident); !s.ok()) return s;
    }
  }
  return writer->Finish();
}

// Every directory MakeTempDir made, removed after the suite.
std::vector<std::string>& TempDirs() {
  static auto* dirs = new std::vector<std::string>;
  return *dirs;
}

std::string MakeTempDir(const std::string& name, const std::string& parent = ::testing::TempDir()) {
  std::string pattern = (fs::path(parent) / (name + "_XXXXXX")).string();
  EXPECT_NE(::mkdtemp(pattern.data()), nullptr);
  TempDirs().push_back(pattern);
  return pattern;
}

// O_DIRECT-aligned heap memory.
struct AlignedBuffer {
  explicit AlignedBuffer(size_t n)
      : data(static_cast<std::byte*>(std::aligned_alloc(kDirectIoAlign, n))), size(n) {}
  ~AlignedBuffer() { std::free(data); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::span<std::byte> span() { return {data, size}; }
  std::byte* data;
  size_t size;
};

struct Key {
  uint32_t rank, layer, expert;
};

std::vector<Key> AllRecords() {
  std::vector<Key> keys;
  for (uint32_t rank = 0; rank < kTp; ++rank) {
    for (uint32_t layer : kLayers) {
      for (uint32_t e = 0; e < kExperts; ++e) keys.push_back({rank, layer, e});
    }
  }
  return keys;
}

bool DirectIoSupported(const std::string& dir) {
  std::string path = dir + "/.odirect_probe";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) return false;
  void* block = std::aligned_alloc(kDirectIoAlign, kDirectIoAlign);
  std::memset(block, 0, kDirectIoAlign);
  bool ok = ::pwrite(fd, block, kDirectIoAlign, 0) == static_cast<ssize_t>(kDirectIoAlign);
  std::free(block);
  ::close(fd);
  ::unlink(path.c_str());
  return ok;
}

// Where the suite writes its release: a directory whose filesystem takes O_DIRECT, so the
// direct path is always what the tests check. gtest's TempDir is often a tmpfs (kernels
// before 6.6 refuse O_DIRECT there); the working directory (ctest runs in the build tree) or
// $NQ_DIRECT_IO_TEST_DIR are tried next. Empty when none takes it: the suite then fails.
std::string DirectIoParent() {
  std::vector<std::string> candidates = {::testing::TempDir(), fs::current_path().string()};
  if (const char* dir = std::getenv("NQ_DIRECT_IO_TEST_DIR")) candidates.insert(candidates.begin(), dir);
  for (const std::string& dir : candidates) {
    if (DirectIoSupported(dir)) return dir;
  }
  return "";
}

class RecordStoreTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const std::string parent = DirectIoParent();
    ASSERT_FALSE(parent.empty()) << "no test directory takes O_DIRECT (tried gtest's TempDir and the working "
                                    "directory); point NQ_DIRECT_IO_TEST_DIR at one on ext4 or xfs";
    dir_ = new std::string(MakeTempDir("nq_record_store", parent) + "/release");
    ASSERT_THAT(WriteRelease(*dir_), IsOk());
    auto release = format::Release::Open(*dir_);
    ASSERT_THAT(release.status(), IsOk());
    expected_ = new std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<std::byte>>;
    for (const Key& k : AllRecords()) {
      auto bytes = release->ReadRecord(k.rank, k.layer, k.expert);
      ASSERT_THAT(bytes.status(), IsOk());
      (*expected_)[{k.rank, k.layer, k.expert}] = *bytes;
    }
  }
  static void TearDownTestSuite() {
    std::error_code ignored;
    for (const std::string& dir : TempDirs()) fs::remove_all(dir, ignored);
    TempDirs().clear();
    delete dir_;
    delete expected_;
  }

  static const std::vector<std::byte>& Expected(const Key& k) {
    return expected_->at({k.rank, k.layer, k.expert});
  }

  // Reads every record `rounds` times with everything submitted up front, then checks
  // every destination.
  static void ReadAllConcurrently(RecordStore& store, int rounds) {
    std::vector<Key> keys;
    for (int r = 0; r < rounds; ++r) {
      for (const Key& k : AllRecords()) keys.push_back(k);
    }
    std::vector<std::unique_ptr<AlignedBuffer>> out;
    for (size_t i = 0; i < keys.size(); ++i) {
      out.push_back(std::make_unique<AlignedBuffer>(Expected(keys[i]).size()));
      ASSERT_THAT(store.Submit({.rank = keys[i].rank,
                                .layer = keys[i].layer,
                                .expert = keys[i].expert,
                                .destination = out.back()->span(),
                                .tag = i}),
                  IsOk());
    }
    std::vector<bool> seen(keys.size(), false);
    while (store.outstanding() > 0) {
      auto done = store.Wait();
      ASSERT_THAT(done.status(), IsOk());
      ASSERT_THAT(done->status, IsOk());
      ASSERT_LT(done->tag, keys.size());
      EXPECT_FALSE(seen[done->tag]);
      seen[done->tag] = true;
      EXPECT_EQ(done->bytes, Expected(keys[done->tag]).size());
      EXPECT_GE(done->latency_seconds, 0.0);
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      EXPECT_TRUE(seen[i]) << i;
      const auto& want = Expected(keys[i]);
      EXPECT_TRUE(std::equal(want.begin(), want.end(), out[i]->data)) << "record " << i;
    }
  }

  static std::string* dir_;
  static std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<std::byte>>* expected_;
};

std::string* RecordStoreTest::dir_ = nullptr;
std::map<std::tuple<uint32_t, uint32_t, uint32_t>, std::vector<std::byte>>*
    RecordStoreTest::expected_ = nullptr;

// Every record reads back as written, through either integrity check: each record against its
// checksum (the default), or each whole layer file hashed before its first read completes (a
// store that does not check records), which leaves every layer read verified.
TEST_F(RecordStoreTest, ReadRecordRoundTripsEveryExpert) {
  for (const bool check_records : {true, false}) {
    SCOPED_TRACE(check_records ? "record checks" : "whole-file hashes");
    auto store = RecordStore::Open({*dir_}, {.verify_records = check_records});
    ASSERT_THAT(store.status(), IsOk());
    // The suite's directory takes O_DIRECT (DirectIoParent), so every file is opened direct.
    EXPECT_EQ((*store)->buffered_files(), 0u);
    EXPECT_EQ((*store)->direct_files(), kTp * kLayers.size());
    EXPECT_FALSE((*store)->LayerVerified(0, 3));
    for (const Key& k : AllRecords()) {
      AlignedBuffer out(Expected(k).size());
      ASSERT_THAT((*store)->ReadRecord(k.rank, k.layer, k.expert, out.span()), IsOk());
      EXPECT_TRUE(std::equal(Expected(k).begin(), Expected(k).end(), out.data))
          << k.rank << " " << k.layer << " " << k.expert;
    }
    if (!check_records) {
      EXPECT_TRUE((*store)->LayerVerified(0, 3));
      EXPECT_TRUE((*store)->LayerVerified(1, 4));
    }
  }
}

// A store that checks records never hashes a whole layer file (RecordStoreOptions::verify_hashes
// says why): reading every record, asynchronously and synchronously, hashes no file, while a
// store over the same files that does not check records hashes each file at its first read.
TEST_F(RecordStoreTest, StoreThatChecksRecordsNeverHashesAWholeFile) {
  auto files = RecordFiles::Open({*dir_});
  ASSERT_THAT(files.status(), IsOk());
  auto checked = RecordStore::Create(*files, {.queue_depth = 4});
  ASSERT_THAT(checked.status(), IsOk());
  ReadAllConcurrently(**checked, 1);
  for (const Key& k : AllRecords()) {
    AlignedBuffer out(Expected(k).size());
    ASSERT_THAT((*checked)->ReadRecord(k.rank, k.layer, k.expert, out.span()), IsOk());
  }
  EXPECT_EQ((*files)->files_hashed(), 0u);
  for (uint32_t rank = 0; rank < kTp; ++rank) {
    for (uint32_t layer : kLayers) EXPECT_FALSE((*files)->LayerVerified(rank, layer)) << rank << " " << layer;
  }
  auto unchecked = RecordStore::Create(*files, {.queue_depth = 4, .verify_records = false});
  ASSERT_THAT(unchecked.status(), IsOk());
  ReadAllConcurrently(**unchecked, 1);
  EXPECT_EQ((*files)->files_hashed(), kTp * kLayers.size());
  EXPECT_TRUE((*files)->LayerVerified(1, 4));
}

TEST_F(RecordStoreTest, ManyConcurrentSubmissionsAtQueueDepthTwoAndEight) {
  for (unsigned depth : {2u, 8u}) {
    SCOPED_TRACE(depth);
    auto store = RecordStore::Open({*dir_}, {.queue_depth = depth});
    ASSERT_THAT(store.status(), IsOk());
    ReadAllConcurrently(**store, 3);
  }
}

// A record read as several pieces (RecordStoreOptions::read_piece_bytes: here 4 KiB of a 12 KiB
// record, 3 reads in the ring per record) lands whole, into registered buffers and into caller
// memory alike, and counts as one read of the disk per record.
TEST_F(RecordStoreTest, RecordsReadInPiecesLandWhole) {
  for (const bool fixed : {false, true}) {
    SCOPED_TRACE(fixed ? "registered buffers" : "caller memory");
    auto store = RecordStore::Open({*dir_}, {.queue_depth = 2, .read_piece_bytes = 4096, .buffers = 2,
                                             .verify_hashes = false});
    ASSERT_THAT(store.status(), IsOk());
    EXPECT_EQ((*store)->piece_bytes(), 4096u);
    const std::vector<Key> keys = AllRecords();
    std::vector<std::unique_ptr<AlignedBuffer>> memory;
    for (size_t i = 0; i < keys.size(); ++i) {
      const uint64_t rec = *(*store)->RecordBytes(keys[i].rank, keys[i].layer);
      ASSERT_GT(rec, 4096u) << "the test wants records of several pieces";
      memory.push_back(std::make_unique<AlignedBuffer>(rec));
      ReadRequest request{.rank = keys[i].rank, .layer = keys[i].layer, .expert = keys[i].expert, .tag = i};
      if (fixed) {
        request.buffer_index = static_cast<int>(i % 2);
      } else {
        request.destination = memory.back()->span();
      }
      ASSERT_THAT((*store)->Submit(request), IsOk());
      // Registered buffers are reused: one record per buffer at a time.
      while (fixed && (*store)->outstanding() >= 2) {
        auto done = (*store)->Wait();
        ASSERT_THAT(done.status(), IsOk());
        ASSERT_THAT(done->status, IsOk());
        const auto& want = Expected(keys[done->tag]);
        EXPECT_EQ(done->bytes, want.size());
        EXPECT_TRUE(std::equal(want.begin(), want.end(), (*store)->Buffer(done->tag % 2).data())) << done->tag;
      }
    }
    while ((*store)->outstanding() > 0) {
      auto done = (*store)->Wait();
      ASSERT_THAT(done.status(), IsOk());
      ASSERT_THAT(done->status, IsOk());
      const auto& want = Expected(keys[done->tag]);
      const std::byte* got = fixed ? (*store)->Buffer(done->tag % 2).data() : memory[done->tag]->data;
      EXPECT_TRUE(std::equal(want.begin(), want.end(), got)) << done->tag;
    }
    EXPECT_EQ((*store)->reads_issued(), keys.size());
  }
}

// Injected disk faults (read_faults.h) take the store's real error paths: an EIO read and a
// short read complete with an error and say why, and never hand out bytes as a record; with
// both at probability 0.3 over every record, some of each happen and the rest land intact.
TEST_F(RecordStoreTest, InjectedDiskFaultsFailTheirReadsAndSayWhy) {
  auto store = RecordStore::Open(
      {*dir_}, {.queue_depth = 4, .read_piece_bytes = 4096, .faults = {.eio = 0.3, .short_read = 0.3, .seed = 11}});
  ASSERT_THAT(store.status(), IsOk());
  std::map<std::string, int> outcomes;
  for (int round = 0; round < 4; ++round) {
    for (const Key& k : AllRecords()) {
      AlignedBuffer out(Expected(k).size());
      const absl::Status read = (*store)->ReadRecord(k.rank, k.layer, k.expert, out.span());
      if (read.ok()) {
        ++outcomes["ok"];
        EXPECT_TRUE(std::equal(Expected(k).begin(), Expected(k).end(), out.data));
      } else if (absl::StrContains(read.message(), "Input/output error (injected)")) {
        ++outcomes["io_error"];
      } else {
        EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss) << read;
        EXPECT_THAT(read.message(), HasSubstr("short read of expert"));
        ++outcomes["short_read"];
      }
    }
  }
  EXPECT_GT(outcomes["ok"], 0);
  EXPECT_GT(outcomes["io_error"], 0);
  EXPECT_GT(outcomes["short_read"], 0);

  // The completion names the reason the metrics count.
  auto always = RecordStore::Open({*dir_}, {.faults = {.eio = 1.0}});
  ASSERT_THAT(always.status(), IsOk());
  const Key k = AllRecords().front();
  AlignedBuffer out(Expected(k).size());
  ASSERT_THAT((*always)->Submit({.rank = k.rank, .layer = k.layer, .expert = k.expert, .destination = out.span(),
                                 .tag = 5}),
              IsOk());
  absl::StatusOr<RecordCompletion> done = (*always)->Wait();
  ASSERT_THAT(done.status(), IsOk());
  EXPECT_FALSE(done->status.ok());
  EXPECT_EQ(done->failure, "io_error");
  EXPECT_EQ(done->bytes, 0u);
}

TEST(ReadFaultsTest, ParsesProbabilitiesAndRefusesNonsense) {
  absl::StatusOr<ReadFaults> faults = ParseReadFaults("short=0.25,eio=0.5,seed=9");
  ASSERT_THAT(faults.status(), IsOk());
  EXPECT_EQ(faults->eio, 0.5);
  EXPECT_EQ(faults->short_read, 0.25);
  EXPECT_EQ(faults->seed, 9u);
  EXPECT_FALSE(ParseReadFaults("")->any());
  EXPECT_THAT(ParseReadFaults("eio=1.5").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eio=1.5")));
  EXPECT_THAT(ParseReadFaults("slow=0.1").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slow")));
  EXPECT_THAT(ParseReadFaults("seed=x").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("seed")));
  EXPECT_THAT(ParseReadFaults("eio").status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("eio")));
}

TEST_F(RecordStoreTest, ReadPiecesMustBeAlignedAndTheRingStaysBounded) {
  EXPECT_THAT(RecordStore::Open({*dir_}, {.read_piece_bytes = 1000}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiple of")));
  // 4096 records in flight of 3 pieces each would need 12288 ring entries: the pieces grow.
  auto store = RecordStore::Open({*dir_}, {.queue_depth = 4096, .read_piece_bytes = 4096});
  ASSERT_THAT(store.status(), IsOk());
  EXPECT_GT((*store)->piece_bytes(), 4096u);
}

TEST_F(RecordStoreTest, RegisteredBuffersReadFixed) {
  auto store = RecordStore::Open({*dir_}, {.queue_depth = 4, .buffers = 3});
  ASSERT_THAT(store.status(), IsOk());
  std::vector<Key> keys = AllRecords();
  for (size_t start = 0; start < keys.size(); start += 3) {
    for (size_t i = start; i < std::min(keys.size(), start + 3); ++i) {
      ASSERT_THAT((*store)->Submit({.rank = keys[i].rank,
                                    .layer = keys[i].layer,
                                    .expert = keys[i].expert,
                                    .buffer_index = static_cast<int>(i - start),
                                    .tag = i}),
                  IsOk());
    }
    while ((*store)->outstanding() > 0) {
      auto done = (*store)->Wait();
      ASSERT_THAT(done.status(), IsOk());
      ASSERT_THAT(done->status, IsOk());
      const auto& want = Expected(keys[done->tag]);
      std::span<std::byte> buffer = (*store)->Buffer(static_cast<unsigned>(done->tag - start));
      ASSERT_GE(buffer.size(), want.size());
      EXPECT_TRUE(std::equal(want.begin(), want.end(), buffer.data())) << done->tag;
    }
  }
}

TEST_F(RecordStoreTest, BufferedFallbackEqualsDirect) {
  auto buffered = RecordStore::Open({*dir_}, {.direct_io = DirectIo::kOff});
  ASSERT_THAT(buffered.status(), IsOk());
  EXPECT_EQ((*buffered)->direct_files(), 0u);
  EXPECT_EQ((*buffered)->buffered_files(), kTp * kLayers.size());
  ReadAllConcurrently(**buffered, 1);

  // On tmpfs (where kernels before 6.6 refuse O_DIRECT) kAuto falls back by itself; either
  // way the bytes are the same.
  const std::string shm = "/dev/shm";
  if (fs::is_directory(shm)) {
    std::string pattern = shm + "/nq_record_store_XXXXXX";
    ASSERT_NE(::mkdtemp(pattern.data()), nullptr);
    fs::copy(*dir_, pattern + "/release", fs::copy_options::recursive);
    {
      auto store = RecordStore::Open({pattern + "/release"});
      ASSERT_THAT(store.status(), IsOk());
      EXPECT_EQ((*store)->direct_files() > 0, DirectIoSupported(pattern));
      ReadAllConcurrently(**store, 1);
    }
    fs::remove_all(pattern);
  }
}

TEST_F(RecordStoreTest, MirrorsAreBothReadAndAgree) {
  const std::string mirror = MakeTempDir("nq_record_store_mirror") + "/release";
  fs::copy(*dir_, mirror, fs::copy_options::recursive);
  auto store = RecordStore::Open({*dir_, mirror}, {.queue_depth = 4});
  ASSERT_THAT(store.status(), IsOk());
  EXPECT_EQ((*store)->copies(), 2u);
  // Reads alternate between the copies. An even number of records would put each record on the
  // same copy in both passes; one read between them shifts the second pass by one, so every
  // record is read from both copies, and each read is checked against its checksum in the index
  // and compared with the record as written.
  ASSERT_EQ(AllRecords().size() % 2, 0u);
  ReadAllConcurrently(**store, 1);
  AlignedBuffer shift(Expected({0, 3, 0}).size());
  ASSERT_THAT((*store)->ReadRecord(0, 3, 0, shift.span()), IsOk());
  ReadAllConcurrently(**store, 1);
  std::vector<uint64_t> reads = (*store)->reads_per_copy();
  ASSERT_EQ(reads.size(), 2u);
  EXPECT_EQ(reads[0], AllRecords().size() + 1);
  EXPECT_EQ(reads[1], AllRecords().size());
}

TEST_F(RecordStoreTest, MirrorWithoutCompleteRefused) {
  const std::string mirror = MakeTempDir("nq_record_store_partial") + "/release";
  fs::copy(*dir_, mirror, fs::copy_options::recursive);
  fs::remove(mirror + "/COMPLETE");
  EXPECT_THAT(RecordStore::Open({*dir_, mirror}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("COMPLETE")));
}

// A store that does not check records hashes each layer file whole: one flipped byte fails the
// file's hash, and with it every read of the layer.
TEST_F(RecordStoreTest, FlippedByteIsDataLossAndNeverVerified) {
  const std::string bad = MakeTempDir("nq_record_store_bad") + "/release";
  fs::copy(*dir_, bad, fs::copy_options::recursive);
  {
    std::fstream f(bad + "/rank0/L3.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(5000);
    char c = 0;
    f.get(c);
    f.seekp(5000);
    f.put(static_cast<char>(c ^ 0x01));
  }
  auto store = RecordStore::Open({bad}, {.verify_records = false});
  ASSERT_THAT(store.status(), IsOk());  // sizes are right; the hash is checked on demand
  AlignedBuffer out(Expected({0, 3, 0}).size());
  EXPECT_THAT((*store)->ReadRecord(0, 3, 2, out.span()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank0/L3.bin")));
  EXPECT_FALSE((*store)->LayerVerified(0, 3));
  EXPECT_THAT((*store)->VerifyLayer(0, 3), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("sha256")));
  // Asynchronously too, and every expert of the layer (not only the damaged one).
  ASSERT_THAT((*store)->Submit({.rank = 0, .layer = 3, .expert = 5, .destination = out.span(),
                                .tag = 77}),
              IsOk());
  auto done = (*store)->Wait();
  ASSERT_THAT(done.status(), IsOk());
  EXPECT_EQ(done->tag, 77u);
  EXPECT_THAT(done->status, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("L3.bin")));
  EXPECT_EQ(done->failure, "hash");
  // Other layers are unaffected.
  EXPECT_THAT((*store)->ReadRecord(0, 4, 1, out.span()), IsOk());
  EXPECT_TRUE((*store)->LayerVerified(0, 4));
}

// With record checks (the default) the same damage costs only the damaged record: its read is
// DATA_LOSS, reason "checksum", with no bytes handed out, and the layer's other records still
// read intact. The file is never hashed by the reads; asked explicitly, it fails its hash.
TEST_F(RecordStoreTest, FlippedByteLosesOnlyItsRecordWhenRecordsAreChecked) {
  constexpr uint32_t kDamaged = 2;
  const std::string bad = MakeTempDir("nq_record_store_bad_record") + "/release";
  fs::copy(*dir_, bad, fs::copy_options::recursive);
  auto release = format::Release::Open(*dir_);
  ASSERT_THAT(release.status(), IsOk());
  const format::LayerEntry& entry = **release->Layer(0, 3);
  ASSERT_NO_FATAL_FAILURE(
      format::testing::FlipByte(bad + "/rank0/L3.bin", entry.records.offset + kDamaged * entry.layout.rec_bytes + 100));
  auto store = RecordStore::Open({bad}, {.queue_depth = 4});
  ASSERT_THAT(store.status(), IsOk());
  std::vector<std::unique_ptr<AlignedBuffer>> out;
  for (uint32_t e = 0; e < kExperts; ++e) {
    out.push_back(std::make_unique<AlignedBuffer>(Expected({0, 3, e}).size()));
    ASSERT_THAT((*store)->Submit({.rank = 0, .layer = 3, .expert = e, .destination = out.back()->span(), .tag = e}),
                IsOk());
  }
  std::map<uint64_t, RecordCompletion> done;
  while ((*store)->outstanding() > 0) {
    auto c = (*store)->Wait();
    ASSERT_THAT(c.status(), IsOk());
    done[c->tag] = *c;
  }
  ASSERT_EQ(done.size(), kExperts);
  for (uint32_t e = 0; e < kExperts; ++e) {
    if (e == kDamaged) {
      EXPECT_THAT(done[e].status, StatusIs(absl::StatusCode::kDataLoss,
                                           AllOf(HasSubstr("expert 2 of layer 3"), HasSubstr("rank0/L3.bin"))));
      EXPECT_EQ(done[e].failure, "checksum");
      EXPECT_EQ(done[e].bytes, 0u);
    } else {
      ASSERT_THAT(done[e].status, IsOk()) << "expert " << e;
      EXPECT_TRUE(std::equal(Expected({0, 3, e}).begin(), Expected({0, 3, e}).end(), out[e]->data)) << "expert " << e;
    }
  }
  AlignedBuffer one(Expected({0, 3, 0}).size());
  EXPECT_THAT((*store)->ReadRecord(0, 3, kDamaged, one.span()),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not match its")));
  EXPECT_THAT((*store)->ReadRecord(0, 3, kDamaged + 1, one.span()), IsOk());
  EXPECT_EQ((*store)->files().files_hashed(), 0u);
  EXPECT_THAT((*store)->VerifyLayer(0, 3), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("sha256")));
  EXPECT_FALSE((*store)->LayerVerified(0, 3));
}

TEST_F(RecordStoreTest, MissingCompleteRefused) {
  const std::string incomplete = MakeTempDir("nq_record_store_incomplete") + "/release";
  fs::copy(*dir_, incomplete, fs::copy_options::recursive);
  fs::remove(incomplete + "/COMPLETE");
  EXPECT_THAT(RecordStore::Open({incomplete}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("COMPLETE")));
}

TEST_F(RecordStoreTest, BadRequestsAreInvalidArgument) {
  auto store = RecordStore::Open({*dir_}, {.buffers = 1});
  ASSERT_THAT(store.status(), IsOk());
  AlignedBuffer out(Expected({0, 3, 0}).size());
  EXPECT_THAT((*store)->ReadRecord(0, 99, 0, out.span()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("layer 99")));
  EXPECT_THAT((*store)->ReadRecord(kTp, 3, 0, out.span()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank")));
  EXPECT_THAT((*store)->ReadRecord(0, 3, kExperts, out.span()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert")));
  EXPECT_THAT((*store)->ReadRecord(0, 3, 0, out.span().first(100)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("destination")));
  EXPECT_THAT((*store)->Submit({.rank = 0, .layer = 3, .expert = 0, .buffer_index = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("buffer index")));
  EXPECT_THAT(RecordStore::Open({*dir_}, {.queue_depth = 0}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("queue depth")));
  EXPECT_THAT(RecordStore::Open({}).status(), StatusIs(absl::StatusCode::kInvalidArgument, _));
  EXPECT_EQ((*store)->outstanding(), 0u);
  EXPECT_THAT((*store)->Wait().status(), StatusIs(absl::StatusCode::kFailedPrecondition, _));
}

// Issue #11: one RecordFiles per streamer process, a RecordStore per session over it. Two
// stores that hash whole files (no record checks) reading every record at once, from two
// threads, hash each layer file exactly once.
TEST_F(RecordStoreTest, StoresSharingRecordFilesHashEachFileOncePerProcess) {
  auto files = RecordFiles::Open({*dir_});
  ASSERT_THAT(files.status(), IsOk());
  EXPECT_EQ((*files)->files_hashed(), 0u);
  std::vector<std::unique_ptr<RecordStore>> stores;
  for (int i = 0; i < 2; ++i) {
    auto store = RecordStore::Create(*files, {.queue_depth = 4, .verify_records = false});
    ASSERT_THAT(store.status(), IsOk());
    stores.push_back(*std::move(store));
  }
  std::vector<std::thread> sessions;
  for (auto& store : stores) sessions.emplace_back([&store] { ReadAllConcurrently(*store, 2); });
  for (std::thread& t : sessions) t.join();
  EXPECT_EQ((*files)->files_hashed(), kTp * kLayers.size());
  EXPECT_TRUE(stores[0]->LayerVerified(1, 4));
  EXPECT_TRUE(stores[1]->LayerVerified(0, 3));
  // A third session later reads without hashing anything again.
  auto late = RecordStore::Create(*files, {.verify_records = false});
  ASSERT_THAT(late.status(), IsOk());
  ReadAllConcurrently(**late, 1);
  EXPECT_EQ((*files)->files_hashed(), kTp * kLayers.size());
  EXPECT_THAT(RecordStore::Create(nullptr).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no record files")));
  EXPECT_THAT(RecordStore::Create(*files, {.queue_depth = 0}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("queue depth")));
}

// Sessions that hash whole files (no record checks) share a file's failed hash as they share a
// good one: every session's reads of it fail, and it is hashed once.
TEST_F(RecordStoreTest, ASharedFileThatFailsItsHashFailsEverySessionAndIsHashedOnce) {
  const std::string bad = MakeTempDir("nq_record_store_shared_bad") + "/release";
  fs::copy(*dir_, bad, fs::copy_options::recursive);
  {
    std::fstream f(bad + "/rank1/L4.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(5000);
    char c = 0;
    f.get(c);
    f.seekp(5000);
    f.put(static_cast<char>(c ^ 0x01));
  }
  auto files = RecordFiles::Open({bad});
  ASSERT_THAT(files.status(), IsOk());
  for (int session = 0; session < 2; ++session) {
    auto store = RecordStore::Create(*files, {.verify_records = false});
    ASSERT_THAT(store.status(), IsOk());
    AlignedBuffer out(Expected({1, 4, 0}).size());
    EXPECT_THAT((*store)->ReadRecord(1, 4, 3, out.span()),
                StatusIs(absl::StatusCode::kDataLoss, HasSubstr("rank1/L4.bin")));
    EXPECT_THAT((*store)->ReadRecord(1, 3, 3, out.span()), IsOk());
  }
  EXPECT_EQ((*files)->files_hashed(), 2u);  // rank 1's L4 (bad) and L3, once each
  EXPECT_FALSE((*files)->LayerVerified(1, 4));
}

// The store's completion_fd turns readable when a read lands, so its owner can sleep in
// poll(2) instead of polling the ring; Poll clears it.
TEST_F(RecordStoreTest, CompletionFdIsReadableExactlyWhileAReadHasLanded) {
  auto store = RecordStore::Open({*dir_}, {.queue_depth = 2, .buffers = 1});
  ASSERT_THAT(store.status(), IsOk());
  const int fds[] = {(*store)->completion_fd()};
  auto idle = WaitReadable(fds, absl::ZeroDuration());
  ASSERT_THAT(idle.status(), IsOk());
  EXPECT_FALSE((*idle)[0]);
  ASSERT_THAT((*store)->Submit({.rank = 0, .layer = 3, .expert = 2, .buffer_index = 0, .tag = 9}), IsOk());
  auto landed = WaitReadable(fds, absl::Seconds(10));
  ASSERT_THAT(landed.status(), IsOk());
  ASSERT_TRUE((*landed)[0]) << "no completion signalled within 10 s";
  auto done = (*store)->Poll();
  ASSERT_THAT(done.status(), IsOk());
  ASSERT_EQ(done->size(), 1u);
  EXPECT_EQ((*done)[0].tag, 9u);
  EXPECT_THAT((*done)[0].status, IsOk());
  const auto& want = Expected({0, 3, 2});
  EXPECT_TRUE(std::equal(want.begin(), want.end(), (*store)->Buffer(0).data()));
  auto cleared = WaitReadable(fds, absl::ZeroDuration());
  ASSERT_THAT(cleared.status(), IsOk());
  EXPECT_FALSE((*cleared)[0]) << "Poll left the completion signal set";
}

// Issue #14: a read still queued in the store (behind the queue depth) that is cancelled never
// reaches the disk: its completion is CANCELLED, its destination untouched, and the store
// issues one read fewer.
TEST_F(RecordStoreTest, CancelledQueuedReadNeverReachesTheDisk) {
  auto store = RecordStore::Open({*dir_}, {.queue_depth = 1});
  ASSERT_THAT(store.status(), IsOk());
  const std::vector<Key> keys = {{0, 3, 0}, {0, 3, 1}, {0, 3, 2}};
  std::vector<std::unique_ptr<AlignedBuffer>> out;
  for (size_t i = 0; i < keys.size(); ++i) {
    out.push_back(std::make_unique<AlignedBuffer>(Expected(keys[i]).size()));
    std::memset(out.back()->data, 0xEE, out.back()->size);
    ASSERT_THAT((*store)->Submit({.rank = 0, .layer = 3, .expert = keys[i].expert, .destination = out.back()->span(),
                                  .tag = i}),
                IsOk());
  }
  EXPECT_EQ((*store)->reads_issued(), 1u);  // queue depth 1: reads 1 and 2 wait in the store
  auto outcome = (*store)->Cancel(2);
  ASSERT_THAT(outcome.status(), IsOk());
  EXPECT_EQ(*outcome, CancelOutcome::kDequeued);
  std::map<uint64_t, RecordCompletion> done;
  while ((*store)->outstanding() > 0) {
    auto c = (*store)->Wait();
    ASSERT_THAT(c.status(), IsOk());
    EXPECT_FALSE(done.contains(c->tag)) << "two completions for read " << c->tag;
    done[c->tag] = *c;
  }
  ASSERT_EQ(done.size(), 3u);
  EXPECT_THAT(done[0].status, IsOk());
  EXPECT_THAT(done[1].status, IsOk());
  EXPECT_FALSE(done[0].cancelled);
  EXPECT_THAT(done[2].status, StatusIs(absl::StatusCode::kCancelled, HasSubstr("before it was issued")));
  EXPECT_TRUE(done[2].cancelled);
  EXPECT_EQ(done[2].bytes, 0u);
  EXPECT_EQ((*store)->reads_issued(), 2u);
  EXPECT_TRUE(std::all_of(out[2]->data, out[2]->data + out[2]->size, [](std::byte b) { return b == std::byte{0xEE}; }))
      << "the cancelled read wrote its destination";
  EXPECT_TRUE(std::equal(Expected(keys[1]).begin(), Expected(keys[1]).end(), out[1]->data));
  EXPECT_THAT((*store)->Cancel(2).status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("tag 2")));
}

// A read in flight that is cancelled completes exactly once, marked cancelled: CANCELLED when
// the kernel stopped it, OK with the whole record when it could not (an O_DIRECT read the device
// already has). The kernel's answer to the cancel request is consumed and tallied, never
// returned as a read.
// Whole (one read) and in pieces (three 4 KiB reads, each asked to stop).
TEST_F(RecordStoreTest, CancelledReadInFlightCompletesOnceMarkedCancelled) {
  for (const uint32_t piece : {0u, 4096u}) {
  SCOPED_TRACE(piece);
  const uint64_t pieces = piece == 0 ? 1 : 3;
  auto store = RecordStore::Open({*dir_}, {.queue_depth = 4, .read_piece_bytes = piece, .buffers = 1});
  ASSERT_THAT(store.status(), IsOk());
  ASSERT_THAT((*store)->Submit({.rank = 0, .layer = 4, .expert = 3, .buffer_index = 0, .tag = 5}), IsOk());
  EXPECT_EQ((*store)->reads_issued(), 1u);
  auto outcome = (*store)->Cancel(5);
  ASSERT_THAT(outcome.status(), IsOk());
  EXPECT_EQ(*outcome, CancelOutcome::kInFlight);
  auto done = (*store)->Wait();
  ASSERT_THAT(done.status(), IsOk());
  EXPECT_EQ(done->tag, 5u);
  EXPECT_TRUE(done->cancelled);
  if (done->status.ok()) {
    const auto& want = Expected({0, 4, 3});
    EXPECT_EQ(done->bytes, want.size());
    EXPECT_TRUE(std::equal(want.begin(), want.end(), (*store)->Buffer(0).data()));
  } else {
    EXPECT_THAT(done->status, StatusIs(absl::StatusCode::kCancelled, HasSubstr("expert 3")));
  }
  EXPECT_EQ((*store)->outstanding(), 0u);
  EXPECT_THAT((*store)->Wait().status(), StatusIs(absl::StatusCode::kFailedPrecondition, _));
  // The cancel request's own completion: drained by Poll, one answer, and not an error.
  auto answered = [&] {
    const auto& r = (*store)->cancel_results();
    return r.stopped + r.running + r.not_found + r.failed;
  };
  for (int i = 0; i < 1000 && answered() < pieces; ++i) {
    auto polled = (*store)->Poll();
    ASSERT_THAT(polled.status(), IsOk());
    EXPECT_TRUE(polled->empty()) << "a cancel request's completion was returned as a read";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(answered(), pieces);
  EXPECT_EQ((*store)->cancel_results().failed, 0u);
  // Stopped by the kernel means the read itself completed -ECANCELED.
  if ((*store)->cancel_results().stopped > 0) {
    EXPECT_FALSE(done->status.ok());
  }
  EXPECT_THAT((*store)->Cancel(5).status(), StatusIs(absl::StatusCode::kNotFound, _));
  }
}

// Cancels `tag`, whose completion is already waiting: Cancel says so, and the completion, the
// only one Poll returns, comes marked cancelled into `done`.
void CancelCompleted(RecordStore& store, uint64_t tag, RecordCompletion& done) {
  absl::StatusOr<CancelOutcome> outcome = store.Cancel(tag);
  ASSERT_THAT(outcome.status(), IsOk());
  EXPECT_EQ(*outcome, CancelOutcome::kCompleted);
  absl::StatusOr<std::vector<RecordCompletion>> polled = store.Poll();
  ASSERT_THAT(polled.status(), IsOk());
  ASSERT_EQ(polled->size(), 1u);
  done = (*polled)[0];
  EXPECT_EQ(done.tag, tag);
  EXPECT_TRUE(done.cancelled);
}

// A read whose completion is already waiting cannot be stopped; Cancel says so and the
// completion still comes, marked, as it was: a read that landed (here reaped while a
// synchronous read behind it at queue depth 1 waited), or one that failed without reaching the
// disk (here a file that fails its hash, in a store that hashes files: it completes at Submit).
TEST_F(RecordStoreTest, CancelOfACompletedReadMarksItsCompletion) {
  {
    SCOPED_TRACE("landed");
    auto store = RecordStore::Open({*dir_}, {.queue_depth = 1, .buffers = 1});
    ASSERT_THAT(store.status(), IsOk());
    ASSERT_THAT((*store)->Submit({.rank = 0, .layer = 4, .expert = 0, .buffer_index = 0, .tag = 8}), IsOk());
    // Issued only once tag 8's read has landed and completed.
    AlignedBuffer behind(Expected({0, 4, 1}).size());
    ASSERT_THAT((*store)->ReadRecord(0, 4, 1, behind.span()), IsOk());
    RecordCompletion done;
    ASSERT_NO_FATAL_FAILURE(CancelCompleted(**store, 8, done));
    EXPECT_THAT(done.status, IsOk());
    const auto& want = Expected({0, 4, 0});
    EXPECT_TRUE(std::equal(want.begin(), want.end(), (*store)->Buffer(0).data()));
    EXPECT_EQ((*store)->reads_issued(), 2u);
  }
  {
    SCOPED_TRACE("failed its file hash");
    const std::string bad = MakeTempDir("nq_record_store_cancel_bad") + "/release";
    fs::copy(*dir_, bad, fs::copy_options::recursive);
    ASSERT_NO_FATAL_FAILURE(format::testing::FlipByte(bad + "/rank0/L4.bin", 100));
    auto store = RecordStore::Open({bad}, {.buffers = 1, .verify_records = false});
    ASSERT_THAT(store.status(), IsOk());
    ASSERT_THAT((*store)->Submit({.rank = 0, .layer = 4, .expert = 0, .buffer_index = 0, .tag = 8}), IsOk());
    RecordCompletion done;
    ASSERT_NO_FATAL_FAILURE(CancelCompleted(**store, 8, done));
    EXPECT_THAT(done.status, StatusIs(absl::StatusCode::kDataLoss, HasSubstr("L4.bin")));
    EXPECT_EQ((*store)->reads_issued(), 0u);
  }
}

// Issue #14: latency_seconds is issue to landing (submission to the ring to reaping), apart
// from the time a read waits in the store behind the queue depth (queued_seconds). At queue
// depth 1 each read is issued only after the one before it was reaped, so its wait covers the
// whole of the previous read's latency.
TEST_F(RecordStoreTest, LatencyIsIssueToLandingApartFromQueueing) {
  auto store = RecordStore::Open({*dir_}, {.queue_depth = 1, .buffers = 4});
  ASSERT_THAT(store.status(), IsOk());
  const auto first_submit = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < 4; ++i) {
    ASSERT_THAT((*store)->Submit({.rank = 1, .layer = 3, .expert = static_cast<uint32_t>(i),
                                  .buffer_index = static_cast<int>(i), .tag = i}),
                IsOk());
  }
  // Record i is submitted up to this long after record i - 1 (its queueing starts later).
  const double submit_span = std::chrono::duration<double>(std::chrono::steady_clock::now() - first_submit).count();
  std::vector<RecordCompletion> done;
  while ((*store)->outstanding() > 0) {
    auto c = (*store)->Wait();
    ASSERT_THAT(c.status(), IsOk());
    ASSERT_THAT(c->status, IsOk());
    done.push_back(*c);
  }
  ASSERT_EQ(done.size(), 4u);
  for (size_t i = 0; i < done.size(); ++i) {
    EXPECT_EQ(done[i].tag, i);  // one at a time, in order
    EXPECT_GT(done[i].latency_seconds, 0.0);
    if (i > 0) {
      // Queue depth 1: record i is issued only once record i - 1 has landed, so its submit time
      // plus its queueing reaches at least record i - 1's submit time plus queueing plus latency.
      EXPECT_GE(done[i].queued_seconds + submit_span, done[i - 1].queued_seconds + done[i - 1].latency_seconds) << i;
    }
  }
}

TEST(EventFdTest, SignalMakesItReadableAndClearResetsIt) {
  auto event = EventFd::Create();
  ASSERT_THAT(event.status(), IsOk());
  const int fds[] = {event->fd()};
  EXPECT_FALSE(WaitReadable(fds, absl::ZeroDuration()).value()[0]);
  ASSERT_THAT(event->Signal(), IsOk());
  ASSERT_THAT(event->Signal(), IsOk());
  EXPECT_TRUE(WaitReadable(fds, absl::ZeroDuration()).value()[0]);
  ASSERT_THAT(event->Clear(), IsOk());
  EXPECT_FALSE(WaitReadable(fds, absl::ZeroDuration()).value()[0]);
  ASSERT_THAT(event->Clear(), IsOk());  // nothing pending is not an error
  // A signal from another thread wakes a waiter.
  std::thread signaller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ASSERT_THAT(event->Signal(), IsOk());
  });
  auto woken = WaitReadable(fds, absl::Seconds(10));
  signaller.join();
  ASSERT_THAT(woken.status(), IsOk());
  EXPECT_TRUE((*woken)[0]);
  const int bad[] = {-1};
  auto none = WaitReadable(bad, absl::ZeroDuration());  // poll ignores negative fds
  ASSERT_THAT(none.status(), IsOk());
  EXPECT_FALSE((*none)[0]);
}

}  // namespace
}  // namespace nq::streamer
