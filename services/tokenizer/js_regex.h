// Regular expressions with JavaScript (`new RegExp(p, "gu")`) semantics, run by PCRE2.
//
// tokenizer.json patterns are written for Rust's regex engines, and the reference tokenizer
// (@lenml/tokenizers, i.e. transformers.js) runs them as JavaScript regexes after a few
// textual rewrites. To produce the reference's pieces exactly we apply the same rewrites, then
// translate the JavaScript constructs whose meaning differs in PCRE2:
//   - `\s` / `\S`: JavaScript's set (ASCII whitespace, U+00A0, U+1680, U+2000..U+200A, U+2028,
//     U+2029, U+202F, U+205F, U+3000, U+FEFF). PCRE2's set differs (U+0085, U+180E, no U+FEFF).
//   - `.`: anything but \n, \r, U+2028, U+2029.
//   - `\uXXXX`, `\u{X..}`, surrogate pairs: PCRE2 `\x{..}`.
//   - `$` only at the very end (PCRE2_DOLLAR_ENDONLY); `\d`, `\w`, `\b` stay ASCII (no UCP),
//     as in JavaScript; `\p{..}` classes use PCRE2's Unicode tables.
// Global matching advances one code point past an empty match, as String.matchAll does.
//
// Known divergence: Unicode property tables follow each library's Unicode version (PCRE2 10.42:
// Unicode 14; Node 20: ICU's). Characters assigned after Unicode 14 may split differently.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace nq::tokenizer {

// A match as byte offsets [begin, end) into the subject.
struct MatchSpan {
  size_t begin;
  size_t end;
};

class JsRegex {
 public:
  // Compiles a tokenizer.json `{"Regex": pattern}` the way the reference does.
  static absl::StatusOr<std::unique_ptr<JsRegex>> Compile(std::string_view pattern);
  // Matches the literal `text` (a `{"String": text}` pattern).
  static std::unique_ptr<JsRegex> Literal(std::string_view text);

  ~JsRegex();
  JsRegex(const JsRegex&) = delete;
  JsRegex& operator=(const JsRegex&) = delete;

  // Every match in `subject` (valid UTF-8), left to right, including empty ones, with
  // String.prototype.matchAll's rules. Thread-safe.
  absl::Status FindAll(std::string_view subject, std::vector<MatchSpan>* matches) const;

  // The PCRE2 pattern actually compiled (empty for a literal), for error messages and tests.
  const std::string& translated() const { return translated_; }

 private:
  JsRegex() = default;

  std::string literal_;       // used when code_ is null
  std::string translated_;
  void* code_ = nullptr;      // pcre2_code_8*
  bool jit_ = false;
};

// The pattern text the reference hands to `new RegExp`: its `\#`, `\&`, `\~` unescaping and the
// PROBLEMATIC_REGEX_MAP substitutions. Exposed for tests.
std::string ApplyReferenceRewrites(std::string_view pattern);

// Translates a JavaScript (u-mode) pattern to PCRE2 syntax, as described above.
absl::StatusOr<std::string> TranslateJsPattern(std::string_view pattern);

}  // namespace nq::tokenizer
