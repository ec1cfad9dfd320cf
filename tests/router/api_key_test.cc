#include "services/router/api_key.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::router {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(ApiKeyTest, DisabledWithoutAKey) {
  ApiKeyCheck check("");
  EXPECT_FALSE(check.enabled());
  EXPECT_THAT(check.Check(""), IsOk());
}

TEST(ApiKeyTest, AcceptsOnlyTheBearerKey) {
  ApiKeyCheck check("k-123");
  EXPECT_THAT(check.Check("Bearer k-123"), IsOk());
  EXPECT_THAT(check.Check(""), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("missing")));
  EXPECT_THAT(check.Check("k-123"), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("missing")));
  EXPECT_THAT(check.Check("Bearer k-1234"), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("incorrect")));
  // A prefix of the key (what a comparison stopping at the shorter length would accept).
  EXPECT_THAT(check.Check("Bearer k-12"), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("incorrect")));
  EXPECT_THAT(check.Check("Bearer K-123"), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("incorrect")));
  EXPECT_THAT(check.Check("Bearer "), StatusIs(absl::StatusCode::kUnauthenticated, HasSubstr("incorrect")));
  // The key never appears in an error.
  EXPECT_THAT(std::string(check.Check("Bearer nope").message()), ::testing::Not(HasSubstr("k-123")));
}

}  // namespace
}  // namespace nq::router
