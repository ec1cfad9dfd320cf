#include "services/tokenizer/byte_level.h"

#include <array>

#include "services/tokenizer/utf8.h"

namespace nq::tokenizer {
namespace {

// Highest code point of the alphabet: 256 + 68 - 1.
constexpr char32_t kMaxAlphabetChar = 0x143;

struct Tables {
  std::array<char32_t, 256> byte_to_char{};
  std::array<int16_t, kMaxAlphabetChar + 1> char_to_byte{};
  std::array<std::string, 256> byte_to_utf8;

  Tables() {
    char_to_byte.fill(-1);
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_to_char[b] = printable ? static_cast<char32_t>(b) : next++;
      char_to_byte[byte_to_char[b]] = static_cast<int16_t>(b);
      AppendUtf8(byte_to_char[b], &byte_to_utf8[b]);
    }
  }
};

const Tables& GetTables() {
  static const Tables* tables = new Tables();
  return *tables;
}

}  // namespace

char32_t ByteToChar(uint8_t b) { return GetTables().byte_to_char[b]; }

void BytesToByteLevel(std::string_view bytes, std::string* out) {
  const Tables& t = GetTables();
  for (char c : bytes) out->append(t.byte_to_utf8[static_cast<uint8_t>(c)]);
}

bool ByteLevelToBytes(std::string_view token, std::string* out) {
  const Tables& t = GetTables();
  if (!IsValidUtf8(token)) return false;
  size_t i = 0;
  while (i < token.size()) {
    const char32_t cp = NextCodePoint(token, &i);
    if (cp > kMaxAlphabetChar || t.char_to_byte[cp] < 0) return false;
    out->push_back(static_cast<char>(t.char_to_byte[cp]));
  }
  return true;
}

}  // namespace nq::tokenizer
