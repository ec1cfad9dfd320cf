// Backend::ApplySlotMailbox on the GPU (kernels/cuda/slot_mailbox.cu) over host memory mapped into
// the device, as a worker's mailbox is: equal to the CPU oracle eagerly; a captured graph applies
// what was posted before each replay (no re-capture); and with a host thread posting while graphs
// replay, every applied row is whole (its slot at least as new as its sequence number), the
// table equals what was published, and nothing published goes backwards.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/ipc_arena.h"
#include "kernels/slot_mailbox.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::DownloadI32;

// A mailbox row of `experts` in page-aligned host memory mapped into device 0.
class MappedRow {
 public:
  explicit MappedRow(int experts) : experts_(experts) {
    bytes_ = (static_cast<std::size_t>(experts) * 16 + 4095) / 4096 * 4096;
    memory_ = static_cast<std::byte*>(std::aligned_alloc(4096, bytes_));
    staged_ = reinterpret_cast<std::int32_t*>(memory_);
    seq_ = reinterpret_cast<std::uint32_t*>(memory_ + 4 * experts);
    published_ = reinterpret_cast<std::uint64_t*>(memory_ + 8 * experts);
    for (int e = 0; e < experts; ++e) {
      staged_[e] = -1;
      seq_[e] = 0;
      published_[e] = kMailboxEmptyEntry;
    }
    absl::StatusOr<std::unique_ptr<cuda::MappedHostMemory>> mapped =
        cuda::MappedHostMemory::Map(0, std::span<std::byte>(memory_, bytes_));
    EXPECT_TRUE(mapped.ok()) << mapped.status();
    if (mapped.ok()) mapping_ = *std::move(mapped);
  }
  ~MappedRow() {
    mapping_.reset();
    std::free(memory_);
  }
  bool mapped() const { return mapping_ != nullptr; }
  SlotMailboxRow Host() const { return {staged_, seq_, published_, experts_}; }
  SlotMailboxRow Device() const {
    auto alias = [&](auto* p) {
      return reinterpret_cast<decltype(p)>(mapping_->device_alias() + (reinterpret_cast<std::byte*>(p) - memory_));
    };
    return {alias(staged_), alias(seq_), alias(published_), experts_};
  }
  // The streamer's post: the row, then the sequence number with release.
  void Post(int e, std::int32_t slot) {
    std::atomic_ref<std::int32_t>(staged_[e]).store(slot, std::memory_order_release);
    std::atomic_ref<std::uint32_t> seq(seq_[e]);
    seq.store(seq.load(std::memory_order_relaxed) + 1, std::memory_order_release);
  }
  std::uint64_t Published(int e) const {
    return std::atomic_ref<std::uint64_t>(published_[e]).load(std::memory_order_acquire);
  }

 private:
  int experts_;
  std::size_t bytes_ = 0;
  std::byte* memory_ = nullptr;
  std::int32_t* staged_;
  std::uint32_t* seq_;
  std::uint64_t* published_;
  std::unique_ptr<cuda::MappedHostMemory> mapping_;
};

Tensor EmptyApplied(Backend& backend, int experts) {
  const std::vector<std::uint64_t> empty(static_cast<std::size_t>(experts), kMailboxEmptyEntry);
  Tensor applied = AllocateOrFail(backend, DType::kI32, {experts, 2});
  EXPECT_TRUE(backend.CopyFromHost(std::as_bytes(std::span<const std::uint64_t>(empty)), applied).ok());
  return applied;
}

// A graph of one apply, as a captured decode step holds it.
absl::StatusOr<std::unique_ptr<Backend::Graph>> CaptureApply(Backend& cuda, const MappedRow& row, Tensor& applied,
                                                             Tensor& table) {
  if (absl::Status s = cuda.BeginCapture(); !s.ok()) return s;
  const absl::Status applied_ok = cuda.ApplySlotMailbox(row.Device(), applied, table);
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = cuda.EndCapture();
  if (!applied_ok.ok()) return applied_ok;
  return graph;
}

TEST(CudaSlotMailbox, EqualsTheHostApply) {
  Backend& cuda = *Backends().cuda;
  constexpr int kExperts = 300;  // two blocks
  MappedRow row(kExperts);
  ASSERT_TRUE(row.mapped());
  std::vector<std::uint64_t> oracle_applied(kExperts, kMailboxEmptyEntry);
  std::vector<std::int32_t> oracle_table(kExperts, 0);
  std::vector<std::uint64_t> oracle_published(kExperts, kMailboxEmptyEntry);
  Tensor applied = EmptyApplied(cuda, kExperts);
  Tensor table = AllocateOrFail(cuda, DType::kI32, {kExperts});
  for (int round = 0; round < 4; ++round) {
    for (int e = round; e < kExperts; e += 7) row.Post(e, (e + round) % 5 == 0 ? -1 : (e * 3 + round) % 17);
    // The oracle over a copy of the row: its published entries are its own.
    std::vector<std::int32_t> staged(row.Host().staged, row.Host().staged + kExperts);
    std::vector<std::uint32_t> seq(row.Host().seq, row.Host().seq + kExperts);
    ApplySlotMailboxRowHost({staged.data(), seq.data(), oracle_published.data(), kExperts}, oracle_applied.data(),
                            oracle_table.data());
    ASSERT_TRUE(cuda.ApplySlotMailbox(row.Device(), applied, table).ok());
    EXPECT_EQ(DownloadI32(cuda, table), oracle_table) << "round " << round;
    for (int e = 0; e < kExperts; ++e) ASSERT_EQ(row.Published(e), oracle_published[e]) << "expert " << e;
  }
}

TEST(CudaSlotMailbox, ACapturedStepAppliesWhatWasPostedBeforeEachReplay) {
  Backend& cuda = *Backends().cuda;
  constexpr int kExperts = 256;
  MappedRow row(kExperts);
  ASSERT_TRUE(row.mapped());
  Tensor applied = EmptyApplied(cuda, kExperts);
  Tensor table = AllocateOrFail(cuda, DType::kI32, {kExperts});
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = CaptureApply(cuda, row, applied, table);
  ASSERT_TRUE(graph.ok()) << graph.status();
  std::vector<std::int32_t> want(kExperts, -1);
  for (int replay = 0; replay < 5; ++replay) {
    const int e = 37 * replay % kExperts;
    const std::int32_t slot = replay % 2 == 0 ? replay + 1 : -1;
    row.Post(e, slot);
    want[e] = slot;
    ASSERT_TRUE((*graph)->Run().ok());
    ASSERT_TRUE(cuda.Synchronize().ok());
    EXPECT_EQ(DownloadI32(cuda, table), want) << "replay " << replay;
    EXPECT_EQ(MailboxEntrySlot(row.Published(e)), slot);
  }
}

TEST(CudaSlotMailbox, RowsPostedDuringReplaysApplyWhole) {
  Backend& cuda = *Backends().cuda;
  constexpr int kExperts = 256;
  constexpr int kReplays = 400;
  MappedRow row(kExperts);
  ASSERT_TRUE(row.mapped());
  Tensor applied = EmptyApplied(cuda, kExperts);
  Tensor table = AllocateOrFail(cuda, DType::kI32, {kExperts});
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = CaptureApply(cuda, row, applied, table);
  ASSERT_TRUE(graph.ok()) << graph.status();

  // The writer posts each expert's own sequence number as its slot, so an applied row is whole
  // exactly when its slot is at least its sequence number (a newer row than the seq read is fine:
  // its bytes were complete before it was written).
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    std::uint32_t n = 0;
    while (!stop.load(std::memory_order_relaxed)) {
      const int e = static_cast<int>(n++ % kExperts);
      row.Post(e, static_cast<std::int32_t>(std::atomic_ref<std::uint32_t>(const_cast<std::uint32_t&>(row.Host().seq[e]))
                                                .load(std::memory_order_relaxed) +
                                            1));
    }
  });
  std::vector<std::uint32_t> last_seq(kExperts, 0);
  int moved = 0;
  for (int replay = 0; replay < kReplays; ++replay) {
    ASSERT_TRUE((*graph)->Run().ok());
    ASSERT_TRUE(cuda.Synchronize().ok());
    const std::vector<std::int32_t> got = DownloadI32(cuda, table);
    for (int e = 0; e < kExperts; ++e) {
      const std::uint64_t p = row.Published(e);
      const std::uint32_t seq = MailboxEntrySeq(p);
      if (seq == 0) {  // the writer has not reached this expert yet: nothing applied
        ASSERT_EQ(p, kMailboxEmptyEntry);
        ASSERT_EQ(got[e], -1);
        continue;
      }
      ASSERT_GE(static_cast<std::int64_t>(MailboxEntrySlot(p)), static_cast<std::int64_t>(seq))
          << "replay " << replay << " expert " << e << ": a row older than its sequence number";
      ASSERT_EQ(got[e], MailboxEntrySlot(p)) << "replay " << replay << " expert " << e;
      ASSERT_TRUE(MailboxSeqReached(seq, last_seq[e])) << "expert " << e << " went backwards";
      moved += seq != last_seq[e] ? 1 : 0;
      last_seq[e] = seq;
    }
  }
  stop = true;
  writer.join();
  EXPECT_GT(moved, kExperts) << "the writer's posts should reach many replays";
}

}  // namespace
}  // namespace nq::kernels
