// How a tensor-parallel group forms its data plane (services/worker/tp_data_plane.h): rank 0's
// bootstrap (on CUDA, the NCCL unique id) travels over the group's shared-memory control channel
// to ranks in other processes intact; a rank that cannot use it (another NCCL build, transport,
// world size, a torn record) is refused by name and breaks the group so rank 0's join ends; a
// failed join on rank 0 ends the followers' joins; the watchdog aborts the data plane when a rank
// dies. The NCCL join itself is replaced by a recording fake: this runs without a GPU.
#include "services/worker/tp_data_plane.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "kernels/comm/shm_communicator.h"
#include "kernels/backend.h"
#include "services/worker/group_communicator.h"
#include "services/worker/tp_bootstrap.h"
#include "services/worker/tp_leader.h"
#include "tests/common/status_matchers.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr int32_t kNcclVersion = 22809;

kernels::NcclUniqueId PatternId(int salt) {
  kernels::NcclUniqueId id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<char>((i * 37 + static_cast<size_t>(salt)) & 0xff);
  return id;
}

TpBootstrap Sample() {
  return TpBootstrap{.transport = TpTransport::kNccl,
                     .world_size = 4,
                     .generation = 7,
                     .nccl_version = kNcclVersion,
                     .id = PatternId(3)};
}

TEST(TpBootstrapTest, RoundTripsEveryField) {
  const std::vector<std::byte> bytes = EncodeTpBootstrap(Sample());
  ASSERT_EQ(bytes.size(), kTpBootstrapBytes);
  absl::StatusOr<TpBootstrap> got = DecodeTpBootstrap(bytes);
  ASSERT_THAT(got.status(), IsOk());
  EXPECT_EQ(got->transport, TpTransport::kNccl);
  EXPECT_EQ(got->world_size, 4u);
  EXPECT_EQ(got->generation, 7u);
  EXPECT_EQ(got->nccl_version, kNcclVersion);
  EXPECT_EQ(got->id, PatternId(3));
}

TEST(TpBootstrapTest, RefusesRecordsThatAreNotOnesByName) {
  std::vector<std::byte> bytes = EncodeTpBootstrap(Sample());
  EXPECT_THAT(DecodeTpBootstrap(std::span<const std::byte>(bytes).first(bytes.size() - 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bytes, want")));
  std::vector<std::byte> torn = bytes;
  torn[40] ^= std::byte{1};  // inside the id
  EXPECT_THAT(DecodeTpBootstrap(torn), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("checksum mismatch")));
  std::vector<std::byte> foreign = bytes;
  foreign[0] ^= std::byte{1};
  EXPECT_THAT(DecodeTpBootstrap(foreign), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad magic")));
  std::vector<std::byte> other_build = bytes;
  other_build[8] = std::byte{9};  // the layout version
  EXPECT_THAT(DecodeTpBootstrap(other_build),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("another nq-worker build")));
}

TEST(TpBootstrapTest, ChecksNameTheFieldThatDiffers) {
  const TpBootstrap got = Sample();
  const TpBootstrapExpectation same{.transport = TpTransport::kNccl, .world_size = 4, .generation = 7,
                                    .nccl_version = kNcclVersion};
  EXPECT_THAT(CheckTpBootstrap(got, same), IsOk());
  TpBootstrapExpectation want = same;
  want.world_size = 2;
  EXPECT_THAT(CheckTpBootstrap(got, want),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("world_size mismatch: rank 0 sent 4, this rank was started with 2")));
  want = same;
  want.nccl_version = 22703;
  EXPECT_THAT(CheckTpBootstrap(got, want),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("nccl_version mismatch: rank 0 runs NCCL 22809, this rank 22703")));
  want = same;
  want.transport = TpTransport::kSharedMemory;
  EXPECT_THAT(CheckTpBootstrap(got, want),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("transport mismatch: rank 0 runs its collectives over nccl, this rank over "
                                 "shared-memory")));
  want = same;
  want.generation = 8;
  EXPECT_THAT(CheckTpBootstrap(got, want),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("generation mismatch")));
}

// ---- Across processes ----

std::string GroupName() {
  static int counter = 0;
  return absl::StrCat("/nq-tp-plane-test-", getpid(), "-", counter++);
}

kernels::ShmCommunicatorOptions Options(const std::string& name, int rank, int world) {
  return kernels::ShmCommunicatorOptions{.name = name, .rank = rank, .world_size = world,
                                         .timeout = absl::Seconds(20), .identity = "model=nano"};
}

// The data plane a fake join makes: collectives do nothing, Abort records why.
class FakePlane final : public TpDataPlane {
 public:
  explicit FakePlane(TpBootstrap bootstrap) : bootstrap_(bootstrap) {}
  int rank() const override { return 0; }
  int world_size() const override { return static_cast<int>(bootstrap_.world_size); }
  absl::Status AllReduceSum(kernels::Tensor&) override { return Health(); }
  absl::Status AllGather(const kernels::Tensor&, kernels::Tensor&) override { return Health(); }
  absl::Status Broadcast(kernels::Tensor&, int) override { return Health(); }
  absl::Status Health() override {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_.empty() ? absl::OkStatus() : absl::UnavailableError(aborted_);
  }
  void Abort(absl::string_view reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.empty()) aborted_ = std::string(reason);
  }
  const TpBootstrap& bootstrap() const { return bootstrap_; }

 private:
  TpBootstrap bootstrap_;
  std::mutex mu_;
  std::string aborted_;
};

// A join that, like NCCL's, waits for the others: here it only checks `peers_alive` for a while,
// so a group that breaks meanwhile ends it with the reason. `fail`: the join fails at once.
TpDataPlaneFactory FakeFactory(int32_t nccl_version, absl::Status fail = absl::OkStatus(),
                               absl::Duration linger = absl::Milliseconds(300)) {
  TpDataPlaneFactory f;
  f.transport = TpTransport::kNccl;
  f.nccl_version = nccl_version;
  f.new_id = [] { return PatternId(11); };
  f.join = [fail, linger](const TpBootstrap& bootstrap, int,
                          const std::function<absl::Status()>& peers_alive)
      -> absl::StatusOr<std::unique_ptr<TpDataPlane>> {
    if (!fail.ok()) return fail;
    const absl::Time end = absl::Now() + linger;
    while (absl::Now() < end) {
      if (absl::Status s = peers_alive(); !s.ok()) return s;
      absl::SleepFor(absl::Milliseconds(5));
    }
    return std::make_unique<FakePlane>(bootstrap);
  };
  return f;
}

// A child process writing one line back to the test; its exit code is the result.
struct Child {
  pid_t pid = -1;
  int fd = -1;
};

Child Spawn(const std::function<int(std::string& message)>& body) {
  int p[2];
  if (pipe(p) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    close(p[0]);
    std::string message;
    const int code = body(message);
    (void)!write(p[1], message.data(), message.size());
    close(p[1]);
    _exit(code);
  }
  close(p[1]);
  return Child{pid, p[0]};
}

// Exit code (or 128 + signal) and what the child wrote.
std::pair<int, std::string> Reap(Child child) {
  std::string out;
  char buf[512];
  for (ssize_t n; (n = read(child.fd, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  close(child.fd);
  int status = 0;
  if (waitpid(child.pid, &status, 0) != child.pid) return {-1, out};
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), out};
}

absl::StatusOr<std::unique_ptr<kernels::ShmCommunicator>> FormGroup(const std::string& name, int world) {
  auto comm = kernels::ShmCommunicator::Create(Options(name, 0, world), 1);
  if (!comm.ok()) return comm.status();
  if (absl::Status s = (*comm)->WaitForPeers(absl::Seconds(20)); !s.ok()) return s;
  return comm;
}

absl::StatusOr<std::unique_ptr<kernels::ShmCommunicator>> JoinGroup(const std::string& name, int rank, int world) {
  for (int i = 0; i < 4000; ++i) {
    auto comm = kernels::ShmCommunicator::Attach(Options(name, rank, world),
                                                 [](absl::string_view) { return absl::OkStatus(); });
    if (comm.ok() || comm.status().code() != absl::StatusCode::kUnavailable) return comm;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return absl::DeadlineExceededError("never attached");
}

// Rank 0 in a child: forms the group and its data plane with `factory`; writes the status.
Child SpawnLeader(const std::string& name, int world, TpDataPlaneFactory factory) {
  return Spawn([=](std::string& message) {
    auto comm = FormGroup(name, world);
    if (!comm.ok()) {
      message = comm.status().ToString();
      return 2;
    }
    absl::StatusOr<std::unique_ptr<TpDataPlane>> plane = LeadDataPlane(factory, **comm, absl::Seconds(20));
    message = plane.status().ToString();
    if (!plane.ok()) return 1;
    // Keep the group until every follower has its plane (they leave first).
    absl::SleepFor(absl::Seconds(3));
    return 0;
  });
}

// Rank r in a child: joins the group and its data plane; writes the id it joined with (hex) or
// the status.
Child SpawnFollower(const std::string& name, int rank, int world, TpDataPlaneFactory factory) {
  return Spawn([=](std::string& message) {
    auto comm = JoinGroup(name, rank, world);
    if (!comm.ok()) {
      message = comm.status().ToString();
      return 2;
    }
    absl::StatusOr<std::unique_ptr<TpDataPlane>> plane = FollowDataPlane(factory, **comm, absl::Seconds(20));
    if (!plane.ok()) {
      message = plane.status().ToString();
      return 1;
    }
    // Stay until the slowest rank's join has ended too: a rank leaving breaks the group.
    absl::SleepFor(absl::Seconds(2));
    const TpBootstrap& b = static_cast<FakePlane&>(**plane).bootstrap();
    message = absl::StrCat("generation=", b.generation, " world=", b.world_size, " id=");
    for (char c : b.id) absl::StrAppend(&message, absl::Hex(static_cast<uint8_t>(c), absl::kZeroPad2));
    return 0;
  });
}

std::string Hex(const kernels::NcclUniqueId& id) {
  std::string out;
  for (char c : id) absl::StrAppend(&out, absl::Hex(static_cast<uint8_t>(c), absl::kZeroPad2));
  return out;
}

TEST(TpDataPlaneTest, TheIdTravelsIntactToEveryRankOfFour) {
  const std::string name = GroupName();
  Child leader = SpawnLeader(name, 4, FakeFactory(kNcclVersion));
  std::vector<Child> followers;
  for (int r = 1; r < 4; ++r) followers.push_back(SpawnFollower(name, r, 4, FakeFactory(kNcclVersion)));
  for (Child& f : followers) {
    const auto [code, message] = Reap(f);
    EXPECT_EQ(code, 0) << message;
    EXPECT_EQ(message, absl::StrCat("generation=1 world=4 id=", Hex(PatternId(11))));
  }
  const auto [code, message] = Reap(leader);
  EXPECT_EQ(code, 0) << message;
}

TEST(TpDataPlaneTest, AFollowerOfAnotherNcclBuildIsRefusedByNameAndRankZeroLearnsWhy) {
  const std::string name = GroupName();
  Child leader = SpawnLeader(name, 2, FakeFactory(kNcclVersion, absl::OkStatus(), absl::Seconds(10)));
  Child follower = SpawnFollower(name, 1, 2, FakeFactory(22703));
  const auto [fcode, fmessage] = Reap(follower);
  EXPECT_EQ(fcode, 1);
  EXPECT_THAT(fmessage, AllOf(HasSubstr("FAILED_PRECONDITION"), HasSubstr("rank 1 refused rank 0's bootstrap"),
                              HasSubstr("nccl_version mismatch: rank 0 runs NCCL 22809, this rank 22703")));
  // Rank 0 was waiting in its join: the broken group ends it, with the follower's reason.
  const auto [lcode, lmessage] = Reap(leader);
  EXPECT_EQ(lcode, 1);
  EXPECT_THAT(lmessage, AllOf(HasSubstr("rank 0 could not join"), HasSubstr("nccl_version mismatch")));
}

TEST(TpDataPlaneTest, ABootstrapForAnotherWorldSizeIsRefusedByName) {
  const std::string name = GroupName();
  // Rank 0 of a two-rank group sending a bootstrap for four: what another build might do.
  Child leader = Spawn([&](std::string& message) {
    auto comm = FormGroup(name, 2);
    if (!comm.ok()) return 2;
    TpBootstrap b = Sample();
    b.generation = (*comm)->generation();
    message = SendTpBootstrap(**comm, b, absl::Seconds(20)).ToString();
    absl::SleepFor(absl::Milliseconds(300));
    return 0;
  });
  Child follower = SpawnFollower(name, 1, 2, FakeFactory(kNcclVersion));
  const auto [code, message] = Reap(follower);
  EXPECT_EQ(code, 1);
  EXPECT_THAT(message, HasSubstr("world_size mismatch: rank 0 sent 4, this rank was started with 2"));
  EXPECT_EQ(Reap(leader).first, 0);
}

TEST(TpDataPlaneTest, RankZerosFailedJoinEndsTheFollowersJoins) {
  const std::string name = GroupName();
  Child leader = SpawnLeader(name, 2, FakeFactory(kNcclVersion, absl::UnavailableError("cudaSetDevice(3): invalid device ordinal")));
  Child follower = SpawnFollower(name, 1, 2, FakeFactory(kNcclVersion, absl::OkStatus(), absl::Seconds(10)));
  const auto [lcode, lmessage] = Reap(leader);
  EXPECT_EQ(lcode, 1);
  EXPECT_THAT(lmessage, HasSubstr("rank 0 could not join the collectives' transport: cudaSetDevice(3)"));
  const auto [fcode, fmessage] = Reap(follower);
  EXPECT_EQ(fcode, 1);
  EXPECT_THAT(fmessage, AllOf(HasSubstr("UNAVAILABLE"), HasSubstr("cudaSetDevice(3)")));
}

TEST(TpDataPlaneTest, TheWatchdogAbortsThePlaneWhenARankDies) {
  const std::string name = GroupName();
  Child leader = Spawn([&](std::string& message) {
    auto comm = FormGroup(name, 2);
    if (!comm.ok()) return 2;
    absl::StatusOr<std::unique_ptr<TpDataPlane>> plane =
        LeadDataPlane(FakeFactory(kNcclVersion, absl::OkStatus(), absl::ZeroDuration()), **comm, absl::Seconds(20));
    if (!plane.ok()) return 3;
    TpWatchdog watchdog(comm->get(), plane->get(), absl::Milliseconds(10));
    const absl::Time end = absl::Now() + absl::Seconds(20);
    while ((*plane)->Health().ok() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(5));
    message = (*plane)->Health().ToString();
    return (*plane)->Health().ok() ? 1 : 0;
  });
  // Rank 1 joins, then dies without leaving (its alive lock turns owner-dead).
  Child follower = Spawn([&](std::string& message) {
    auto comm = JoinGroup(name, 1, 2);
    if (!comm.ok()) return 2;
    auto plane = FollowDataPlane(FakeFactory(kNcclVersion, absl::OkStatus(), absl::ZeroDuration()), **comm,
                                 absl::Seconds(20));
    message = plane.status().ToString();
    absl::SleepFor(absl::Milliseconds(200));
    _exit(plane.ok() ? 0 : 1);
  });
  const auto [fcode, fmessage] = Reap(follower);
  EXPECT_EQ(fcode, 0) << fmessage;
  const auto [code, message] = Reap(leader);
  EXPECT_EQ(code, 0) << message;
  EXPECT_THAT(message, AllOf(HasSubstr("UNAVAILABLE"), HasSubstr("rank 1 (pid"), HasSubstr("died")));
}

// Rank 1 of a group of 2 in a child process: joins `name` and its data plane (a fake NCCL that
// joins at once), stays `stay`, then exits without leaving (its alive lock turns owner-dead).
// Exit code 0 when it joined.
Child SpawnPlaneFollower(const std::string& name, absl::Duration stay) {
  return Spawn([&](std::string& message) {
    auto comm = JoinGroup(name, 1, 2);
    if (!comm.ok()) return 2;
    auto plane = FollowDataPlane(FakeFactory(kNcclVersion, absl::OkStatus(), absl::ZeroDuration()), **comm,
                                 absl::Seconds(20));
    message = plane.status().ToString();
    absl::SleepFor(stay);
    _exit(plane.ok() ? 0 : 1);
  });
}

// Rank 0's options for a group of 2 named `name` over `factory`'s data plane.
TpGroupOptions LeaderOptions(const std::string& name, const TpDataPlaneFactory* factory) {
  TpGroupOptions options;
  options.shm_name = name;
  options.identity.world_size = 2;
  options.collective_timeout = absl::Seconds(20);
  options.data_plane = factory;
  return options;
}

// The leader with a data plane: the model's collectives (through its GroupCommunicator) reach the
// plane joined with the id it sent, not the shared memory; a rank that dies mid-life aborts the
// plane, the group is not served, and Acquire says which rank died.
TEST(TpLeaderDataPlaneTest, CollectivesRunOnThePlaneUntilARankDies) {
  const std::string name = GroupName();
  // The follower first: the test process starts threads below, and a fork after them is unsafe.
  Child follower = SpawnPlaneFollower(name, absl::Seconds(2));  // then dies without leaving
  static std::atomic<int> calls{0};
  TpDataPlaneFactory factory = FakeFactory(kNcclVersion, absl::OkStatus(), absl::ZeroDuration());
  auto join = factory.join;
  factory.join = [join](const TpBootstrap& b, int rank, const std::function<absl::Status()>& alive)
      -> absl::StatusOr<std::unique_ptr<TpDataPlane>> {
    // Counts the collectives that reach the plane.
    class Counting final : public TpDataPlane {
     public:
      explicit Counting(std::unique_ptr<TpDataPlane> inner) : inner_(std::move(inner)) {}
      int rank() const override { return 0; }
      int world_size() const override { return 2; }
      absl::Status AllReduceSum(kernels::Tensor& t) override {
        ++calls;
        return inner_->AllReduceSum(t);
      }
      absl::Status AllGather(const kernels::Tensor& in, kernels::Tensor& out) override {
        return inner_->AllGather(in, out);
      }
      absl::Status Broadcast(kernels::Tensor& t, int root) override { return inner_->Broadcast(t, root); }
      absl::Status Health() override { return inner_->Health(); }
      void Abort(absl::string_view reason) override { inner_->Abort(reason); }

     private:
      std::unique_ptr<TpDataPlane> inner_;
    };
    absl::StatusOr<std::unique_ptr<TpDataPlane>> plane = join(b, rank, alive);
    if (!plane.ok()) return plane.status();
    return std::make_unique<Counting>(*std::move(plane));
  };
  GroupCommunicator group(0, 2);
  const TpGroupOptions options = LeaderOptions(name, &factory);
  std::atomic<int> ready_calls{0}, unready_calls{0};
  {
    TpLeader leader(options, &group, [&](bool ready) { ++(ready ? ready_calls : unready_calls); });
    leader.Start();
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (ready_calls == 0 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
    ASSERT_EQ(ready_calls, 1);
    auto backend = kernels::CreateBackend("cpu", {.cpu_threads = 1});
    ASSERT_THAT(backend.status(), IsOk());
    kernels::Tensor t = *(*backend)->Allocate(kernels::DType::kF32, kernels::Shape{8});
    {
      absl::StatusOr<TpLeader::Lease> lease = leader.Acquire();
      ASSERT_THAT(lease.status(), IsOk());
      EXPECT_THAT(group.AllReduceSum(t), IsOk());
      EXPECT_EQ(calls, 1);  // the plane's, not the segment's (which would wait for rank 1)
    }
    const auto [fcode, fmessage] = Reap(follower);
    EXPECT_EQ(fcode, 0) << fmessage;
    const absl::Time gone = absl::Now() + absl::Seconds(20);
    while (unready_calls == 0 && absl::Now() < gone) absl::SleepFor(absl::Milliseconds(10));
    EXPECT_EQ(unready_calls, 1);
    EXPECT_THAT(leader.Acquire().status(),
                StatusIs(absl::StatusCode::kUnavailable, AllOf(HasSubstr("not formed"), HasSubstr("died"))));
    EXPECT_THAT(group.AllReduceSum(t), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("rank")));
    EXPECT_EQ(calls, 1);
  }
}

// While the group forms, the leader's manager holds its lock through the data plane's join (an
// NCCL init may take up to --tp_timeout_s). A request meanwhile is refused at once, naming why,
// instead of waiting out the join; once formed, Acquire leases the group.
TEST(TpLeaderDataPlaneTest, ARequestDuringASlowJoinIsRefusedAtOnce) {
  const std::string name = GroupName();
  Child follower = SpawnPlaneFollower(name, absl::Seconds(8));  // in the group while the leader's join lingers
  TpDataPlaneFactory factory = FakeFactory(kNcclVersion, absl::OkStatus(), absl::Seconds(4));
  GroupCommunicator group(0, 2);
  const TpGroupOptions options = LeaderOptions(name, &factory);
  std::atomic<int> ready_calls{0};
  {
    TpLeader leader(options, &group, [&](bool ready) { ready_calls += ready ? 1 : 0; });
    leader.Start();
    double slowest = 0;
    int refused = 0;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    bool leased = false;
    while (!leased && absl::Now() < deadline) {
      const absl::Time start = absl::Now();
      absl::StatusOr<TpLeader::Lease> lease = leader.Acquire();
      slowest = std::max(slowest, absl::ToDoubleSeconds(absl::Now() - start));
      if (lease.ok()) {
        leased = true;
      } else {
        EXPECT_THAT(lease.status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("not formed")));
        ++refused;
        absl::SleepFor(absl::Milliseconds(50));
      }
    }
    EXPECT_TRUE(leased) << "the group formed within 20 s";
    EXPECT_GT(refused, 10) << "requests during the 4 s join were refused";
    // The join lingers 4 s; a request waited for it before (the manager's 200 ms slices of
    // waiting for peers still hold the lock, so not zero).
    EXPECT_LT(slowest, 1.5) << "a request waited for the join";
    EXPECT_EQ(ready_calls, 1);
  }
  const auto [fcode, fmessage] = Reap(follower);
  EXPECT_EQ(fcode, 0) << fmessage;
}

}  // namespace
}  // namespace nq::worker
