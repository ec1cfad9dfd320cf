#include "services/tokenizer/utf8.h"

namespace nq::tokenizer {

int64_t Utf8Decoder::Feed(std::string_view bytes, std::string* out) {
  int64_t replaced = 0;
  size_t i = 0;
  const size_t n = bytes.size();
  while (i < n) {
    const uint8_t b = static_cast<uint8_t>(bytes[i]);
    if (needed_ == 0) {
      // Fast path: copy a run of ASCII at once.
      if (b < 0x80) {
        size_t j = i + 1;
        while (j < n && static_cast<uint8_t>(bytes[j]) < 0x80) ++j;
        out->append(bytes.data() + i, j - i);
        i = j;
        continue;
      }
      // Lead byte: the ranges of Unicode Table 3-7 (well-formed UTF-8 byte sequences).
      lower_ = 0x80;
      upper_ = 0xBF;
      if (b >= 0xC2 && b <= 0xDF) {
        needed_ = 2;
      } else if (b >= 0xE0 && b <= 0xEF) {
        needed_ = 3;
        if (b == 0xE0) lower_ = 0xA0;  // no overlongs
        if (b == 0xED) upper_ = 0x9F;  // no surrogates
      } else if (b >= 0xF0 && b <= 0xF4) {
        needed_ = 4;
        if (b == 0xF0) lower_ = 0x90;  // no overlongs
        if (b == 0xF4) upper_ = 0x8F;  // nothing past U+10FFFF
      } else {
        // 80..C1 and F5..FF can never start a character.
        out->append(kReplacementUtf8);
        ++replaced;
        ++i;
        continue;
      }
      pending_[0] = b;
      pending_len_ = 1;
      ++i;
      continue;
    }
    if (b < lower_ || b > upper_) {
      // The held prefix is a maximal subpart; `b` is examined again as a possible lead byte.
      out->append(kReplacementUtf8);
      ++replaced;
      needed_ = 0;
      pending_len_ = 0;
      continue;
    }
    lower_ = 0x80;
    upper_ = 0xBF;
    pending_[pending_len_++] = b;
    ++i;
    if (pending_len_ == needed_) {
      out->append(reinterpret_cast<const char*>(pending_), pending_len_);
      needed_ = 0;
      pending_len_ = 0;
    }
  }
  return replaced;
}

int64_t Utf8Decoder::Flush(std::string* out) {
  if (needed_ == 0) return 0;
  out->append(kReplacementUtf8);
  needed_ = 0;
  pending_len_ = 0;
  lower_ = 0x80;
  upper_ = 0xBF;
  return 1;
}

std::string SanitizeUtf8(std::string_view bytes, int64_t* replaced) {
  std::string out;
  out.reserve(bytes.size());
  Utf8Decoder decoder;
  int64_t count = decoder.Feed(bytes, &out);
  count += decoder.Flush(&out);
  if (replaced != nullptr) *replaced = count;
  return out;
}

bool IsValidUtf8(std::string_view bytes) {
  // Validation is the decoder without output; ASCII runs dominate real text.
  size_t i = 0;
  const size_t n = bytes.size();
  while (i < n) {
    const uint8_t b = static_cast<uint8_t>(bytes[i]);
    if (b < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint8_t lower = 0x80, upper = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lower = 0xA0;
      if (b == 0xED) upper = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lower = 0x90;
      if (b == 0xF4) upper = 0x8F;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      const uint8_t c = static_cast<uint8_t>(bytes[i + k]);
      if (c < lower || c > upper) return false;
      lower = 0x80;
      upper = 0xBF;
    }
    i += len;
  }
  return true;
}

char32_t NextCodePoint(std::string_view s, size_t* i) {
  const uint8_t b0 = static_cast<uint8_t>(s[*i]);
  const size_t len = Utf8CharLength(b0);
  char32_t cp;
  switch (len) {
    case 1:
      cp = b0;
      break;
    case 2:
      cp = ((b0 & 0x1Fu) << 6) | (static_cast<uint8_t>(s[*i + 1]) & 0x3Fu);
      break;
    case 3:
      cp = ((b0 & 0x0Fu) << 12) | ((static_cast<uint8_t>(s[*i + 1]) & 0x3Fu) << 6) |
           (static_cast<uint8_t>(s[*i + 2]) & 0x3Fu);
      break;
    default:
      cp = ((b0 & 0x07u) << 18) | ((static_cast<uint8_t>(s[*i + 1]) & 0x3Fu) << 12) |
           ((static_cast<uint8_t>(s[*i + 2]) & 0x3Fu) << 6) | (static_cast<uint8_t>(s[*i + 3]) & 0x3Fu);
      break;
  }
  *i += len;
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace nq::tokenizer
