#include "services/common/status_http.h"

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"

namespace nq {

int HttpStatusFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kFailedPrecondition: return 400;
    case absl::StatusCode::kUnauthenticated: return 401;
    case absl::StatusCode::kPermissionDenied: return 403;
    case absl::StatusCode::kNotFound: return 404;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kAborted: return 409;
    case absl::StatusCode::kResourceExhausted: return 429;
    // 499 is the de-facto "client closed request" code (nginx); OpenAI-compatible servers use it.
    case absl::StatusCode::kCancelled: return 499;
    case absl::StatusCode::kUnimplemented: return 501;
    case absl::StatusCode::kUnavailable: return 503;
    case absl::StatusCode::kDeadlineExceeded: return 504;
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kDataLoss:
    default: return 500;
  }
}

const char* OpenAiErrorType(absl::StatusCode code) {
  switch (HttpStatusFor(code)) {
    case 400:
    case 404:
    case 409: return "invalid_request_error";
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 429: return "rate_limit_error";
    case 501: return "not_implemented_error";
    case 503: return "service_unavailable_error";
    case 504: return "timeout_error";
    default: return "server_error";
  }
}

HttpError ToHttpError(const absl::Status& status) {
  nlohmann::json error = {
      {"message", std::string(status.message())},
      {"type", OpenAiErrorType(status.code())},
      {"param", nullptr},
      {"code", absl::AsciiStrToLower(absl::StatusCodeToString(status.code()))},
  };
  nlohmann::json body = {{"error", error}};
  return HttpError{HttpStatusFor(status.code()), body.dump()};
}

}  // namespace nq
