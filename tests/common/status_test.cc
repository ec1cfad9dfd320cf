#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "services/common/status_grpc.h"
#include "services/common/status_http.h"
#include "services/common/status_macros.h"
#include "tests/common/status_matchers.h"

namespace nq {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int half, Half(x));
  ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckEven(int x) {
  RETURN_IF_ERROR(Half(x).status());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnPropagatesTheFirstError) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument, "odd"));
  EXPECT_THAT(CheckEven(3), StatusIs(absl::StatusCode::kInvalidArgument, "odd"));
  EXPECT_THAT(CheckEven(4), IsOk());
}

TEST(StatusMacrosTest, AnnotateKeepsTheCode) {
  EXPECT_THAT(Annotate(absl::NotFoundError("x.json"), "loading config"),
              StatusIs(absl::StatusCode::kNotFound, "loading config: x.json"));
  EXPECT_THAT(Annotate(absl::OkStatus(), "ctx"), IsOk());
}

TEST(StatusGrpcTest, CodesAndMessagesRoundTrip) {
  for (int code = 0; code <= 16; ++code) {
    absl::Status status(static_cast<absl::StatusCode>(code), code == 0 ? "" : "why");
    grpc::Status grpc_status = ToGrpcStatus(status);
    EXPECT_EQ(static_cast<int>(grpc_status.error_code()), code);
    EXPECT_EQ(FromGrpcStatus(grpc_status), status);
  }
}

TEST(StatusHttpTest, MapsCodesToHttpStatuses) {
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnauthenticated), 401);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kPermissionDenied), 403);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kInternal), 500);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFor(absl::StatusCode::kDeadlineExceeded), 504);
}

TEST(StatusHttpTest, ErrorBodyHasTheOpenAiShape) {
  HttpError error = ToHttpError(absl::ResourceExhaustedError("queue full (4 waiting)"));
  EXPECT_EQ(error.http_status, 429);
  nlohmann::json body = nlohmann::json::parse(error.body);
  EXPECT_EQ(body["error"]["message"], "queue full (4 waiting)");
  EXPECT_EQ(body["error"]["type"], "rate_limit_error");
  EXPECT_EQ(body["error"]["code"], "resource_exhausted");
  EXPECT_TRUE(body["error"]["param"].is_null());
}

TEST(StatusHttpTest, MessagesAreJsonEscaped) {
  HttpError error = ToHttpError(absl::InvalidArgumentError("bad \"model\"\n\\"));
  EXPECT_EQ(nlohmann::json::parse(error.body)["error"]["message"], "bad \"model\"\n\\");
  EXPECT_EQ(nlohmann::json::parse(error.body)["error"]["type"], "invalid_request_error");
}

}  // namespace
}  // namespace nq
