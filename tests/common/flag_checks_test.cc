#include "services/common/flag_checks.h"

#include <cmath>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(FlagChecksTest, Ports) {
  EXPECT_THAT(CheckPortFlag("http_port", 8000), IsOk());
  EXPECT_THAT(CheckPortFlag("http_port", 0), StatusIs(absl::StatusCode::kInvalidArgument,
                                                      HasSubstr("--http_port=0")));
  EXPECT_THAT(CheckPortFlag("http_port", 0, /*allow_ephemeral=*/true), IsOk());
  EXPECT_THAT(CheckPortFlag("grpc_port", 65536),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("1..65535")));
}

TEST(FlagChecksTest, Addresses) {
  EXPECT_THAT(CheckAddressFlag("worker_address", "127.0.0.1:8100"), IsOk());
  EXPECT_THAT(CheckAddressFlag("worker_address", "[::1]:8100"), IsOk());
  for (const char* bad : {"localhost", ":8100", "host:", "host:0", "host:99999", "host:x"}) {
    EXPECT_THAT(CheckAddressFlag("worker_address", bad),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host:port")))
        << bad;
  }
}

TEST(FlagChecksTest, Seconds) {
  EXPECT_THAT(CheckPositiveSecondsFlag("drain_timeout_s", 0.5), IsOk());
  EXPECT_FALSE(CheckPositiveSecondsFlag("drain_timeout_s", 0).ok());
  EXPECT_FALSE(CheckPositiveSecondsFlag("drain_timeout_s", -1).ok());
  EXPECT_FALSE(CheckPositiveSecondsFlag("drain_timeout_s", NAN).ok());
  EXPECT_FALSE(CheckPositiveSecondsFlag("drain_timeout_s", INFINITY).ok());
}

TEST(FlagChecksTest, GlobalRankOfANodesRank) {
  EXPECT_EQ(*GlobalRank(0, 4, 0), 0);
  EXPECT_EQ(*GlobalRank(0, 4, 3), 3);
  EXPECT_EQ(*GlobalRank(1, 4, 0), 4);
  EXPECT_EQ(*GlobalRank(2, 2, 1), 5);
  EXPECT_THAT(GlobalRank(1, 4, 4).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0..3")));
  EXPECT_THAT(GlobalRank(1, 4, -1).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0..3")));
  EXPECT_THAT(GlobalRank(1, 0, 0).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--ranks_per_node >= 1")));
  EXPECT_THAT(GlobalRank(-1, 4, 0).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--node_rank")));
}

}  // namespace
}  // namespace nq
