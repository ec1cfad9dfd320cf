// What the chat templates' Python side does to text, reproduced exactly: json.dumps as
// transformers' `tojson` filter calls it, and str.strip / lstrip / rstrip / split.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::chat {

// Key order is part of the rendered text, so JSON values keep it.
using Json = nlohmann::ordered_json;

// Parses JSON text the way json.loads does (key order kept; a repeated key keeps its first
// position and its last value). INVALID_ARGUMENT with the parser's message on bad JSON.
absl::StatusOr<Json> ParseJson(absl::string_view text);

// json.dumps(value, ensure_ascii=False) with the default separators ", " and ": ", which is
// what transformers' chat-template `tojson` filter returns: non-ASCII text stays raw, control
// characters become \uXXXX (lowercase hex) except \b \f \n \r \t, and floats print like
// Python's repr (shortest round-trip digits; exponent form below 1e-4 and from 1e16).
// Limits: integers beyond 64 bits were parsed as floats by ParseJson and print as floats
// (Python keeps them integers).
std::string PyJsonDumps(const Json& value);

// Python's repr(float) for a finite double.
std::string PyFloatRepr(double value);

// str.strip() with no argument: removes the characters str.isspace() accepts (ASCII
// whitespace, U+001C..U+001F, U+0085, U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029,
// U+202F, U+205F, U+3000) from both ends of UTF-8 text.
std::string PyStrip(absl::string_view text);

// str.lstrip(chars) / str.rstrip(chars) for a set of ASCII characters.
absl::string_view PyLStripChars(absl::string_view text, absl::string_view chars);
absl::string_view PyRStripChars(absl::string_view text, absl::string_view chars);

// str.split(separator) (separator non-empty): every piece, empty ones included.
std::vector<absl::string_view> PySplit(absl::string_view text, absl::string_view separator);

}  // namespace nq::chat
