// Status propagation macros. Debian 12's Abseil (20220623) predates absl's own
// RETURN_IF_ERROR / ASSIGN_OR_RETURN, so the project carries these (STYLE.md 4).
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define NQ_STATUS_CONCAT_INNER_(a, b) a##b
#define NQ_STATUS_CONCAT_(a, b) NQ_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) and returns it from the enclosing function if not OK.
#define RETURN_IF_ERROR(expr)                                  \
  do {                                                         \
    ::absl::Status nq_status_ = (expr);                        \
    if (!nq_status_.ok()) return nq_status_;                   \
  } while (false)

// ASSIGN_OR_RETURN(lhs, expr): evaluates `expr` (an absl::StatusOr<T>); on error returns its
// status, otherwise moves the value into `lhs` (which may be a declaration: `auto x`).
#define ASSIGN_OR_RETURN(lhs, expr) \
  NQ_ASSIGN_OR_RETURN_IMPL_(NQ_STATUS_CONCAT_(nq_statusor_, __LINE__), lhs, expr)

#define NQ_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                              \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace nq {

// Prefixes a status message with context, keeping its code: "loading config: <msg>".
inline absl::Status Annotate(const absl::Status& status, std::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), std::string(context) + ": " + std::string(status.message()));
}

}  // namespace nq
