// GroupSessions (issue #18): the ranks of a group leaving at once, as when a node's streamer dies
// and both its ranks' links end together. Every leaving rank must wait for the group's loader to
// stop (its arena is unmapped right after), and the sessions the first one ends must be those
// still open: ending a session whose RPC has returned touches a dead context.
#include "services/streamer/group_sessions.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "services/common/metrics/registry.h"
#include "services/streamer/slot_loader.h"
#include "tests/common/status_matchers.h"
#include "tests/format/test_release.h"
#include "tests/streamer/memory_arena.h"

namespace nq::streamer {
namespace {
namespace fs = std::filesystem;
using ::nq::testing::IsOk;

constexpr uint32_t kLayer = 3;
constexpr char kGroup[] = "/nq-tp-sessions-test";

class GroupSessionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = format::testing::MakeTempDir();
    ASSERT_NO_FATAL_FAILURE(format::testing::WriteTestRelease(root_ + "/release"));
    auto files = RecordFiles::Open({root_ + "/release"});
    ASSERT_THAT(files.status(), IsOk());
    files_ = *files;
    metrics_ = std::make_unique<LoaderMetrics>(registry_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::remove_all(root_, ignored);
  }

  std::shared_ptr<RegisteredWorker> Rank(uint32_t rank) {
    auto worker = std::make_shared<RegisteredWorker>();
    worker->worker_id = absl::StrCat(kGroup, ":r", rank);
    worker->rank = rank;
    worker->world_size = format::testing::kTpSize;
    worker->tp_group = kGroup;
    worker->geometry =
        SlotGeometry::Packed({kLayer}, 2, *files_->RecordBytes(0, kLayer), format::testing::kExperts, 1);
    worker->arena = std::make_unique<MemoryArena>(worker->geometry.ArenaBytes());
    return worker;
  }

  std::string root_;
  std::shared_ptr<RecordFiles> files_;
  metrics::Registry registry_;
  std::unique_ptr<LoaderMetrics> metrics_;
};

TEST_F(GroupSessionsTest, RanksLeavingAtOnceWaitForTheLoaderAndNoReturnedSessionIsEnded) {
  for (int round = 0; round < 20; ++round) {
    GroupSessions groups([this](std::vector<std::shared_ptr<RegisteredWorker>> members,
                                const nq::v1::SessionHello& hello,
                                SlotLoader::Send send) -> absl::StatusOr<std::unique_ptr<SlotLoader>> {
      SlotLoaderOptions options;
      options.files = files_;
      options.store.queue_depth = 2;
      options.store.buffers = 2;
      absl::StatusOr<std::unique_ptr<SlotLoader>> loader =
          SlotLoader::CreateForGroup(std::move(members), options, metrics_.get(), std::move(send));
      if (!loader.ok()) return loader.status();
      if (absl::Status s = (*loader)->Start(hello); !s.ok()) return s;
      return loader;
    });
    std::atomic<bool> returned[2] = {false, false};
    std::atomic<int> ended_after_return{0};
    std::atomic<int> ended[2] = {0, 0};
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_THAT(groups.Join(
                      Rank(r), nq::v1::SessionHello(), [](const nq::v1::StreamerMessage&) { return true; },
                      [&, r] {
                        ++ended[r];
                        if (returned[r]) ++ended_after_return;
                      }),
                  IsOk());
    }
    ASSERT_TRUE(groups.Loading(kGroup));
    std::thread leave0([&] {
      groups.Leave(kGroup, 0, absl::StrCat(kGroup, ":r0"));
      returned[0] = true;
    });
    std::thread leave1([&] {
      groups.Leave(kGroup, 1, absl::StrCat(kGroup, ":r1"));
      returned[1] = true;
    });
    leave0.join();
    leave1.join();
    EXPECT_EQ(ended_after_return.load(), 0) << "round " << round << ": a session was ended after it returned";
    EXPECT_FALSE(groups.Loading(kGroup));
  }
}

}  // namespace
}  // namespace nq::streamer
