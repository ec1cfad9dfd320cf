#include "services/streamer/worker_registry.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "services/common/shared_memory.h"
#include "services/common/slot_mailbox.h"
#include "tests/common/status_matchers.h"

namespace nq::streamer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

class WorkerRegistryTest : public ::testing::Test {
 protected:
  WorkerRegistryTest() : registry_(metrics_) {}

  // A worker-side arena and the request that registers it.
  nq::v1::RegisterWorkerRequest MakeRequest(uint32_t rank, SharedMemory* arena_out,
                                            uint32_t pid = getpid()) {
    SlotGeometry geometry = SlotGeometry::Packed({1, 2}, 2, 4096, 8, 1);
    const std::string name = absl::StrCat("/nq-test-registry-", getpid(), "-", counter_++);
    absl::StatusOr<SharedMemory> arena = SharedMemory::Create(name, geometry.ArenaBytes());
    EXPECT_THAT(arena, IsOk());
    nq::v1::RegisterWorkerRequest request;
    if (!arena.ok()) return request;
    request.set_rank(rank);
    request.set_world_size(2);
    request.set_pid(pid);
    request.mutable_shm()->set_name(name);
    request.mutable_shm()->set_bytes(geometry.ArenaBytes());
    *request.mutable_geometry() = geometry.ToProto();
    *arena_out = std::move(*arena);
    return request;
  }

  // MakeRequest's for a worker of world size 1 with a slot mailbox of `layers` x `experts` (its
  // geometry's are 2 x 8), created as the worker would into `mailbox_out`.
  nq::v1::RegisterWorkerRequest MakeMailboxRequest(SharedMemory* arena_out, SlotMailbox* mailbox_out,
                                                   uint32_t layers = 2, uint32_t experts = 8,
                                                   uint32_t pid = getpid()) {
    nq::v1::RegisterWorkerRequest request = MakeRequest(0, arena_out, pid);
    request.set_world_size(1);
    const std::string name = absl::StrCat("/nq-test-mailbox-", getpid(), "-", counter_++);
    absl::StatusOr<SlotMailbox> mailbox = SlotMailbox::Create(name, layers, experts);
    EXPECT_THAT(mailbox, IsOk());
    if (!mailbox.ok()) return request;
    request.mutable_slot_mailbox()->set_shm(name);
    *mailbox_out = std::move(*mailbox);
    return request;
  }

  metrics::Registry metrics_;
  WorkerRegistry registry_;
  int counter_ = 0;
};

TEST_F(WorkerRegistryTest, RegistersMapsAndReleases) {
  SharedMemory arena;
  nq::v1::RegisterWorkerRequest request = MakeRequest(0, &arena);
  absl::StatusOr<std::string> id = registry_.Register(request);
  ASSERT_THAT(id, IsOk());
  EXPECT_TRUE(registry_.Contains(*id));
  EXPECT_THAT(metrics_.Serialize(), HasSubstr("nq_streamer_workers_registered 1"));
  EXPECT_THAT(registry_.OpenSession(*id), IsOk());
  EXPECT_THAT(registry_.OpenSession(*id), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already")));
  registry_.CloseSession(*id, 0);
  EXPECT_FALSE(registry_.Contains(*id));
  EXPECT_THAT(metrics_.Serialize(), HasSubstr("nq_streamer_workers_registered 0"));
  EXPECT_THAT(registry_.OpenSession(*id), StatusIs(absl::StatusCode::kNotFound, HasSubstr("register first")));
}

// Issue #14: the registered worker holds the streamer's mapping of the worker's mailbox (what it
// posts there the worker sees); a worker without one has none.
TEST_F(WorkerRegistryTest, MapsTheSlotMailboxItNames) {
  SharedMemory arena;
  SlotMailbox worker_side;
  absl::StatusOr<std::string> id = registry_.Register(MakeMailboxRequest(&arena, &worker_side));
  ASSERT_THAT(id, IsOk());
  absl::StatusOr<std::shared_ptr<RegisteredWorker>> worker = registry_.OpenSession(*id);
  ASSERT_THAT(worker, IsOk());
  ASSERT_NE((*worker)->mailbox, nullptr);
  EXPECT_EQ((*worker)->mailbox->name(), worker_side.name());
  EXPECT_EQ((*worker)->mailbox->layers(), 2u);
  EXPECT_EQ((*worker)->mailbox->experts(), 8u);
  EXPECT_EQ((*worker)->mailbox->Post(1, 5, 3).value_or(0), 1u);
  EXPECT_EQ(worker_side.PostedSeq(1, 5), 1u);
  EXPECT_EQ(worker_side.ApplyOnHost(), 1u);
  EXPECT_EQ((*worker)->mailbox->Published(1, 5), kernels::PackMailboxEntry(1, 3));
  registry_.CloseSession(*id, 0);

  SharedMemory plain_arena;
  nq::v1::RegisterWorkerRequest plain = MakeRequest(0, &plain_arena);
  plain.set_world_size(1);
  absl::StatusOr<std::string> plain_id = registry_.Register(plain);
  ASSERT_THAT(plain_id, IsOk());
  absl::StatusOr<std::shared_ptr<RegisteredWorker>> plain_worker = registry_.OpenSession(*plain_id);
  ASSERT_THAT(plain_worker, IsOk());
  EXPECT_EQ((*plain_worker)->mailbox, nullptr);
}

// A mailbox that cannot be mapped, or is not of the worker's geometry, or comes from a rank of a
// tensor-parallel group is refused, and nothing is registered.
TEST_F(WorkerRegistryTest, RefusesAMailboxItCannotUse) {
  SharedMemory arena_a, arena_b, arena_c, arena_d, arena_e;
  SlotMailbox mailbox_a, mailbox_b, mailbox_c, mailbox_d, mailbox_e;

  // 4 x 4 entries take the bytes of 2 x 8: the header tells them apart.
  nq::v1::RegisterWorkerRequest transposed = MakeMailboxRequest(&arena_a, &mailbox_a, 4, 4);
  EXPECT_THAT(registry_.Register(transposed),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("for 4 layers x 4 experts; expected magic")));
  nq::v1::RegisterWorkerRequest smaller = MakeMailboxRequest(&arena_b, &mailbox_b, 1, 8);
  EXPECT_THAT(registry_.Register(smaller),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(smaller.slot_mailbox().shm())));

  nq::v1::RegisterWorkerRequest missing = MakeMailboxRequest(&arena_c, &mailbox_c);
  missing.mutable_slot_mailbox()->set_shm("/nq-test-mailbox-does-not-exist");
  EXPECT_THAT(registry_.Register(missing),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("nq-test-mailbox-does-not-exist")));
  missing.mutable_slot_mailbox()->clear_shm();
  EXPECT_THAT(registry_.Register(missing), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names no")));

  nq::v1::RegisterWorkerRequest group_rank = MakeMailboxRequest(&arena_d, &mailbox_d);
  group_rank.set_world_size(2);
  EXPECT_THAT(registry_.Register(group_rank),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("rank 0 of world size 2 registered a slot mailbox")));
  group_rank.set_tp_group("/nq-tp-mailbox");
  group_rank.set_release_id("rel-1");
  EXPECT_THAT(registry_.Register(group_rank),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("only a worker of world size 1")));
  EXPECT_EQ(registry_.size(), 0u);
  EXPECT_THAT(metrics_.Serialize(), HasSubstr("nq_streamer_registrations_total 0"));

  // The same request with the right mailbox is accepted.
  nq::v1::RegisterWorkerRequest good = MakeMailboxRequest(&arena_e, &mailbox_e);
  EXPECT_THAT(registry_.Register(good), IsOk());
  EXPECT_EQ(registry_.size(), 1u);
}

TEST_F(WorkerRegistryTest, SameRankReplacesTheEarlierRegistration) {
  SharedMemory first_arena, second_arena;
  absl::StatusOr<std::string> first = registry_.Register(MakeRequest(1, &first_arena));
  absl::StatusOr<std::string> second = registry_.Register(MakeRequest(1, &second_arena));
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(second, IsOk());
  EXPECT_NE(*first, *second);
  EXPECT_FALSE(registry_.Contains(*first));
  EXPECT_TRUE(registry_.Contains(*second));
  EXPECT_EQ(registry_.size(), 1u);
}

TEST_F(WorkerRegistryTest, RejectsBadRegistrations) {
  SharedMemory arena;
  nq::v1::RegisterWorkerRequest base = MakeRequest(0, &arena);

  nq::v1::RegisterWorkerRequest bad_rank = base;
  bad_rank.set_rank(2);
  EXPECT_THAT(registry_.Register(bad_rank), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 2")));

  nq::v1::RegisterWorkerRequest bad_geometry = base;
  bad_geometry.mutable_geometry()->set_rec_bytes(1000);
  EXPECT_THAT(registry_.Register(bad_geometry),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rec_bytes")));

  nq::v1::RegisterWorkerRequest size_mismatch = base;
  size_mismatch.mutable_shm()->set_bytes(4096);
  EXPECT_THAT(registry_.Register(size_mismatch),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not match")));

  nq::v1::RegisterWorkerRequest missing = base;
  missing.mutable_shm()->set_name("/nq-test-does-not-exist");
  EXPECT_THAT(registry_.Register(missing), StatusIs(absl::StatusCode::kNotFound, HasSubstr("does-not-exist")));

  nq::v1::RegisterWorkerRequest cuda = base;
  cuda.mutable_cuda_ipc()->set_bytes(base.shm().bytes());
#ifdef NQ_HAVE_CUDA
  // A streamer built with CUDA opens the handles: these are empty.
  EXPECT_THAT(registry_.Register(cuda), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 HasSubstr("malformed memory, event or device handle")));
#else
  EXPECT_THAT(registry_.Register(cuda), StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("without CUDA")));
#endif
  EXPECT_EQ(registry_.size(), 0u);
}

TEST_F(WorkerRegistryTest, ASecondLiveProcessCannotTakeARankWithASession) {
  SharedMemory first_arena, second_arena, third_arena;
  absl::StatusOr<std::string> first = registry_.Register(MakeRequest(0, &first_arena, getpid()));
  ASSERT_THAT(first, IsOk());
  ASSERT_THAT(registry_.OpenSession(*first), IsOk());
  // Another live process (our parent) claims rank 0 while the session is up: refused.
  EXPECT_THAT(registry_.Register(MakeRequest(0, &second_arena, static_cast<uint32_t>(getppid()))),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("live process")));
  // The same process registering again (a reconnect) replaces its registration.
  EXPECT_THAT(registry_.Register(MakeRequest(0, &third_arena, getpid())), IsOk());
  EXPECT_EQ(registry_.size(), 1u);
}

// A reconnecting worker registers again while its old session is still open: the old session
// is told to end, and the new one may not start (its loader would write the same arena) until
// the old one has closed.
TEST_F(WorkerRegistryTest, ARegistrationAgainEndsTheOldSessionBeforeTheNewOneStarts) {
  SharedMemory first_arena, second_arena;
  absl::StatusOr<std::string> first = registry_.Register(MakeRequest(0, &first_arena, getpid()));
  ASSERT_THAT(first, IsOk());
  std::atomic<int> cancels{0};
  ASSERT_THAT(registry_.OpenSession(*first, [&] { ++cancels; }), IsOk());
  EXPECT_EQ(registry_.OpenSessions(0), 1);

  absl::StatusOr<std::string> second = registry_.Register(MakeRequest(0, &second_arena, getpid()));
  ASSERT_THAT(second, IsOk());
  EXPECT_EQ(cancels.load(), 1) << "the old session was not told to end";
  // The old session has not closed yet: the new one waits, then gives up with a retryable error.
  EXPECT_THAT(registry_.OpenSession(*second, nullptr, absl::Milliseconds(100)),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("still stopping")));
  // Once the old session closes (on its own thread, as the service does), the new one opens.
  std::thread closer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    registry_.CloseSession(*first, 0);
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(registry_.OpenSession(*second, nullptr, absl::Seconds(10)), IsOk());
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(150)) << "it did not wait";
  closer.join();
  EXPECT_EQ(registry_.OpenSessions(0), 1);
  EXPECT_TRUE(registry_.Contains(*second));
  registry_.CloseSession(*second, 0);
  EXPECT_EQ(registry_.OpenSessions(0), 0);
}

TEST_F(WorkerRegistryTest, AWorkerServingAnotherReleaseIsRefused) {
  metrics::Registry metrics;
  WorkerRegistry with_release(metrics, "abc123");
  SharedMemory arena;
  nq::v1::RegisterWorkerRequest request = MakeRequest(0, &arena);
  request.set_tp_group("/nq-tp-test");  // a streaming rank of a group of 2 names its group
  request.set_release_id("def456");
  EXPECT_THAT(with_release.Register(request),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("release def456")));
  request.set_release_id("abc123");
  EXPECT_THAT(with_release.Register(request), IsOk());
}

TEST_F(WorkerRegistryTest, DeadWorkersArenaNameIsRemoved) {
  // A child process that has exited stands in for a worker that died.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);

  SharedMemory arena;
  nq::v1::RegisterWorkerRequest request = MakeRequest(0, &arena, static_cast<uint32_t>(child));
  const std::string name = request.shm().name();
  absl::StatusOr<std::string> id = registry_.Register(request);
  ASSERT_THAT(id, IsOk());
  ASSERT_THAT(registry_.OpenSession(*id), IsOk());
  registry_.CloseSession(*id, 0);
  EXPECT_THAT(SharedMemory::Open(name, request.shm().bytes()), StatusIs(absl::StatusCode::kNotFound, HasSubstr(name)));
}

TEST_F(WorkerRegistryTest, DeadWorkersMailboxNameIsRemoved) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  ASSERT_EQ(waitpid(child, nullptr, 0), child);

  SharedMemory arena;
  SlotMailbox mailbox;
  nq::v1::RegisterWorkerRequest request = MakeMailboxRequest(&arena, &mailbox, 2, 8, static_cast<uint32_t>(child));
  const std::string name = request.slot_mailbox().shm();
  absl::StatusOr<std::string> id = registry_.Register(request);
  ASSERT_THAT(id, IsOk());
  ASSERT_THAT(registry_.OpenSession(*id), IsOk());
  registry_.CloseSession(*id, 0);
  EXPECT_THAT(SlotMailbox::Open(name, 2, 8), StatusIs(absl::StatusCode::kNotFound, HasSubstr(name)));
}

// Issue #18: the ranks of one tensor-parallel group register as one group. A rank naming the
// group with another world size (or release) than its registered ranks is refused, naming both;
// a streaming rank of a group must name it; the same rank number in two groups are two workers.
TEST_F(WorkerRegistryTest, GroupRankWithAnotherWorldSizeOrReleaseIsRefused) {
  SharedMemory a, b, c, d;
  nq::v1::RegisterWorkerRequest rank0 = MakeRequest(0, &a);
  rank0.set_tp_group("/nq-tp-9000");
  rank0.set_release_id("rel-1");
  ASSERT_THAT(registry_.Register(rank0), IsOk());

  nq::v1::RegisterWorkerRequest rank1 = MakeRequest(1, &b);
  rank1.set_tp_group("/nq-tp-9000");
  rank1.set_release_id("rel-1");
  rank1.set_world_size(4);
  EXPECT_THAT(registry_.Register(rank1),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("tensor-parallel group /nq-tp-9000 has world size 2 (rank 0")));
  EXPECT_THAT(registry_.Register(rank1), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                  HasSubstr("rank 1 registered with world size 4")));
  rank1.set_world_size(2);
  rank1.set_release_id("rel-2");
  EXPECT_THAT(registry_.Register(rank1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("serves release 'rel-1' (rank 0)")));
  rank1.set_release_id("rel-1");
  ASSERT_THAT(registry_.Register(rank1), IsOk());

  nq::v1::RegisterWorkerRequest unnamed = MakeRequest(1, &c);
  unnamed.set_release_id("rel-1");
  EXPECT_THAT(registry_.Register(unnamed),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("names no tensor-parallel group")));

  // Rank 0 of another group does not replace this group's rank 0.
  nq::v1::RegisterWorkerRequest other = MakeRequest(0, &d);
  other.set_tp_group("/nq-tp-9100");
  other.set_release_id("rel-1");
  ASSERT_THAT(registry_.Register(other), IsOk());
  EXPECT_EQ(registry_.size(), 3u);
}

}  // namespace
}  // namespace nq::streamer
