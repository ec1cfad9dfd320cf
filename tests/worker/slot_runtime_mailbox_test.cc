// SlotRuntime in mailbox mode (services/common/slot_mailbox.h): the streamer posts to the mailbox,
// the model's forwards apply it (played here by the host apply the CPU backend runs), and the
// runtime's table follows what was published: after each step, or at once when an update rings
// the doorbell of an idle worker; unmaps are never acknowledged over the session; updates with
// changes are refused; a hello first publishes what was posted; --verify_slots still watches
// READY slots and lets go of a slot an in-step unmap freed.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "kernels/slot_mailbox.h"
#include "services/common/slot_mailbox.h"
#include "services/worker/slot_runtime.h"

namespace nq::worker {
namespace {

constexpr uint32_t kExperts = 8;
SlotGeometry Geometry() { return SlotGeometry::Packed({1, 2}, 3, 4096, kExperts, 1); }

std::string UniqueName() {
  static std::atomic<int> n{0};
  return absl::StrCat("/nq-test-mailbox-", getpid(), "-", n++);
}

nq::v1::SlotTableUpdate Doorbell(uint64_t generation, uint32_t loads_in_flight) {
  nq::v1::SlotTableUpdate update;
  update.set_generation(generation);
  update.set_loads_in_flight(loads_in_flight);
  return update;
}

class SlotRuntimeMailboxTest : public ::testing::Test {
 protected:
  SlotRuntimeMailboxTest()
      : arena_(Geometry().ArenaBytes()),
        table_(Geometry()),
        mailbox_(*SlotMailbox::Create(UniqueName(), 2, kExperts)),
        applied_(2, std::vector<uint64_t>(kExperts, kernels::kMailboxEmptyEntry)),
        device_tables_(2, std::vector<int32_t>(kExperts, -1)) {}

  std::unique_ptr<SlotRuntime> Make(bool verify_slots = false) {
    auto runtime = std::make_unique<SlotRuntime>(
        &table_, arena_, nullptr, SlotRuntimeOptions{.verify_slots = verify_slots, .mailbox = &mailbox_});
    runtime->SetAckSink([this](nq::v1::UnmapAck ack) { acks_.push_back(std::move(ack)); });
    return runtime;
  }
  // The streamer's post.
  void Post(size_t layer_index, uint32_t expert, int32_t slot) {
    ASSERT_TRUE(mailbox_.Post(layer_index, expert, slot).ok());
  }
  // What each MoE layer's first op does inside a forward (Backend::ApplySlotMailbox).
  void Forward() {
    for (size_t li = 0; li < 2; ++li) {
      kernels::ApplySlotMailboxRowHost(mailbox_.Row(li), applied_[li].data(), device_tables_[li].data());
    }
  }
  std::byte* Slot(size_t layer_index, uint32_t slot) {
    return arena_.data() + Geometry().SlotOffset(layer_index, slot);
  }

  std::vector<std::byte> arena_;
  SlotTable table_;
  SlotMailbox mailbox_;
  std::vector<std::vector<uint64_t>> applied_;
  std::vector<std::vector<int32_t>> device_tables_;
  std::vector<nq::v1::UnmapAck> acks_;
};

TEST_F(SlotRuntimeMailboxTest, TheTableFollowsWhatTheStepsForwardsApplied) {
  auto runtime = Make();
  runtime->BeginStep(0);
  Post(0, 3, 1);  // layer 1, expert 3 -> slot 1, posted while the step runs
  Forward();
  EXPECT_EQ(device_tables_[0][3], 1) << "the forward takes it at once";
  EXPECT_FALSE(table_.SlotOf(1, 3).has_value()) << "the host's books change only between steps";
  runtime->EndStep();
  EXPECT_EQ(table_.SlotOf(1, 3), 1u);
  EXPECT_EQ(runtime->ready_slots(), 0u) << "no decoder: counted as 2 bits";

  runtime->BeginStep(1);
  Post(0, 3, -1);
  Post(1, 6, 2);
  Forward();
  runtime->EndStep();
  EXPECT_FALSE(table_.SlotOf(1, 3).has_value());
  EXPECT_EQ(table_.SlotOf(2, 6), 2u);
  EXPECT_TRUE(acks_.empty()) << "the streamer reads unmaps in the mailbox";
}

TEST_F(SlotRuntimeMailboxTest, AStepThatAppliedNothingLeavesTheTable) {
  auto runtime = Make();
  Post(0, 2, 0);
  runtime->BeginStep(0);
  runtime->EndStep();  // no forward ran: nothing was published
  EXPECT_FALSE(table_.SlotOf(1, 2).has_value());
  EXPECT_EQ(mailbox_.Published(0, 2), kernels::kMailboxEmptyEntry);
}

TEST_F(SlotRuntimeMailboxTest, ADoorbellAppliesOnTheHostWhileIdle) {
  auto runtime = Make();
  Post(1, 5, 2);
  Post(0, 0, 1);
  runtime->Post(Doorbell(7, 3));
  EXPECT_EQ(table_.SlotOf(2, 5), 2u);
  EXPECT_EQ(table_.SlotOf(1, 0), 1u);
  EXPECT_EQ(mailbox_.Published(1, 5), kernels::PackMailboxEntry(1, 2)) << "published for the streamer";
  EXPECT_EQ(runtime->loads_in_flight(), 3u);
  // The next forward's apply catches its private copy up without publishing anything new.
  Forward();
  EXPECT_EQ(device_tables_[1][5], 2);
  EXPECT_EQ(mailbox_.Published(1, 5), kernels::PackMailboxEntry(1, 2));

  // While a step runs the doorbell waits: the host must not publish under a running forward.
  runtime->BeginStep(0);
  Post(1, 5, -1);
  runtime->Post(Doorbell(8, 0));
  EXPECT_EQ(mailbox_.Published(1, 5), kernels::PackMailboxEntry(1, 2));
  Forward();
  runtime->EndStep();
  EXPECT_FALSE(table_.SlotOf(2, 5).has_value());
}

TEST_F(SlotRuntimeMailboxTest, UpdatesCarryingChangesAreRefused) {
  auto runtime = Make();
  nq::v1::SlotTableUpdate update = Doorbell(1, 0);
  nq::v1::SlotChange* change = update.add_changes();
  change->set_kind(nq::v1::SlotChange::KIND_READY);
  change->set_layer(1);
  change->set_slot(0);
  change->set_expert(4);
  runtime->Post(update);
  EXPECT_FALSE(table_.SlotOf(1, 4).has_value());
  EXPECT_EQ(mailbox_.PostedSeq(0, 4), 0u);
}

TEST_F(SlotRuntimeMailboxTest, AHelloPublishesWhatThePreviousSessionPosted) {
  auto runtime = Make();
  Post(0, 7, 2);  // posted by a streamer that died before any step or doorbell
  const auto [ready, generation] = runtime->SnapshotForHello();
  ASSERT_EQ(ready.size(), 1u);
  EXPECT_EQ(ready[0].layer(), 1u);
  EXPECT_EQ(ready[0].slot(), 2u);
  EXPECT_EQ(ready[0].expert(), 7u);
  EXPECT_EQ(mailbox_.Published(0, 7), kernels::PackMailboxEntry(1, 2));
  EXPECT_GE(generation, 1u);
}

TEST_F(SlotRuntimeMailboxTest, ExpertsMovingBetweenSlotsInOneStep) {
  auto runtime = Make();
  Post(0, 1, 0);
  Post(0, 2, 1);
  runtime->Post(Doorbell(1, 0));
  // Swap them (the streamer would need acks in between; the books must still follow).
  runtime->BeginStep(0);
  Post(0, 1, -1);
  Post(0, 2, -1);
  Forward();
  Post(0, 1, 1);
  Post(0, 2, 0);
  Forward();
  runtime->EndStep();
  EXPECT_EQ(table_.SlotOf(1, 1), 1u);
  EXPECT_EQ(table_.SlotOf(1, 2), 0u);
}

TEST_F(SlotRuntimeMailboxTest, PostsOutsideTheMailboxAreRefused) {
  EXPECT_EQ(mailbox_.Post(2, 0, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(mailbox_.Post(0, kExperts, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(mailbox_.PostedSeq(1, 0), 0u);
}

TEST_F(SlotRuntimeMailboxTest, InconsistentRowsAreCountedNotBelieved) {
  auto runtime = Make();
  Post(0, 1, 0);
  Post(0, 2, 0);  // a streamer bug: two experts on one slot
  runtime->Post(Doorbell(1, 0));
  EXPECT_EQ(runtime->integrity_failures(), 1u);
  EXPECT_FALSE(table_.SlotOf(1, 1).has_value() && table_.SlotOf(1, 2).has_value());
}

TEST_F(SlotRuntimeMailboxTest, VerifySlotsWatchesReadySlotsAndLetsGoOfUnmappedOnes) {
  auto runtime = Make(/*verify_slots=*/true);
  Post(0, 4, 1);
  runtime->Post(Doorbell(1, 0));
  ASSERT_EQ(table_.SlotOf(1, 4), 1u);
  // Unmapped inside a step and, seeing it published, the streamer rewrites the slot at once.
  runtime->BeginStep(0);
  Post(0, 4, -1);
  Forward();
  std::fill_n(Slot(0, 1), 64, std::byte{0x5a});
  runtime->EndStep();
  EXPECT_EQ(runtime->integrity_failures(), 0u) << "a slot freed in the step was taken for a mapped one";

  Post(0, 5, 2);
  runtime->Post(Doorbell(2, 0));
  ASSERT_EQ(table_.SlotOf(1, 5), 2u);
  std::fill_n(Slot(0, 2), 64, std::byte{0x33});
  runtime->BeginStep(1);
  runtime->EndStep();
  EXPECT_EQ(runtime->integrity_failures(), 1u) << "a write into a READY slot must be caught";
}

}  // namespace
}  // namespace nq::worker
