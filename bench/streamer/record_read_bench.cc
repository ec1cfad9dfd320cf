// record_read_bench: how close the streamer's RecordStore comes to the disk.
//
//   record_read_bench [DIR] [MEGABYTES]   (defaults: build/streamer/record_read_bench, 256)
//
// Writes (or reuses) a synthetic release of about MEGABYTES under DIR/release (1 rank, 1 MiB
// records), hashes every layer once (RecordStore::VerifyLayer, timed apart), then alternates
// three passes of each:
//   raw:   every record file read front to back with pread(O_DIRECT) in 4 MiB chunks, one
//          read at a time (what `dd iflag=direct bs=4M` does);
//   store: every record once, in a random order, through RecordStore at queue depth 8 into
//          8 registered buffers (read_fixed), 8 reads always in flight.
// Prints each pass, the medians and the ratio store / raw. O_DIRECT bypasses the page cache,
// so both read the device (DIR must be on a filesystem that takes O_DIRECT; the store warns
// and falls back to buffered reads otherwise, which makes the ratio meaningless).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "services/format/release_writer.h"
#include "services/model/safetensors_writer.h"
#include "services/streamer/record_store.h"

namespace nq::streamer {
namespace {

constexpr uint32_t kExperts = 32;
constexpr uint64_t kRecordBytes = 1 << 20;
constexpr uint64_t kRawChunk = 4 << 20;
constexpr unsigned kQueueDepth = 8;
constexpr int kPasses = 3;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

absl::Status WriteRelease(const std::string& dir, uint32_t layers) {
  format::Manifest m;
  m.source_model = "bench/record-read";
  m.config_hash = std::string(64, 'b');
  m.tp_size = 1;
  m.experts_per_layer = kExperts;
  m.codec = "scalar-nested";
  for (uint32_t l = 0; l < layers; ++l) {
    format::ManifestLayer ml{.layer = l, .rotation = {128, l}, .fixed_4bit = {}, .ranking = {}};
    for (uint32_t e = 0; e < kExperts; ++e) ml.ranking.push_back(e);
    m.layers.push_back(ml);
  }
  auto writer = format::ReleaseWriter::Create(dir, m);
  if (!writer.ok()) return writer.status();
  std::vector<format::SegmentSpec> specs = {{"residual", kRecordBytes}};
  auto layout = format::RecordLayout::Build(specs);
  if (!layout.ok()) return layout.status();
  std::mt19937_64 rng(1);
  for (uint32_t l = 0; l < layers; ++l) {
    auto have = writer->HasLayer(0, l);
    if (!have.ok()) return have.status();
    if (*have) continue;
    std::vector<std::vector<std::byte>> records;
    for (uint32_t e = 0; e < kExperts; ++e) {
      std::vector<std::byte> seg(kRecordBytes);
      for (size_t i = 0; i + 8 <= seg.size(); i += 8) {
        uint64_t v = rng();
        std::memcpy(seg.data() + i, &v, 8);
      }
      std::vector<std::span<const std::byte>> views = {seg};
      auto packed = layout->Pack(views);
      if (!packed.ok()) return packed.status();
      records.push_back(*std::move(packed));
    }
    model::SafetensorsWriter resident;
    std::vector<float> values(16, float(l));
    if (auto s = resident.AddFloat32("experts.base_codes", {4, 4}, values); !s.ok()) return s;
    if (auto s = writer->WriteLayer(0, l, *layout, records, resident); !s.ok()) return s;
  }
  return writer->Finish();
}

// GB/s of one raw pass, or a negative value on error.
double RawPass(const std::vector<std::string>& paths, uint64_t* bytes_out) {
  void* chunk = std::aligned_alloc(kDirectIoAlign, kRawChunk);
  uint64_t bytes = 0;
  const double start = Now();
  for (const std::string& path : paths) {
    int fd = ::open(path.c_str(), O_RDONLY | O_DIRECT);
    if (fd < 0) {
      std::perror(path.c_str());
      std::free(chunk);
      return -1;
    }
    for (off_t off = 0;; off += kRawChunk) {
      ssize_t n = ::pread(fd, chunk, kRawChunk, off);
      if (n < 0) {
        std::perror(path.c_str());
        ::close(fd);
        std::free(chunk);
        return -1;
      }
      bytes += static_cast<uint64_t>(n);
      if (n < static_cast<ssize_t>(kRawChunk)) break;
    }
    ::close(fd);
  }
  const double seconds = Now() - start;
  std::free(chunk);
  *bytes_out = bytes;
  return bytes / seconds / 1e9;
}

struct Key {
  uint32_t layer, expert;
};

absl::StatusOr<double> StorePass(RecordStore& store, std::vector<Key> order, uint64_t seed,
                                 uint64_t* bytes_out, std::vector<double>* latencies) {
  std::mt19937_64 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  uint64_t bytes = 0;
  size_t next = 0;
  const double start = Now();
  // Tag = registered buffer index: the buffer is free again when its read completes.
  for (unsigned b = 0; b < kQueueDepth && next < order.size(); ++b, ++next) {
    absl::Status s = store.Submit({.rank = 0, .layer = order[next].layer,
                                   .expert = order[next].expert,
                                   .buffer_index = static_cast<int>(b), .tag = b});
    if (!s.ok()) return s;
  }
  while (store.outstanding() > 0) {
    auto done = store.Wait();
    if (!done.ok()) return done.status();
    if (!done->status.ok()) return done->status;
    bytes += done->bytes;
    latencies->push_back(done->latency_seconds);
    if (next < order.size()) {
      absl::Status s = store.Submit({.rank = 0, .layer = order[next].layer,
                                     .expert = order[next].expert,
                                     .buffer_index = static_cast<int>(done->tag),
                                     .tag = done->tag});
      if (!s.ok()) return s;
      ++next;
    }
  }
  *bytes_out = bytes;
  return bytes / (Now() - start) / 1e9;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Run(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "build/streamer/record_read_bench";
  const uint64_t megabytes = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 256;
  const uint32_t layers =
      std::max<uint32_t>(1, static_cast<uint32_t>(megabytes * (1 << 20) / (kRecordBytes * kExperts)));
  const std::string release_dir = dir + "/release";
  std::filesystem::create_directories(dir);

  double t = Now();
  if (absl::Status s = WriteRelease(release_dir, layers); !s.ok()) {
    std::fprintf(stderr, "writing the release: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf("release: %s, %u layers x %u experts x %llu bytes (written/reused in %.1f s)\n",
              release_dir.c_str(), layers, kExperts,
              static_cast<unsigned long long>(kRecordBytes), Now() - t);

  auto store = RecordStore::Open({release_dir},
                                 {.queue_depth = kQueueDepth, .buffers = kQueueDepth});
  if (!store.ok()) {
    std::fprintf(stderr, "opening the store: %s\n", store.status().ToString().c_str());
    return 1;
  }
  std::printf("store: %zu files O_DIRECT, %zu buffered\n", (*store)->direct_files(),
              (*store)->buffered_files());
  t = Now();
  std::vector<std::string> paths;
  std::vector<Key> keys;
  for (uint32_t l = 0; l < layers; ++l) {
    if (absl::Status s = (*store)->VerifyLayer(0, l); !s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return 1;
    }
    paths.push_back(*(*store)->release().RecordPath(0, l));
    for (uint32_t e = 0; e < kExperts; ++e) keys.push_back({l, e});
  }
  std::printf("verify (sha256 of every layer file, once): %.2f s\n", Now() - t);

  std::vector<double> raw, streamed, latencies;
  for (int pass = 0; pass < kPasses; ++pass) {
    uint64_t raw_bytes = 0, store_bytes = 0;
    const double r = RawPass(paths, &raw_bytes);
    if (r < 0) return 1;
    auto s = StorePass(**store, keys, pass + 1, &store_bytes, &latencies);
    if (!s.ok()) {
      std::fprintf(stderr, "store pass: %s\n", s.status().ToString().c_str());
      return 1;
    }
    raw.push_back(r);
    streamed.push_back(*s);
    std::printf("pass %d: raw O_DIRECT sequential %.3f GB/s (%llu B), store random qd%u %.3f GB/s "
                "(%llu B)\n",
                pass + 1, r, static_cast<unsigned long long>(raw_bytes), kQueueDepth, *s,
                static_cast<unsigned long long>(store_bytes));
  }
  std::sort(latencies.begin(), latencies.end());
  const double p50 = latencies[latencies.size() / 2];
  const double p99 = latencies[latencies.size() * 99 / 100];
  std::printf("median: raw %.3f GB/s, store %.3f GB/s, ratio store/raw %.3f\n", Median(raw),
              Median(streamed), Median(streamed) / Median(raw));
  std::printf("store read latency (submit to reap): p50 %.2f ms, p99 %.2f ms\n", p50 * 1e3,
              p99 * 1e3);
  return 0;
}

}  // namespace
}  // namespace nq::streamer

int main(int argc, char** argv) { return nq::streamer::Run(argc, argv); }
