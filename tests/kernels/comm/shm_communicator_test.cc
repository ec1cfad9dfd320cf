// ShmCommunicator between real processes (fork): the collectives' results and bits, rounds
// larger than one data area, and every way a group fails: a peer that dies (mid-collective and
// while idle), one that never arrives, one posting another collective, and ranks refused for
// another world size, another identity, or a rank already held.
#include "kernels/comm/shm_communicator.h"

#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "tests/common/status_matchers.h"
#include "tests/kernels/comm/group_test_util.h"

namespace nq::kernels {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::_;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr size_t kRoundBytes = 256;  // 64 floats: the tests' 1000-element tensors take 16 rounds

std::string GroupName() {
  static int counter = 0;
  return absl::StrCat("/nq-tp-test-", getpid(), "-", counter++);
}

ShmCommunicatorOptions Options(const std::string& name, int rank, int world) {
  return ShmCommunicatorOptions{.name = name, .rank = rank, .world_size = world, .round_bytes = kRoundBytes,
                                .timeout = absl::Seconds(30), .identity = "model=nano release=r1"};
}

absl::Status AcceptAny(absl::string_view) { return absl::OkStatus(); }

// Attaches as `rank`, retrying while there is nothing to join yet.
absl::StatusOr<std::unique_ptr<ShmCommunicator>> AttachRetrying(const ShmCommunicatorOptions& options) {
  for (int i = 0; i < 2000; ++i) {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = ShmCommunicator::Attach(options, AcceptAny);
    if (comm.ok() || comm.status().code() != absl::StatusCode::kUnavailable) return comm;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return absl::DeadlineExceededError("never attached");
}

using ::nq::kernels::testing::F32;
using ::nq::kernels::testing::Fork;
using ::nq::kernels::testing::Pipe;
using ::nq::kernels::testing::Reap;
using ::nq::kernels::testing::RunCollectives;

TEST(ShmCommunicatorTest, CollectivesAcrossProcessesGiveRankOrderSums) {
  for (int world : {2, 3}) {
    const std::string name = GroupName();
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> leader = ShmCommunicator::Create(Options(name, 0, world), 1);
    ASSERT_THAT(leader, IsOk());
    std::vector<pid_t> children;
    for (int r = 1; r < world; ++r) {
      children.push_back(Fork([&, r] {
        absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, r, world));
        if (!comm.ok()) return 2;
        return RunCollectives(**comm);
      }));
    }
    ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
    EXPECT_EQ(RunCollectives(**leader), 0) << "world " << world;
    for (pid_t child : children) EXPECT_EQ(Reap(child), 0) << "world " << world;
  }
}

TEST(ShmCommunicatorTest, PeerThatDiesMidCollectiveFailsTheOthersPromptly) {
  const std::string name = GroupName();
  ShmCommunicatorOptions options = Options(name, 0, 2);
  options.timeout = absl::Seconds(60);  // the death, not the timeout, must end the wait
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> leader = ShmCommunicator::Create(options, 1);
  ASSERT_THAT(leader, IsOk());
  Pipe formed;
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 1, 2));
    if (!comm.ok() || !formed.Wait()) return 2;
    raise(SIGKILL);  // dies holding its alive lock, never arriving
    return 3;
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  formed.Signal();
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
  ASSERT_THAT(backend, IsOk());
  Tensor t = F32(**backend, 16);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT((*leader)->AllReduceSum(t),
              StatusIs(absl::StatusCode::kUnavailable, AllOf(HasSubstr("rank 1"), HasSubstr("died"))));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_EQ(Reap(child), 128 + SIGKILL);
  // The group stays broken: later collectives fail at once with the same reason.
  EXPECT_THAT((*leader)->AllReduceSum(t), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("died")));
}

TEST(ShmCommunicatorTest, FollowerIdlingForACommandLearnsTheLeaderDied) {
  const std::string name = GroupName();
  Pipe idling;
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = ShmCommunicator::Create(Options(name, 0, 2), 1);
    if (!comm.ok() || !(*comm)->WaitForPeers(absl::Seconds(60)).ok() || !idling.Wait()) return 2;
    raise(SIGKILL);
    return 3;
  });
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> follower = AttachRetrying(Options(name, 1, 2));
  ASSERT_THAT(follower, IsOk());
  std::vector<std::byte> command(64);
  idling.Signal();  // the follower may or may not be asleep in the wait yet: either way it must learn
  EXPECT_THAT((*follower)->BroadcastBytes(command, 0, absl::InfiniteDuration()),
              StatusIs(absl::StatusCode::kUnavailable, AllOf(HasSubstr("rank 0"), HasSubstr("died"))));
  EXPECT_EQ(Reap(child), 128 + SIGKILL);
  // The dead leader's segment is no group to join.
  EXPECT_THAT(ShmCommunicator::Attach(Options(name, 1, 2), AcceptAny), StatusIs(absl::StatusCode::kUnavailable, _));
  ASSERT_EQ(shm_unlink(name.c_str()), 0);
}

TEST(ShmCommunicatorTest, PeerThatNeverArrivesTimesOutNamingIt) {
  const std::string name = GroupName();
  ShmCommunicatorOptions options = Options(name, 0, 2);
  options.timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> leader = ShmCommunicator::Create(options, 1);
  ASSERT_THAT(leader, IsOk());
  Pipe done;
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 1, 2));
    if (!comm.ok()) return 2;
    done.Wait();  // alive, but never calls the collective
    return 0;
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
  Tensor t = F32(**backend, 16);
  EXPECT_THAT((*leader)->AllReduceSum(t),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank(s) 1 did not arrive")));
  done.Signal();
  EXPECT_EQ(Reap(child), 0);
}

TEST(ShmCommunicatorTest, RanksPostingDifferentCollectivesBothFail) {
  const std::string name = GroupName();
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> leader = ShmCommunicator::Create(Options(name, 0, 2), 1);
  ASSERT_THAT(leader, IsOk());
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 1, 2));
    if (!comm.ok()) return 2;
    absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
    Tensor t = F32(**backend, 32);  // rank 0 reduces 16 elements
    const absl::Status s = (*comm)->AllReduceSum(t);
    return s.code() == absl::StatusCode::kFailedPrecondition ? 0 : 4;
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
  Tensor t = F32(**backend, 16);
  EXPECT_THAT((*leader)->AllReduceSum(t), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                   AllOf(HasSubstr("64 bytes"), HasSubstr("128 bytes"))));
  EXPECT_EQ(Reap(child), 0);
}

TEST(ShmCommunicatorTest, RefusesAnotherWorldSizeAnotherIdentityAndATakenRank) {
  const std::string name = GroupName();
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> leader = ShmCommunicator::Create(Options(name, 0, 2), 1);
  ASSERT_THAT(leader, IsOk());
  EXPECT_THAT(ShmCommunicator::Attach(Options(name, 3, 4), AcceptAny),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("world size mismatch"), HasSubstr("world size 2"), HasSubstr("world size 4"))));
  std::string seen;
  EXPECT_THAT(ShmCommunicator::Attach(Options(name, 1, 2),
                                      [&](absl::string_view identity) {
                                        seen = std::string(identity);
                                        return absl::FailedPreconditionError("release r2 differs from r1");
                                      }),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("release r2 differs")));
  EXPECT_EQ(seen, "model=nano release=r1");
  const std::vector<std::string> refusals = (*leader)->TakeRefusals();
  ASSERT_EQ(refusals.size(), 2u);
  EXPECT_THAT(refusals[0], HasSubstr("rank 1"));
  EXPECT_THAT(refusals[0], HasSubstr("release r2 differs"));
  EXPECT_THAT(refusals[1], AllOf(HasSubstr("rank 3"), HasSubstr("world size mismatch")));
  EXPECT_TRUE((*leader)->TakeRefusals().empty());

  // A rank held by a live process cannot be taken by another.
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 1, 2));
    if (!comm.ok()) return 2;
    pause();
    return 0;
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  // The group formed: a newcomer is told to wait for the next one...
  EXPECT_THAT(ShmCommunicator::Attach(Options(name, 1, 2), AcceptAny),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("already formed")));
  kill(child, SIGKILL);
  EXPECT_EQ(Reap(child), 128 + SIGKILL);
}

TEST(ShmCommunicatorTest, SecondProcessClaimingAJoinedRankIsRefused) {
  const std::string name = GroupName();
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> leader = ShmCommunicator::Create(Options(name, 0, 3), 1);
  ASSERT_THAT(leader, IsOk());
  Pipe joined;
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 1, 3));
    if (!comm.ok()) return 2;
    joined.Signal();
    pause();
    return 0;
  });
  ASSERT_TRUE(joined.Wait());  // the group is still forming: rank 2 is missing
  EXPECT_THAT(ShmCommunicator::Attach(Options(name, 1, 3), AcceptAny).status(), StatusIs(absl::StatusCode::kFailedPrecondition,
                               AllOf(HasSubstr("rank 1 is already held"), HasSubstr(absl::StrCat(child)))));
  EXPECT_THAT((*leader)->WaitForPeers(absl::Milliseconds(1)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank(s) 2 of 3")));
  kill(child, SIGKILL);
  EXPECT_EQ(Reap(child), 128 + SIGKILL);
  // A rank that died while the group formed frees its slot: its restart joins.
  const pid_t restarted = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 1, 3));
    if (!comm.ok()) return 2;
    return RunCollectives(**comm);
  });
  const pid_t rank2 = Fork([&] {
    absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 2, 3));
    if (!comm.ok()) return 2;
    return RunCollectives(**comm);
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  EXPECT_EQ(RunCollectives(**leader), 0);
  EXPECT_EQ(Reap(restarted), 0);
  EXPECT_EQ(Reap(rank2), 0);
}

TEST(ShmCommunicatorTest, LeaderReformsAfterARankDiesAndTheRestartJoins) {
  const std::string name = GroupName();
  Pipe formed;
  auto follower = [&](bool die) {
    return Fork([&, die] {
      absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = AttachRetrying(Options(name, 1, 2));
      if (!comm.ok()) return 2;
      if (!die) return RunCollectives(**comm);
      formed.Wait();
      raise(SIGKILL);
      return 3;
    });
  };
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> leader = ShmCommunicator::Create(Options(name, 0, 2), 1);
  ASSERT_THAT(leader, IsOk());
  const pid_t dying = follower(true);
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  formed.Signal();
  EXPECT_EQ(Reap(dying), 128 + SIGKILL);
  EXPECT_THAT((*leader)->PeersAlive(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 1")));
  leader->reset();  // breaks and unlinks generation 1
  leader = ShmCommunicator::Create(Options(name, 0, 2), 2);
  ASSERT_THAT(leader, IsOk());
  EXPECT_EQ((*leader)->generation(), 2u);
  const pid_t restarted = follower(false);
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  EXPECT_EQ(RunCollectives(**leader), 0);
  EXPECT_EQ(Reap(restarted), 0);
}

TEST(ShmCommunicatorTest, RejectsBadOptions) {
  EXPECT_THAT(ShmCommunicator::Create(Options("no-slash", 0, 2), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'/name'")));
  EXPECT_THAT(ShmCommunicator::Create(Options(GroupName(), 1, 2), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only rank 0")));
  EXPECT_THAT(ShmCommunicator::Attach(Options(GroupName(), 2, 2), AcceptAny),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2 of world size 2")));
  EXPECT_THAT(ShmCommunicator::Attach(Options(GroupName(), 1, 2), AcceptAny),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("no group")));
}

}  // namespace
}  // namespace nq::kernels
