// Side work on the CPU backend (Backend::BeginSideWork): ops run in call order, so results are the
// same with or without it; the order of Begin / End / (Begin / End again) / Join is checked (for every backend, in
// kernels/backend_side_work.cc), and SideWorkGuard joins what a failed caller left open.
#include <memory>
#include <vector>

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
