// Backend::ApplySlotMailbox on the CPU backend (kernels/slot_mailbox.h): a posted row reaches the
// slot table and is published once; rows not posted again cost nothing and keep their slot; the
// table is rewritten from the applied rows every time (a borrowed table is restored); bad
// arguments are refused.
#include <cstdint>
#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/slot_mailbox.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::DownloadI32;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::UploadI32;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kExperts = 6;

// The mailbox row in plain host memory, as the streamer would post to it.
struct HostRow {
  std::vector<std::int32_t> staged = std::vector<std::int32_t>(kExperts, -1);
  std::vector<std::uint32_t> seq = std::vector<std::uint32_t>(kExperts, 0);
  std::vector<std::uint64_t> published = std::vector<std::uint64_t>(kExperts, kMailboxEmptyEntry);
  SlotMailboxRow Row() { return {.staged = staged.data(), .seq = seq.data(), .published = published.data(), .experts = kExperts}; }
  void Post(int expert, std::int32_t slot) {
    staged[expert] = slot;
    ++seq[expert];
  }
};

Tensor EmptyApplied(Backend& backend) {
  const std::vector<std::uint64_t> empty(kExperts, kMailboxEmptyEntry);
  Tensor applied = AllocateOrFail(backend, DType::kI32, {kExperts, 2});
  EXPECT_TRUE(backend.CopyFromHost(std::as_bytes(std::span<const std::uint64_t>(empty)), applied).ok());
  return applied;
}

TEST(SlotMailboxApply, PostedRowsReachTheTableAndArePublishedOnce) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  HostRow row;
  Tensor applied = EmptyApplied(*cpu);
  Tensor table = UploadI32(*cpu, std::vector<std::int32_t>(kExperts, 7), {kExperts});

  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  EXPECT_THAT(DownloadI32(*cpu, table), ElementsAre(-1, -1, -1, -1, -1, -1));  // nothing posted: 2 bits

  row.Post(1, 3);
  row.Post(4, 0);
  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  EXPECT_THAT(DownloadI32(*cpu, table), ElementsAre(-1, 3, -1, -1, 0, -1));
  EXPECT_EQ(row.published[1], PackMailboxEntry(1, 3));
  EXPECT_EQ(row.published[4], PackMailboxEntry(1, 0));
  EXPECT_EQ(row.published[0], kMailboxEmptyEntry);

  // A published entry is written only when its row moved: overwrite one to see it left alone.
  row.published[1] = 0xdeadbeef;
  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  EXPECT_EQ(row.published[1], 0xdeadbeefu);
  EXPECT_THAT(DownloadI32(*cpu, table), ElementsAre(-1, 3, -1, -1, 0, -1));

  // An unmap, and a row posted twice before an apply: the newest row wins.
  row.Post(4, -1);
  row.Post(2, 5);
  row.Post(2, 1);
  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  EXPECT_THAT(DownloadI32(*cpu, table), ElementsAre(-1, 3, 1, -1, -1, -1));
  EXPECT_EQ(row.published[4], PackMailboxEntry(2, -1));
  EXPECT_EQ(row.published[2], PackMailboxEntry(2, 1));
}

TEST(SlotMailboxApply, RewritesATableSomeoneElseChanged) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  HostRow row;
  row.Post(0, 2);
  Tensor applied = EmptyApplied(*cpu);
  Tensor table = AllocateOrFail(*cpu, DType::kI32, {kExperts});
  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  // A layer-major prefill borrows the table for its own slots...
  const std::vector<std::int32_t> borrowed = {9, 9, 9, 9, 9, 9};
  ASSERT_TRUE(cpu->CopyFromHost(std::as_bytes(std::span<const std::int32_t>(borrowed)), table).ok());
  // ...and the next apply gives the mailbox's back, with nothing new posted.
  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  EXPECT_THAT(DownloadI32(*cpu, table), ElementsAre(2, -1, -1, -1, -1, -1));
}

TEST(SlotMailboxApply, SequenceNumbersWrap) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  HostRow row;
  row.seq[3] = 0xffffffffu;
  row.staged[3] = 4;
  Tensor applied = EmptyApplied(*cpu);
  Tensor table = AllocateOrFail(*cpu, DType::kI32, {kExperts});
  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  EXPECT_EQ(DownloadI32(*cpu, table)[3], 4);
  row.Post(3, 5);  // seq wraps to 0, which differs from the applied 0xffffffff
  ASSERT_TRUE(cpu->ApplySlotMailbox(row.Row(), applied, table).ok());
  EXPECT_EQ(DownloadI32(*cpu, table)[3], 5);
  EXPECT_TRUE(MailboxSeqReached(0, 0xffffffffu));
  EXPECT_FALSE(MailboxSeqReached(0xffffffffu, 0));
}

TEST(SlotMailboxApply, RefusesBadArguments) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  HostRow row;
  Tensor applied = EmptyApplied(*cpu);
  Tensor table = AllocateOrFail(*cpu, DType::kI32, {kExperts});
  SlotMailboxRow no_memory = row.Row();
  no_memory.seq = nullptr;
  EXPECT_THAT(cpu->ApplySlotMailbox(no_memory, applied, table),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("without memory")));
  Tensor short_table = AllocateOrFail(*cpu, DType::kI32, {kExperts - 1});
  EXPECT_THAT(cpu->ApplySlotMailbox(row.Row(), applied, short_table),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slot_of_expert")));
  Tensor float_applied = AllocateOrFail(*cpu, DType::kF32, {kExperts, 2});
  EXPECT_THAT(cpu->ApplySlotMailbox(row.Row(), float_applied, table),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("applied")));
}

}  // namespace
}  // namespace nq::kernels
