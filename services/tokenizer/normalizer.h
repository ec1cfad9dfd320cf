// Normalizers of tokenizer.json ("normalizer"), applied to each text section between added
// tokens. Semantics follow the reference (transformers.js): NFC/NFD/NFKC/NFKD as
// String.prototype.normalize (ICU here), Lowercase as toLowerCase (ICU root locale), Strip
// with JavaScript's whitespace, StripAccents removing \p{M}, Replace, Prepend and Sequence.
#pragma once

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::tokenizer {

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  // Rewrites `text` (valid UTF-8) in place.
  virtual absl::Status Normalize(std::string* text) const = 0;
};

// Builds the normalizer described by `config` (a tokenizer.json "normalizer" value). Returns
// nullptr for JSON null; UnimplementedError naming the type for one this module lacks.
absl::StatusOr<std::unique_ptr<Normalizer>> MakeNormalizer(const nlohmann::json& config, const std::string& path);

// True for the characters JavaScript's trim() and \s remove: ASCII whitespace, U+00A0,
// U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000, U+FEFF.
bool IsJsWhitespace(char32_t cp);

// JavaScript's trimStart() / trimEnd() on UTF-8.
std::string_view JsTrimStart(std::string_view s);
std::string_view JsTrimEnd(std::string_view s);

}  // namespace nq::tokenizer
