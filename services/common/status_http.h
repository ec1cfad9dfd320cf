// absl::Status -> HTTP status code and OpenAI-style error body (STYLE.md 7).
#pragma once

#include <string>

#include "absl/status/status.h"

namespace nq {

struct HttpError {
  int http_status;
  // {"error":{"message":...,"type":...,"param":null,"code":...}}, as the OpenAI API shapes it.
  std::string body;
};

// The HTTP status for a canonical code (INVALID_ARGUMENT -> 400, UNAUTHENTICATED -> 401,
// PERMISSION_DENIED -> 403, NOT_FOUND -> 404, RESOURCE_EXHAUSTED -> 429, UNAVAILABLE -> 503,
// DEADLINE_EXCEEDED -> 504, ...).
int HttpStatusFor(absl::StatusCode code);

// The OpenAI error `type` for a canonical code ("invalid_request_error", "authentication_error",
// "rate_limit_error", "server_error", ...).
const char* OpenAiErrorType(absl::StatusCode code);

// Requires !status.ok().
HttpError ToHttpError(const absl::Status& status);

}  // namespace nq
