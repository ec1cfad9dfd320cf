// record_read_bench: does the streamer sustain 0.9 of the disk's peak read bandwidth into slots?
//
//   record_read_bench [--release DIR | --dir DIR --megabytes N] [--queue_depth 8] [--buffers 32]
//                     [--arena shm|cuda_ipc] [--passes 3] [--min_megabytes 256]
//
// The release: --release names one (e.g. .run/embedded/release from scripts/embedded_model.sh),
// or a synthetic one of about --megabytes is written under --dir (1 rank, 32 experts x 1 MiB
// records per layer; reused on a rerun). Every record file of --rank is hashed once first
// (RecordStore::VerifyLayer; timed apart): the whole-file check the streamer made before a
// file's first read until its record checks made it redundant, and a store that does not check
// records still makes (the unchecked store below then finds it cached).
//
// Each pass, over the same files:
//   peak:  a raw O_DIRECT io_uring reader (raw_read_sweep.h) reading the record ranges front to
//          back at every queue depth {1,2,4,8,16,32} x block size {record, 256 KiB, 1 MiB};
//   store: every record once, in a random order, through the streamer's RecordStore as a slot
//          loader drives it (at most --queue_depth reads outstanding, read_fixed into --buffers
//          registered buffers; as reads land the ring is refilled first, then each record is
//          copied into a slot of an arena opened through the streamer's OpenArena: POSIX shm,
//          or a CUDA IPC device arena).
//   and, for comparison, the raw reader reading whole records in a random order at the store's
//   depth (the store's access pattern without the store).
// With --compare_record_checks (default) each pass reads the same records through four more stores
// over the same files: one that does not check each record against its checksum in the index (the
// streamer before issue #22's per-record checks), one that checks XXH3-128 on the loader thread,
// and two that check SHA-256 (nq-streamer --record_check=sha256, or a release written before XXH3
// checksums), on the loader thread and on --verify_threads threads. The main store checks XXH3 on
// --verify_threads threads, as nq-streamer does by default. --sweep=false skips the raw sweep (no
// peak) when only those figures are wanted.
// Small releases are read several rounds per measurement (at least --min_megabytes).
// Prints the sweep, the peak (the best raw figure of all passes), the store's figures and
// store / peak. O_DIRECT throughout, so the guest's page cache holds nothing; the file sizes are
// printed, since a host cache below a virtual disk can still hold files this small.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "bench/streamer/bench_arena.h"
#include "bench/streamer/raw_read_sweep.h"
#include "bench/streamer/synthetic_release.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/streamer/record_store.h"

ABSL_FLAG(std::string, release, "", "An existing release to read (default: write a synthetic one under --dir)");
ABSL_FLAG(std::string, dir, "build/cpu/record_read_bench", "Where the synthetic release is written");
ABSL_FLAG(uint64_t, megabytes, 256, "Size of the synthetic release's records");
ABSL_FLAG(uint32_t, rank, 0, "Whose record files to read");
ABSL_FLAG(uint32_t, queue_depth, 8, "The store's reads in flight (nq-streamer --read_queue_depth)");
ABSL_FLAG(uint32_t, read_piece_kib, 256, "The store's read pieces (nq-streamer --read_piece_kib; 0: whole records)");
ABSL_FLAG(uint32_t, buffers, 32,
          "The store's registered buffers, at least the queue depth (nq-streamer --bounce_buffers)");
ABSL_FLAG(std::string, arena, "shm", "Arena the store's records are copied into: shm or cuda_ipc");
ABSL_FLAG(int, passes, 3, "Passes of (raw sweep, store)");
ABSL_FLAG(bool, copy, true,
          "Copy each record into the arena (false: the store's reads alone, to see what the copy costs)");
ABSL_FLAG(uint64_t, min_megabytes, 256, "Least data per measurement; small releases are read several rounds");
ABSL_FLAG(bool, sweep, true, "Run the raw sweep for the peak each pass (false: only the store passes)");
ABSL_FLAG(bool, compare_record_checks, true,
          "Each pass also reads through four more stores: without per-record checks, XXH3 on the loader thread, "
          "SHA-256 on the loader thread and on --verify_threads threads; the main store checks XXH3 on "
          "--verify_threads threads, as nq-streamer does (issue #22)");
ABSL_FLAG(uint32_t, verify_threads, 2, "The main store's record-check threads (nq-streamer --verify_threads; 0 inline)");

namespace nq::streamer::bench {
namespace {

constexpr unsigned kDepths[] = {1, 2, 4, 8, 16, 32};
constexpr uint64_t kKiB = 1024;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Record {
  uint32_t layer, expert;
};

struct StoreResult {
  uint64_t bytes = 0;
  double seconds = 0;
  double copy_seconds = 0;
  std::vector<double> latencies;  // issue to landing, per read
  double gb_per_s() const { return bytes / seconds / 1e9; }
};

// Every record `rounds` times in a random order through `store`, as a slot loader drives it:
// at most `depth` reads outstanding, each into an idle registered buffer; when reads land the
// ring is refilled first (into other idle buffers), then each landed record is copied into slot
// (i mod slots) of `arena` and its buffer is idle again.
absl::StatusOr<StoreResult> StorePass(RecordStore& store, unsigned depth, unsigned buffers, ArenaWriter& arena,
                                      uint64_t slot_bytes, uint32_t slots, uint32_t rank, std::vector<Record> order,
                                      unsigned rounds, uint64_t seed, bool copy) {
  std::mt19937_64 rng(seed);
  std::vector<Record> reads;
  for (unsigned r = 0; r < rounds; ++r) {
    std::shuffle(order.begin(), order.end(), rng);
    reads.insert(reads.end(), order.begin(), order.end());
  }
  std::vector<unsigned> idle;
  for (unsigned b = buffers; b-- > 0;) idle.push_back(b);
  StoreResult result;
  size_t next = 0, landed_total = 0;
  unsigned outstanding = 0;
  // Tag = the buffer the read lands in.
  auto refill = [&]() -> absl::Status {
    while (outstanding < depth && !idle.empty() && next < reads.size()) {
      const Record& r = reads[next++];
      const unsigned b = idle.back();
      idle.pop_back();
      RETURN_IF_ERROR(store.Submit(
          {.rank = rank, .layer = r.layer, .expert = r.expert, .buffer_index = static_cast<int>(b), .tag = b}));
      ++outstanding;
    }
    return absl::OkStatus();
  };
  const auto start = std::chrono::steady_clock::now();
  RETURN_IF_ERROR(refill());
  while (outstanding > 0) {
    ASSIGN_OR_RETURN(RecordCompletion first, store.Wait());
    ASSIGN_OR_RETURN(std::vector<RecordCompletion> landed, store.Poll());
    landed.insert(landed.begin(), std::move(first));
    outstanding -= static_cast<unsigned>(landed.size());
    RETURN_IF_ERROR(refill());
    for (const RecordCompletion& done : landed) {
      RETURN_IF_ERROR(done.status);
      const auto copy_start = std::chrono::steady_clock::now();
      if (copy) {
        RETURN_IF_ERROR(arena.Write((landed_total % slots) * slot_bytes,
                                    store.Buffer(static_cast<unsigned>(done.tag)).first(done.bytes)));
      }
      ++landed_total;
      result.copy_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
      result.bytes += done.bytes;
      result.latencies.push_back(done.latency_seconds);
      idle.push_back(static_cast<unsigned>(done.tag));
    }
    RETURN_IF_ERROR(refill());
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

absl::Status Run() {
  std::string release_dir = absl::GetFlag(FLAGS_release);
  if (release_dir.empty()) {
    release_dir = absl::GetFlag(FLAGS_dir) + "/release";
    std::filesystem::create_directories(absl::GetFlag(FLAGS_dir));
    const auto t = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(WriteSyntheticRelease(release_dir, absl::GetFlag(FLAGS_megabytes)));
    std::printf("synthetic release written/reused in %.1f s\n",
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  }
  const uint32_t rank = absl::GetFlag(FLAGS_rank);
  const unsigned depth = absl::GetFlag(FLAGS_queue_depth);
  const unsigned buffers = std::max(depth, absl::GetFlag(FLAGS_buffers));
  ASSIGN_OR_RETURN(std::shared_ptr<RecordFiles> files, RecordFiles::Open({release_dir}));
  const format::Release& release = files->release();
  if (!files->all_have_record_xxh3()) {
    return absl::FailedPreconditionError(absl::StrCat(
        release_dir, " predates XXH3 record checksums, so every store would check SHA-256: delete it (a synthetic "
                     "one is rewritten) or pass a release written by this version"));
  }

  // The record ranges of every layer of `rank`, and every record.
  std::vector<FileRange> ranges;
  std::vector<Record> records;
  uint64_t rec_bytes = 0;
  for (const format::ManifestLayer& ml : release.manifest().layers) {
    absl::StatusOr<const format::LayerEntry*> entry = release.Layer(rank, ml.layer);
    if (!entry.ok()) continue;
    ASSIGN_OR_RETURN(std::string path, release.RecordPath(rank, ml.layer));
    ranges.push_back({.path = path, .offset = (*entry)->records.offset, .bytes = (*entry)->records.bytes});
    rec_bytes = std::max(rec_bytes, (*entry)->layout.rec_bytes);
    for (uint32_t e = 0; e < release.manifest().experts_per_layer; ++e) records.push_back({ml.layer, e});
  }
  if (ranges.empty()) return absl::NotFoundError(absl::StrCat(release_dir, " has no records of rank ", rank));
  ASSIGN_OR_RETURN(std::unique_ptr<RawFiles> raw, RawFiles::Open(ranges));
  const uint64_t total = raw->total_bytes();
  const uint64_t least = absl::GetFlag(FLAGS_min_megabytes) << 20;
  const unsigned rounds = static_cast<unsigned>(std::max<uint64_t>(1, (least + total - 1) / total));
  std::printf("release %s: %s\n", release_dir.c_str(), release.id().c_str());
  std::printf("rank %u: %zu record files, %zu records of %llu bytes, %.1f MiB in all (each file %.2f MiB); "
              "%u round(s) per measurement\n",
              rank, ranges.size(), records.size(), static_cast<unsigned long long>(rec_bytes), total / 1048576.0,
              total / 1048576.0 / ranges.size(), rounds);

  // The arena first: a CUDA IPC arena forks its worker before this process touches CUDA.
  const uint32_t slots = 64;
  ASSIGN_OR_RETURN(std::unique_ptr<BenchArena> arena,
                   BenchArena::Create(absl::GetFlag(FLAGS_arena), uint64_t{slots} * rec_bytes));
  std::shared_ptr<RecordVerifier> verifier;
  if (absl::GetFlag(FLAGS_verify_threads) > 0) {
    ASSIGN_OR_RETURN(verifier, RecordVerifier::Create(absl::GetFlag(FLAGS_verify_threads)));
  }
  const RecordStoreOptions store_options{.queue_depth = depth,
                                         .read_piece_bytes = absl::GetFlag(FLAGS_read_piece_kib) * 1024,
                                         .buffers = buffers,
                                         .verifier = verifier};
  ASSIGN_OR_RETURN(std::unique_ptr<RecordStore> store, RecordStore::Create(files, store_options));
  // For the record checks' cost: the same store without them, and with them on the owner thread.
  std::vector<std::pair<std::string, std::unique_ptr<RecordStore>>> others;
  if (absl::GetFlag(FLAGS_compare_record_checks)) {
    RecordStoreOptions unchecked = store_options, xxh3_inline = store_options, sha_inline = store_options,
                       sha_threads = store_options;
    unchecked.verify_records = false;
    unchecked.verifier = nullptr;
    xxh3_inline.verifier = nullptr;
    sha_inline.verifier = nullptr;
    sha_inline.record_check = RecordCheck::kSha256;
    sha_threads.record_check = RecordCheck::kSha256;
    const std::pair<const char*, const RecordStoreOptions*> variants[] = {
        {"no record checks", &unchecked},
        {"XXH3 checks on the loader thread", &xxh3_inline},
        {"SHA-256 checks on the loader thread", &sha_inline},
        {"SHA-256 checks on the verifier threads", &sha_threads}};
    for (const auto& [name, options] : variants) {
      ASSIGN_OR_RETURN(std::unique_ptr<RecordStore> other, RecordStore::Create(files, *options));
      others.emplace_back(name, std::move(other));
    }
  }
  if (store->buffered_files() > 0) {
    return absl::FailedPreconditionError("the store fell back to buffered reads: the figures would be the page cache");
  }
  for (unsigned b = 0; b < buffers; ++b) RETURN_IF_ERROR(arena->writer().PrepareSource(store->Buffer(b)));
  for (auto& [name, other] : others) {
    for (unsigned b = 0; b < buffers; ++b) RETURN_IF_ERROR(arena->writer().PrepareSource(other->Buffer(b)));
  }
  std::printf("arena: %s, %u slots of %llu bytes; store: queue depth %u, %u registered buffers, reads of %llu KiB\n",
              arena->writer().Describe().c_str(), slots, static_cast<unsigned long long>(rec_bytes), depth, buffers,
              static_cast<unsigned long long>(store->piece_bytes() / 1024));
  auto t = std::chrono::steady_clock::now();
  for (const format::ManifestLayer& ml : release.manifest().layers) {
    if (release.Layer(rank, ml.layer).ok()) RETURN_IF_ERROR(store->VerifyLayer(rank, ml.layer));
  }
  std::printf("verify (sha256 of every record file, once): %.2f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
  // Each check's rate on one core over records in memory: no disk in it, so it is the figure a
  // drive's read rate is compared with (the store passes below also carry this VM's disk noise).
  {
    std::vector<std::vector<std::byte>> held;
    for (size_t i = 0; i < records.size() && held.size() * rec_bytes < (64ull << 20); ++i) {
      ASSIGN_OR_RETURN(std::vector<std::byte> bytes, release.ReadRecord(rank, records[i].layer, records[i].expert));
      held.push_back(std::move(bytes));
    }
    using Hash = std::string (*)(std::span<const std::byte>);
    const std::pair<const char*, Hash> checks[] = {{"XXH3-128", &format::Xxh3Hex}, {"SHA-256", &format::Sha256Hex}};
    for (const auto& [name, hash] : checks) {
      const auto start = std::chrono::steady_clock::now();
      size_t bytes = 0, sink = 0;
      for (int round = 0; round < 3; ++round) {
        for (const std::vector<std::byte>& record : held) {
          sink += (*hash)(record).size();
          bytes += record.size();
        }
      }
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("record check %s on one core, records in memory: %.2f GB/s (%zu digits)\n", name,
                  bytes / seconds / 1e9, sink);
    }
  }
  std::printf("\n");

  std::vector<uint64_t> blocks = {rec_bytes, 256 * kKiB, 1024 * kKiB};
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  RawResult peak;
  std::vector<double> store_gbps, raw_random;
  StoreResult last;
  std::vector<double> latencies;
  std::vector<std::vector<double>> other_gbps(others.size());
  for (int pass = 1; pass <= absl::GetFlag(FLAGS_passes); ++pass) {
    std::printf("pass %d raw O_DIRECT GB/s:\n  %-10s", pass, "block\\qd");
    if (absl::GetFlag(FLAGS_sweep)) {
      for (unsigned qd : kDepths) std::printf("%8u", qd);
    }
    for (uint64_t block : absl::GetFlag(FLAGS_sweep) ? blocks : std::vector<uint64_t>{}) {
      std::printf("\n  %-10s", absl::StrCat(block / kKiB, " KiB").c_str());
      for (unsigned qd : kDepths) {
        ASSIGN_OR_RETURN(RawResult r, raw->Read(block, qd, rounds));
        if (r.gb_per_s() > peak.gb_per_s()) peak = r;
        std::printf("%8.3f", r.gb_per_s());
        std::fflush(stdout);
      }
    }
    // The raw reader in the store's access pattern (records in a random order at the store's
    // depth): what is left between it and the store is the store's own cost.
    ASSIGN_OR_RETURN(RawResult random, raw->Read(rec_bytes, depth, rounds, pass));
    std::printf("\n  raw, records in a random order at qd %u: %.3f GB/s", depth, random.gb_per_s());
    raw_random.push_back(random.gb_per_s());
    ASSIGN_OR_RETURN(last, StorePass(*store, depth, buffers, arena->writer(), rec_bytes, slots, rank, records,
                                      rounds, pass, absl::GetFlag(FLAGS_copy)));
    store_gbps.push_back(last.gb_per_s());
    latencies.insert(latencies.end(), last.latencies.begin(), last.latencies.end());
    std::printf("\n  store qd %u%s: %.3f GB/s (%.1f MiB in %.3f s, copies %.0f%% of it)\n\n", depth,
                absl::GetFlag(FLAGS_copy) ? " + copy into the arena" : ", no copy", last.gb_per_s(),
                last.bytes / 1048576.0, last.seconds, 100 * last.copy_seconds / last.seconds);
    for (size_t o = 0; o < others.size(); ++o) {
      ASSIGN_OR_RETURN(StoreResult r, StorePass(*others[o].second, depth, buffers, arena->writer(), rec_bytes, slots,
                                                rank, records, rounds, pass, absl::GetFlag(FLAGS_copy)));
      other_gbps[o].push_back(r.gb_per_s());
      std::printf("  store, %s: %.3f GB/s\n", others[o].first.c_str(), r.gb_per_s());
    }
    std::printf("\n");
  }
  for (size_t o = 0; o < others.size(); ++o) {
    for (unsigned b = 0; b < buffers; ++b) arena->writer().ReleaseSource(others[o].second->Buffer(b));
    std::printf("store, %s: median %.3f GB/s\n", others[o].first.c_str(), Median(other_gbps[o]));
  }
  std::printf("store, XXH3 checks on %u verifier threads (nq-streamer's default): median %.3f GB/s\n",
              absl::GetFlag(FLAGS_verify_threads), Median(store_gbps));
  for (unsigned b = 0; b < buffers; ++b) arena->writer().ReleaseSource(store->Buffer(b));
  std::sort(latencies.begin(), latencies.end());
  const double best_store = *std::max_element(store_gbps.begin(), store_gbps.end());
  std::printf("store into slots: median %.3f GB/s, best %.3f GB/s\n", Median(store_gbps), best_store);
  if (peak.gb_per_s() > 0) {
    std::printf("peak (best raw of all passes): %.3f GB/s at %llu KiB blocks, queue depth %u\n", peak.gb_per_s(),
                static_cast<unsigned long long>(peak.block_bytes / kKiB), peak.queue_depth);
    std::printf("store / peak: median %.3f, best %.3f (target >= 0.9)\n", Median(store_gbps) / peak.gb_per_s(),
                best_store / peak.gb_per_s());
  }
  std::printf("store / raw in the store's pattern (median of passes): %.3f (%.3f GB/s)\n",
              Median(store_gbps) / Median(raw_random), Median(raw_random));
  std::printf("store read latency, issue to landing: p50 %.3f ms, p99 %.3f ms (%zu reads)\n",
              latencies[latencies.size() / 2] * 1e3, latencies[latencies.size() * 99 / 100] * 1e3, latencies.size());
  return absl::OkStatus();
}

}  // namespace
}  // namespace nq::streamer::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = nq::streamer::bench::Run(); !s.ok()) {
    std::fprintf(stderr, "record_read_bench: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
