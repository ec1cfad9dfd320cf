// Strict JSON parsing for safetensors headers and index files, without exceptions.
//
// nlohmann::json::parse keeps the last of two equal keys and reports errors by throwing; a
// header whose tensor appears twice must be refused, and a parse error must become a
// Status. This parser runs nlohmann's SAX parser with a DOM builder that rejects duplicate
// keys and bounds the nesting depth (the DOM's recursive operations, such as dump(), then
// stay shallow on hostile input).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::model {

// Deep enough for every file this module reads (a header nests 3 levels: the object, a
// tensor, its shape), shallow enough that recursion over the DOM is harmless.
inline constexpr int kMaxJsonDepth = 32;

// Parses `text` as one JSON value (surrounding whitespace allowed). INVALID_ARGUMENT with
// nlohmann's line/column message for malformed JSON (invalid UTF-8 included), naming the
// JSON pointer of a duplicate key, or when nesting exceeds kMaxJsonDepth.
absl::StatusOr<nlohmann::json> ParseJsonStrict(absl::string_view text);

// `text` quoted for an error message: C-escaped, and cut to a bounded length with its size
// noted, because names in hostile files may be megabytes long or hold control bytes.
std::string QuoteForMessage(absl::string_view text);

}  // namespace nq::model
