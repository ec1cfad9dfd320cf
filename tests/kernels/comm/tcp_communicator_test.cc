// TcpCommunicator between real processes (fork): the collectives' results and bits (parts smaller
// than the tensors), and every way a group fails: a peer that dies (mid-collective and while
// idle), one that never arrives, one posting another collective, a rank breaking the group with
// its reason, ranks refused for another world size, another identity or a rank already held, and
// rank 0 forming a new group on the same port after one broke.
#include "kernels/comm/tcp_communicator.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "tests/common/status_matchers.h"
#include "tests/kernels/comm/group_test_util.h"
#include "tests/common/wait_until.h"

namespace nq::kernels {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::_;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr size_t kPartBytes = 256;  // 64 floats: the tests' 1000-element tensors go in 16 parts

TcpCommunicatorOptions Options(const std::string& address, int rank, int world) {
  return TcpCommunicatorOptions{.address = address, .rank = rank, .world_size = world, .part_bytes = kPartBytes,
                                .timeout = absl::Seconds(30), .identity = "model=nano release=r1"};
}

absl::StatusOr<std::unique_ptr<TcpCommunicator>> Leader(int world, uint64_t generation = 1,
                                                       const std::string& address = "127.0.0.1:0") {
  return TcpCommunicator::Create(Options(address, 0, world), generation);
}

std::string AddressOf(const TcpCommunicator& leader) { return absl::StrCat("127.0.0.1:", leader.port()); }

absl::Status AcceptAny(absl::string_view) { return absl::OkStatus(); }

// Attaches as `rank`, retrying while there is nothing to join yet.
absl::StatusOr<std::unique_ptr<TcpCommunicator>> AttachRetrying(const TcpCommunicatorOptions& options) {
  for (int i = 0; i < 2000; ++i) {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = TcpCommunicator::Attach(options, AcceptAny);
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

TEST(TcpCommunicatorTest, CollectivesAcrossProcessesGiveRankOrderSums) {
  for (int world : {2, 3}) {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader = Leader(world);
    ASSERT_THAT(leader, IsOk());
    const std::string address = AddressOf(**leader);
    std::vector<pid_t> children;
    for (int r = 1; r < world; ++r) {
      children.push_back(Fork([&, r] {
        absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, r, world));
        if (!comm.ok()) return 2;
        if ((*comm)->generation() != 1) return 3;
        return RunCollectives(**comm);
      }));
    }
    ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
    EXPECT_EQ(RunCollectives(**leader), 0) << "world " << world;
    for (pid_t child : children) EXPECT_EQ(Reap(child), 0) << "world " << world;
  }
}

TEST(TcpCommunicatorTest, PeerThatDiesMidCollectiveFailsTheOthersPromptly) {
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader =
      TcpCommunicator::Create([] { auto o = Options("127.0.0.1:0", 0, 2); o.timeout = absl::Seconds(60); return o; }(), 1);
  ASSERT_THAT(leader, IsOk());
  const std::string address = AddressOf(**leader);
  Pipe formed;
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, 1, 2));
    if (!comm.ok() || !formed.Wait()) return 2;
    raise(SIGKILL);  // dies without arriving
    return 3;
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  formed.Signal();
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
  ASSERT_THAT(backend, IsOk());
  Tensor t = F32(**backend, 16);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT((*leader)->AllReduceSum(t),
              StatusIs(absl::StatusCode::kUnavailable, AllOf(HasSubstr("rank 1"), HasSubstr("left the group"))));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
  EXPECT_EQ(Reap(child), 128 + SIGKILL);
  // The group stays broken: later collectives fail at once with the same reason.
  EXPECT_THAT((*leader)->AllReduceSum(t), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 1")));
  EXPECT_THAT((*leader)->PeersAlive(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 1")));
}

TEST(TcpCommunicatorTest, FollowerIdlingForACommandLearnsTheLeaderDied) {
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  Pipe idling;
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = Leader(2);
    if (!comm.ok()) return 2;
    const int port = (*comm)->port();
    if (write(fds[1], &port, sizeof(port)) != sizeof(port)) return 4;
    if (!(*comm)->WaitForPeers(absl::Seconds(60)).ok() || !idling.Wait()) return 2;
    raise(SIGKILL);
    return 3;
  });
  int port = 0;
  ASSERT_EQ(read(fds[0], &port, sizeof(port)), static_cast<ssize_t>(sizeof(port)));
  close(fds[0]);
  close(fds[1]);
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> follower =
      AttachRetrying(Options(absl::StrCat("127.0.0.1:", port), 1, 2));
  ASSERT_THAT(follower, IsOk());
  std::vector<std::byte> command(64);
  idling.Signal();
  EXPECT_THAT((*follower)->BroadcastBytes(command, 0, absl::InfiniteDuration()),
              StatusIs(absl::StatusCode::kUnavailable, AllOf(HasSubstr("rank 0"), HasSubstr("left the group"))));
  EXPECT_EQ(Reap(child), 128 + SIGKILL);
  // Nobody listens there now.
  EXPECT_THAT(TcpCommunicator::Attach(Options(absl::StrCat("127.0.0.1:", port), 1, 2), AcceptAny),
              StatusIs(absl::StatusCode::kUnavailable, _));
}

TEST(TcpCommunicatorTest, PeerThatNeverArrivesTimesOutNamingIt) {
  auto options = Options("127.0.0.1:0", 0, 2);
  options.timeout = absl::Milliseconds(300);
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader = TcpCommunicator::Create(options, 1);
  ASSERT_THAT(leader, IsOk());
  const std::string address = AddressOf(**leader);
  Pipe done;
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, 1, 2));
    if (!comm.ok()) return 2;
    done.Wait();  // alive, but never calls the collective
    return 0;
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
  Tensor t = F32(**backend, 16);
  EXPECT_THAT((*leader)->AllReduceSum(t),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("rank 1 did not arrive")));
  done.Signal();
  EXPECT_EQ(Reap(child), 0);
}

TEST(TcpCommunicatorTest, RanksPostingDifferentCollectivesBothFail) {
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader = Leader(2);
  ASSERT_THAT(leader, IsOk());
  const std::string address = AddressOf(**leader);
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, 1, 2));
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

TEST(TcpCommunicatorTest, ARanksBreakReachesEveryRankWithItsReason) {
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader = Leader(3);
  ASSERT_THAT(leader, IsOk());
  const std::string address = AddressOf(**leader);
  Pipe formed;
  const pid_t breaker = Fork([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, 1, 3));
    if (!comm.ok() || !formed.Wait()) return 2;
    (*comm)->Break("rank 1: step 7 could not be applied");
    std::this_thread::sleep_for(std::chrono::seconds(2));  // still connected: the reason, not a hang-up
    return 0;
  });
  const pid_t other = Fork([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, 2, 3));
    if (!comm.ok()) return 2;
    std::vector<std::byte> command(16);
    const absl::Status s = (*comm)->BroadcastBytes(command, 0, absl::InfiniteDuration());
    return absl::StrContains(s.message(), "step 7 could not be applied") ? 0 : 5;
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  formed.Signal();
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu", {.cpu_threads = 1});
  Tensor t = F32(**backend, 16);
  EXPECT_THAT((*leader)->AllReduceSum(t), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("step 7")));
  EXPECT_EQ(Reap(other), 0);
  EXPECT_EQ(Reap(breaker), 0);
}

TEST(TcpCommunicatorTest, RefusesAnotherWorldSizeAnotherIdentityAndATakenRank) {
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader = Leader(3);
  ASSERT_THAT(leader, IsOk());
  const std::string address = AddressOf(**leader);
  // The leader admits ranks only while it waits for them: the joins run beside that wait.
  absl::Status wrong_world, wrong_identity, taken;
  std::string seen;
  std::unique_ptr<TcpCommunicator> rank1;
  std::thread joins([&] {
    wrong_world = AttachRetrying(Options(address, 3, 4)).status();
    wrong_identity = TcpCommunicator::Attach(Options(address, 1, 3), [&](absl::string_view identity) {
                       seen = std::string(identity);
                       return absl::FailedPreconditionError("release r2 differs from r1");
                     }).status();
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> first = AttachRetrying(Options(address, 1, 3));
    if (first.ok()) rank1 = *std::move(first);
    taken = AttachRetrying(Options(address, 1, 3)).status();
  });
  EXPECT_THAT((*leader)->WaitForPeers(absl::Seconds(3)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("ranks 2 to join")));
  joins.join();
  EXPECT_THAT(wrong_world, StatusIs(absl::StatusCode::kFailedPrecondition,
                                    AllOf(HasSubstr("world size mismatch"), HasSubstr("world size 3"),
                                          HasSubstr("started with world size 4"))));
  EXPECT_THAT(wrong_identity, StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("release r2 differs")));
  EXPECT_EQ(seen, "model=nano release=r1");
  ASSERT_NE(rank1, nullptr);
  EXPECT_THAT(taken, StatusIs(absl::StatusCode::kFailedPrecondition,
                              AllOf(HasSubstr("rank 1 is held by"), HasSubstr(absl::StrCat("pid ", getpid())))));
  const std::vector<std::string> refusals = (*leader)->TakeRefusals();
  ASSERT_EQ(refusals.size(), 3u);
  EXPECT_THAT(refusals[0], AllOf(HasSubstr("rank 3"), HasSubstr("world size mismatch")));
  EXPECT_THAT(refusals[1], AllOf(HasSubstr("rank 1"), HasSubstr("release r2 differs")));
  EXPECT_THAT(refusals[2], HasSubstr("rank 1 is held by"));
  EXPECT_TRUE((*leader)->TakeRefusals().empty());
  // Rank 1 that joined and left frees its place while the group forms.
  rank1.reset();
  std::unique_ptr<TcpCommunicator> again, rank2;
  std::thread rejoin([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> a = AttachRetrying(Options(address, 1, 3));
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> b = AttachRetrying(Options(address, 2, 3));
    if (a.ok()) again = *std::move(a);
    if (b.ok()) rank2 = *std::move(b);
  });
  EXPECT_THAT((*leader)->WaitForPeers(absl::Seconds(30)), IsOk());
  rejoin.join();
  ASSERT_NE(again, nullptr);
  ASSERT_NE(rank2, nullptr);
  // The group formed: a newcomer gets no answer and is told to retry.
  EXPECT_THAT(TcpCommunicator::Attach(Options(address, 2, 3), AcceptAny),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("formed already")));
}

TEST(TcpCommunicatorTest, LeaderFormsANewGroupOnTheSamePortAfterARankDied) {
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader = Leader(2);
  ASSERT_THAT(leader, IsOk());
  const std::string address = AddressOf(**leader);
  Pipe formed;
  auto follower = [&](bool die) {
    return Fork([&, die] {
      absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, 1, 2));
      if (!comm.ok()) return 2;
      if (!die) return (*comm)->generation() == 2 ? RunCollectives(**comm) : 3;
      formed.Wait();
      raise(SIGKILL);
      return 3;
    });
  };
  const pid_t dying = follower(true);
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  formed.Signal();
  EXPECT_EQ(Reap(dying), 128 + SIGKILL);
  EXPECT_TRUE(::nq::testing::WaitUntil([&] { return !(*leader)->PeersAlive().ok(); }));
  EXPECT_THAT((*leader)->PeersAlive(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 1")));
  leader->reset();
  leader = Leader(2, 2, address);
  ASSERT_THAT(leader, IsOk());
  const pid_t restarted = follower(false);
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  EXPECT_EQ(RunCollectives(**leader), 0);
  EXPECT_EQ(Reap(restarted), 0);
}

// Something on the port that is not a rank (another protocol, or a connection that says nothing)
// is dropped, and the group still forms with the real rank.
TEST(TcpCommunicatorTest, AConnectionThatIsNotARankIsDroppedAndTheGroupStillForms) {
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> leader = Leader(2);
  ASSERT_THAT(leader, IsOk());
  const int port = (*leader)->port();
  auto raw_connect = [port] {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    return fd;
  };
  const int junk = raw_connect();
  const char http[] = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  ASSERT_EQ(write(junk, http, sizeof(http) - 1), static_cast<ssize_t>(sizeof(http) - 1));
  const int silent = raw_connect();
  const std::string address = AddressOf(**leader);
  const pid_t child = Fork([&] {
    absl::StatusOr<std::unique_ptr<TcpCommunicator>> comm = AttachRetrying(Options(address, 1, 2));
    if (!comm.ok()) return 2;
    return RunCollectives(**comm);
  });
  ASSERT_THAT((*leader)->WaitForPeers(absl::Seconds(60)), IsOk());
  EXPECT_EQ(RunCollectives(**leader), 0);
  EXPECT_EQ(Reap(child), 0);
  // Neither was taken for a rank: rank 0 closed the junk one (unread bytes make that a reset).
  char byte;
  const ssize_t n = read(junk, &byte, 1);
  EXPECT_TRUE(n == 0 || (n < 0 && errno == ECONNRESET)) << n << " " << std::strerror(errno);
  close(junk);
  close(silent);
}

TEST(TcpCommunicatorTest, RejectsBadOptions) {
  EXPECT_THAT(TcpCommunicator::Create(Options("nohostport", 0, 2), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host:port")));
  EXPECT_THAT(TcpCommunicator::Create(Options("127.0.0.1:0", 1, 2), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 0")));
  EXPECT_THAT(TcpCommunicator::Attach(Options("127.0.0.1:1", 2, 2), AcceptAny),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2 of world size 2")));
  // A port nobody listens on: nothing to join yet.
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> held = Leader(2);
  ASSERT_THAT(held, IsOk());
  const std::string free_address = AddressOf(**held);
  held->reset();
  EXPECT_THAT(TcpCommunicator::Attach(Options(free_address, 1, 2), AcceptAny),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank 0 at")));
  // The port taken by another listener.
  absl::StatusOr<std::unique_ptr<TcpCommunicator>> first = Leader(2);
  ASSERT_THAT(first, IsOk());
  EXPECT_THAT(TcpCommunicator::Create(Options(AddressOf(**first), 0, 2), 1),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot listen")));
}

}  // namespace
}  // namespace nq::kernels
