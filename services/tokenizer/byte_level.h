// GPT-2's byte-level alphabet: every byte 0..255 is shown as one printable code point so that
// BPE vocabularies can be stored as text. Printable Latin-1 bytes (! .. ~, ¡ .. ¬, ® .. ÿ) map
// to themselves; the other 68 bytes map, in byte order, to U+0100 .. U+0143.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace nq::tokenizer {

// The code point that shows byte `b`.
char32_t ByteToChar(uint8_t b);

// Appends the alphabet form (UTF-8) of raw `bytes`.
void BytesToByteLevel(std::string_view bytes, std::string* out);

// Turns a token in the byte-level alphabet back into its raw bytes. Returns false (and leaves
// `out` unspecified) when `token` holds a character outside the alphabet.
bool ByteLevelToBytes(std::string_view token, std::string* out);

}  // namespace nq::tokenizer
