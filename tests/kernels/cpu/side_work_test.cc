// Side work on the CPU backend (Backend::BeginSideWork): ops run in call order, so results are the
// same with or without it; the order of Begin / End / (Begin / End again) / Join is checked (for every backend, in
// kernels/backend_side_work.cc), so is what may run on the side (the CUDA backend's limits, which
// the CPU's tests of model code then hold it to), and SideWorkGuard joins what a failed caller
// left open.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

TEST(SideWork, CallsOutOfOrderAreRefusedAndOpsRunInCallOrder) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  const std::vector<float> host = {1, 2, 3, 4};
  Tensor t = Upload(*cpu, host, DType::kF32, {1, 4});
  Tensor out = AllocateOrFail(*cpu, DType::kF32, {1, 4});

  EXPECT_FALSE(cpu->SideWorkOpen());
  EXPECT_THAT(cpu->EndSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not going to the side")));
  EXPECT_THAT(cpu->JoinSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no side work")));

  ASSERT_TRUE(cpu->BeginSideWork().ok());
  EXPECT_TRUE(cpu->OnSide());
  EXPECT_THAT(cpu->BeginSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already open")));
  ASSERT_TRUE(cpu->Add(t, t, out).ok());
  ASSERT_TRUE(cpu->EndSideWork().ok());
  EXPECT_FALSE(cpu->OnSide());
  EXPECT_TRUE(cpu->SideWorkOpen());
  EXPECT_THAT(cpu->EndSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not going to the side")));
  ASSERT_TRUE(cpu->Add(t, out, out).ok());  // the main stream, after the side's op
  // Begun again before the join: more side work, after the main stream's ops so far.
  ASSERT_TRUE(cpu->BeginSideWork().ok());
  EXPECT_TRUE(cpu->OnSide());
  EXPECT_THAT(cpu->BeginSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already open")));
  ASSERT_TRUE(cpu->Add(out, t, out).ok());
  ASSERT_TRUE(cpu->EndSideWork().ok());
  ASSERT_TRUE(cpu->JoinSideWork().ok());
  EXPECT_FALSE(cpu->SideWorkOpen());
  EXPECT_EQ(Download(*cpu, out), (std::vector<float>{4, 8, 12, 16}));

  // ContinueSideWork needs ended side work: refused with none open and while on the side.
  EXPECT_THAT(cpu->ContinueSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no ended side work")));
  ASSERT_TRUE(cpu->BeginSideWork().ok());
  EXPECT_THAT(cpu->ContinueSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no ended side work")));
  ASSERT_TRUE(cpu->EndSideWork().ok());
  ASSERT_TRUE(cpu->Add(t, t, out).ok());  // main
  ASSERT_TRUE(cpu->ContinueSideWork().ok());
  EXPECT_TRUE(cpu->OnSide());
  ASSERT_TRUE(cpu->Add(out, t, out).ok());  // side, in call order here
  ASSERT_TRUE(cpu->EndSideWork().ok());
  ASSERT_TRUE(cpu->JoinSideWork().ok());
  EXPECT_EQ(Download(*cpu, out), (std::vector<float>{3, 6, 9, 12}));

  // Join straight from the side (no EndSideWork) closes it too.
  ASSERT_TRUE(cpu->BeginSideWork().ok());
  ASSERT_TRUE(cpu->JoinSideWork().ok());
  EXPECT_FALSE(cpu->SideWorkOpen());
}

// What shares state with the main stream on the CUDA backend (its scratch block, its MoE
// workspace, host copies) is refused on the side by every backend, and host round trips while side
// work is open; nothing is run or written by a refused call.
TEST(SideWork, WhatSharesStateWithTheMainStreamIsRefusedOnEveryBackend) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  const std::vector<float> host = {1, 2, 3, 4};
  Tensor t = Upload(*cpu, host, DType::kF32, {1, 4});
  Tensor table = Upload(*cpu, host, DType::kF32, {1, 4});
  Tensor out = Upload(*cpu, std::vector<float>{7, 7, 7, 7}, DType::kF32, {1, 4});
  std::vector<std::byte> bytes(16);
  const std::vector<std::int32_t> ids = {0};
  const std::vector<float> weights = {1.0f};

  ASSERT_TRUE(cpu->BeginSideWork().ok());
  const auto refused = [](const absl::Status& s) {
    return s.code() == absl::StatusCode::kFailedPrecondition && absl::StrContains(s.message(), "side stream");
  };
  EXPECT_TRUE(refused(cpu->Embedding(ids, table, out)));
  EXPECT_TRUE(refused(cpu->GatherRows(t, ids, out)));
  EXPECT_TRUE(refused(cpu->ScatterAddRows(t, ids, weights, out)));
  EXPECT_TRUE(refused(cpu->CopyFromHost(std::as_bytes(std::span<const float>(host)), out)));
  EXPECT_TRUE(refused(cpu->CopyFromHostAt(std::as_bytes(std::span<const float>(host).first(1)), out, 0)));
  EXPECT_THAT(cpu->Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work is open")));
  EXPECT_THAT(cpu->CopyToHost(t, bytes), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work is open")));
  ASSERT_TRUE(cpu->Add(t, t, out).ok());  // an op that may run there
  ASSERT_TRUE(cpu->EndSideWork().ok());
  // Off the side but before the join: the host round trips still wait for the join.
  EXPECT_THAT(cpu->Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work is open")));
  EXPECT_THAT(cpu->CopyToHost(t, bytes), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work is open")));
  ASSERT_TRUE(cpu->Embedding(ids, table, t).ok());  // the main stream may
  ASSERT_TRUE(cpu->JoinSideWork().ok());
  ASSERT_TRUE(cpu->Synchronize().ok());
  EXPECT_EQ(Download(*cpu, out), (std::vector<float>{2, 4, 6, 8}));  // only the Add wrote it
  EXPECT_EQ(Download(*cpu, t), host);
}

TEST(SideWork, TheGuardJoinsWhatAFailedCallerLeftOpen) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  {
    SideWorkGuard guard(*cpu);
    ASSERT_TRUE(cpu->BeginSideWork().ok());
    ASSERT_TRUE(cpu->EndSideWork().ok());
  }
  EXPECT_FALSE(cpu->SideWorkOpen());
  EXPECT_TRUE(cpu->BeginSideWork().ok());
  {
    SideWorkGuard guard(*cpu);  // side work open on entry: joined on exit as well
  }
  EXPECT_FALSE(cpu->SideWorkOpen());
}

}  // namespace
}  // namespace nq::kernels
