// UTF-8 decoding with the WHATWG / Unicode "maximal subpart" replacement rule: each maximal
// subpart of an ill-formed sequence becomes exactly one U+FFFD. JavaScript's TextDecoder (the
// reference tokenizer's input path) and Python's `errors="replace"` follow the same rule, so
// the same bytes give the same text everywhere.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace nq::tokenizer {

// U+FFFD REPLACEMENT CHARACTER, UTF-8 encoded.
inline constexpr std::string_view kReplacementUtf8 = "\xEF\xBF\xBD";

// Incremental UTF-8 validator. Feed bytes in any chunking; complete, valid characters are
// appended to `out` as soon as their last byte arrives, an incomplete (but still possibly
// valid) prefix is held back, and every maximal invalid subpart is replaced by U+FFFD.
class Utf8Decoder {
 public:
  // Appends the valid output for `bytes` to `out`; returns how many U+FFFD were emitted for
  // invalid input (never for a U+FFFD that was itself valid input).
  int64_t Feed(std::string_view bytes, std::string* out);
  // End of input: a held, incomplete sequence can no longer complete and becomes one U+FFFD.
  // Returns the number of U+FFFD emitted (0 or 1). The decoder is reset afterwards.
  int64_t Flush(std::string* out);
  // Bytes held back, waiting for the rest of their character (0..3).
  size_t pending_bytes() const { return pending_len_; }

 private:
  uint8_t pending_[4] = {};
  size_t pending_len_ = 0;   // bytes of the current, incomplete character
  size_t needed_ = 0;        // total length of the current character
  uint8_t lower_ = 0x80;     // allowed range of the next continuation byte
  uint8_t upper_ = 0xBF;
};

// The whole of `bytes` through a Utf8Decoder: valid input is returned unchanged.
// `replaced`, when given, receives the number of U+FFFD substituted.
std::string SanitizeUtf8(std::string_view bytes, int64_t* replaced = nullptr);

// True when `bytes` is well-formed UTF-8 (no surrogates, overlongs or values past U+10FFFF).
bool IsValidUtf8(std::string_view bytes);

// Length of the UTF-8 character whose lead byte is `lead`, assuming valid UTF-8.
inline size_t Utf8CharLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  return 4;
}

// Decodes the code point starting at `s[i]` of valid UTF-8 and advances `i` past it.
char32_t NextCodePoint(std::string_view s, size_t* i);

// Appends the UTF-8 encoding of `cp` (must be a Unicode scalar value).
void AppendUtf8(char32_t cp, std::string* out);

}  // namespace nq::tokenizer
