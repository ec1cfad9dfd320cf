// SlotRuntime without a streamer: updates wait for the step boundary, unmaps are acknowledged
// with the step, and the bounded wait of a request's first tokens.
#include "services/worker/slot_runtime.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <thread>

#include <gtest/gtest.h>

namespace nq::worker {
namespace {

SlotGeometry Geometry() { return SlotGeometry::Packed({1, 2}, 3, 4096, 8, 1); }

nq::v1::SlotTableUpdate Update(uint64_t generation, uint32_t loads_in_flight,
                               std::vector<std::pair<nq::v1::SlotChange::Kind, uint32_t>> changes = {}) {
  nq::v1::SlotTableUpdate update;
  update.set_generation(generation);
  update.set_loads_in_flight(loads_in_flight);
  for (auto [kind, slot] : changes) {
    nq::v1::SlotChange* change = update.add_changes();
    change->set_kind(kind);
    change->set_layer(1);
    change->set_slot(slot);
    change->set_expert(slot + 3);
  }
  return update;
}

class SlotRuntimeTest : public ::testing::Test {
 protected:
  SlotRuntimeTest() : arena_(Geometry().ArenaBytes()), table_(Geometry()) {}
  std::unique_ptr<SlotRuntime> Make(SlotRuntimeOptions options = {}) {
    auto runtime = std::make_unique<SlotRuntime>(&table_, arena_, nullptr, options);
    runtime->SetAckSink([this](nq::v1::UnmapAck ack) { acks_.push_back(std::move(ack)); });
    return runtime;
  }
  std::vector<std::byte> arena_;
  SlotTable table_;
  std::vector<nq::v1::UnmapAck> acks_;
};

TEST_F(SlotRuntimeTest, UpdatesApplyAtOnceBetweenStepsAndAtTheEndOfARunningStep) {
  auto runtime = Make();
  runtime->Post(Update(1, 0, {{nq::v1::SlotChange::KIND_READY, 0}}));
  EXPECT_TRUE(table_.SlotOf(1, 3).has_value()) << "no step runs: applied now";
  runtime->BeginStep(0);
  runtime->Post(Update(2, 0, {{nq::v1::SlotChange::KIND_UNMAP, 0}}));
  EXPECT_TRUE(table_.SlotOf(1, 3).has_value()) << "a step runs: the table must not change under it";
  EXPECT_TRUE(acks_.empty());
  runtime->EndStep();
  EXPECT_FALSE(table_.SlotOf(1, 3).has_value());
  ASSERT_EQ(acks_.size(), 1u);
  EXPECT_EQ(acks_[0].generation(), 2u);
  EXPECT_EQ(acks_[0].step(), 1u);
  ASSERT_EQ(acks_[0].slots_size(), 1);
  EXPECT_EQ(acks_[0].slots(0).slot(), 0u);
  // A stale generation is ignored.
  runtime->Post(Update(2, 0, {{nq::v1::SlotChange::KIND_READY, 1}}));
  EXPECT_FALSE(table_.SlotOf(1, 4).has_value());
}

// --verify_slots watches every READY slot for writes until it is unmapped. One update can make a
// slot READY and unmap it again (the streamer's next load took it as its victim before the update
// went out); the slot is acknowledged with that update and the streamer may write it at once,
// which is no write into a mapped slot. A write into a slot still READY is one.
TEST_F(SlotRuntimeTest, VerifySlotsStopsWatchingASlotReadyAndUnmappedInOneUpdate) {
  auto runtime = Make({.verify_slots = true});
  const SlotGeometry g = Geometry();
  runtime->Post(Update(1, 0, {{nq::v1::SlotChange::KIND_READY, 1}, {nq::v1::SlotChange::KIND_UNMAP, 1}}));
  EXPECT_FALSE(table_.SlotOf(1, 4).has_value());
  ASSERT_EQ(acks_.size(), 1u);
  ASSERT_EQ(acks_[0].slots_size(), 1);
  std::fill_n(arena_.begin() + static_cast<std::ptrdiff_t>(g.SlotOffset(0, 1)), 64, std::byte{0x5a});  // the next record
  runtime->BeginStep(0);
  runtime->EndStep();
  EXPECT_EQ(runtime->integrity_failures(), 0u) << "an acknowledged slot was taken for a mapped one";

  runtime->Post(Update(2, 0, {{nq::v1::SlotChange::KIND_READY, 2}}));
  ASSERT_TRUE(table_.SlotOf(1, 5).has_value());
  std::fill_n(arena_.begin() + static_cast<std::ptrdiff_t>(g.SlotOffset(0, 2)), 64, std::byte{0x33});
  runtime->BeginStep(1);
  runtime->EndStep();
  EXPECT_EQ(runtime->integrity_failures(), 1u) << "a write into a READY slot must be caught";
}

TEST_F(SlotRuntimeTest, FirstTokensWaitForAnnouncedLoadsUntilTheyLand) {
  auto runtime = Make({.wait_tokens = 4, .wait_per_step = absl::Seconds(5)});
  runtime->Post(Update(1, 2));  // two loads announced
  std::thread streamer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    runtime->Post(Update(2, 1, {{nq::v1::SlotChange::KIND_READY, 0}}));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    runtime->Post(Update(3, 0, {{nq::v1::SlotChange::KIND_READY, 1}}));
  });
  const auto start = std::chrono::steady_clock::now();
  runtime->BeginStep(0);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(table_.SlotOf(1, 3).has_value() && table_.SlotOf(1, 4).has_value()) << "both loads landed first";
  EXPECT_GE(waited, 0.15);
  EXPECT_LT(waited, 4.0) << "the wait ends when the loads land, not at its bound";
  runtime->EndStep();
  streamer.join();
}

TEST_F(SlotRuntimeTest, TheWaitIsBoundedAndOnlyForTheFirstTokens) {
  auto runtime = Make({.wait_tokens = 2, .wait_per_step = absl::Milliseconds(80)});
  runtime->Post(Update(1, 5));  // loads announced that never land
  auto timed_step = [&](uint32_t token) {
    const auto start = std::chrono::steady_clock::now();
    runtime->BeginStep(token);
    runtime->EndStep();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const double first = timed_step(0);
  EXPECT_GE(first, 0.075);
  EXPECT_LT(first, 1.0);
  EXPECT_LT(timed_step(2), 0.05) << "past the first N tokens a step never waits";
}

}  // namespace
}  // namespace nq::worker
