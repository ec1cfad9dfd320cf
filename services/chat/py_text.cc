#include "services/chat/py_text.h"

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <system_error>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace nq::chat {
namespace {

// Python's repr(float) switches to the exponent form when the decimal point would sit at or
// before 4 places left of the first digit, or more than 16 places right of it
// (CPython Python/pystrtod.c, format_float_short, type 'r').
constexpr int kReprMinDecimalPoint = -4;
constexpr int kReprMaxDecimalPoint = 16;

void AppendPyJsonString(const std::string& s, std::string& out) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out.push_back(kHex[c >> 4]);
          out.push_back(kHex[c & 0xf]);
        } else {
          out.push_back(ch);  // ensure_ascii=False: UTF-8 passes through
        }
    }
  }
  out.push_back('"');
}

void AppendPyJson(const Json& v, std::string& out) {
  switch (v.type()) {
    case Json::value_t::null: out += "null"; return;
    case Json::value_t::boolean: out += v.get<bool>() ? "true" : "false"; return;
    case Json::value_t::number_integer: out += std::to_string(v.get<std::int64_t>()); return;
    case Json::value_t::number_unsigned: out += std::to_string(v.get<std::uint64_t>()); return;
    case Json::value_t::number_float: out += PyFloatRepr(v.get<double>()); return;
    case Json::value_t::string: AppendPyJsonString(v.get_ref<const std::string&>(), out); return;
    case Json::value_t::array: {
      out.push_back('[');
      bool first = true;
      for (const Json& item : v) {
        if (!first) out += ", ";
        first = false;
        AppendPyJson(item, out);
      }
      out.push_back(']');
      return;
    }
    case Json::value_t::object: {
      out.push_back('{');
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) out += ", ";
        first = false;
        AppendPyJsonString(it.key(), out);
        out += ": ";
        AppendPyJson(it.value(), out);
      }
      out.push_back('}');
      return;
    }
    case Json::value_t::binary:
    case Json::value_t::discarded: break;  // ParseJson never produces these
  }
  out += "null";
}

// Decodes the UTF-8 code point starting at s[i]; sets `len` to its byte length (1 for a
// malformed byte, which then counts as a non-space character).
char32_t DecodeAt(absl::string_view s, size_t i, size_t& len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  int n = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xe ? 3 : (b0 >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > s.size()) {
    len = 1;
    return 0xfffd;
  }
  char32_t cp = n == 1 ? b0 : n == 2 ? (b0 & 0x1f) : n == 3 ? (b0 & 0x0f) : (b0 & 0x07);
  for (int k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xc0) != 0x80) {
      len = 1;
      return 0xfffd;
    }
    cp = (cp << 6) | (b & 0x3f);
  }
  len = n;
  return cp;
}

// str.isspace() (CPython's _Py_ascii_whitespace plus Py_UNICODE_ISSPACE's non-ASCII set).
bool IsPySpace(char32_t c) {
  if (c <= 0x7f) return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20);
  return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 ||
         c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

}  // namespace

absl::StatusOr<Json> ParseJson(absl::string_view text) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(e.what());
  }
}

std::string PyJsonDumps(const Json& value) {
  std::string out;
  AppendPyJson(value, out);
  return out;
}

std::string PyFloatRepr(double value) {
  // Shortest round-trip digits, as d.ddde±X; then laid out the way repr does.
  char buf[64];
  const auto [end, ec] =
      std::to_chars(buf, buf + sizeof(buf), value, std::chars_format::scientific);
  if (ec != std::errc()) return "nan";  // cannot happen for a finite double in 64 bytes
  std::string_view sci(buf, end - buf);
  std::string out;
  if (!sci.empty() && sci.front() == '-') {
    out.push_back('-');
    sci.remove_prefix(1);
  }
  const size_t e_pos = sci.find('e');
  std::string digits;
  for (const char c : sci.substr(0, e_pos)) {
    if (c != '.') digits.push_back(c);
  }
  const int exponent = std::atoi(std::string(sci.substr(e_pos + 1)).c_str());
  const int decimal_point = exponent + 1;  // digits are d1 d2 ... with the point after d<dp>
  const int k = static_cast<int>(digits.size());
  if (decimal_point <= kReprMinDecimalPoint || decimal_point > kReprMaxDecimalPoint) {
    out.push_back(digits[0]);
    if (k > 1) absl::StrAppend(&out, ".", digits.substr(1));
    const int e = decimal_point - 1;
    absl::StrAppend(&out, "e", e < 0 ? "-" : "+", (std::abs(e) < 10 ? "0" : ""), std::abs(e));
  } else if (decimal_point <= 0) {
    absl::StrAppend(&out, "0.", std::string(-decimal_point, '0'), digits);
  } else if (decimal_point >= k) {
    absl::StrAppend(&out, digits, std::string(decimal_point - k, '0'), ".0");
  } else {
    absl::StrAppend(&out, digits.substr(0, decimal_point), ".", digits.substr(decimal_point));
  }
  return out;
}

std::string PyStrip(absl::string_view text) {
  size_t begin = 0;
  while (begin < text.size()) {
    size_t len = 0;
    if (!IsPySpace(DecodeAt(text, begin, len))) break;
    begin += len;
  }
  size_t end = text.size();
  while (end > begin) {
    size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(text[start]) & 0xc0) == 0x80) --start;
    size_t len = 0;
    const char32_t cp = DecodeAt(text, start, len);
    if (start + len != end || !IsPySpace(cp)) break;
    end = start;
  }
  return std::string(text.substr(begin, end - begin));
}

absl::string_view PyLStripChars(absl::string_view text, absl::string_view chars) {
  const size_t pos = text.find_first_not_of(chars);
  return pos == absl::string_view::npos ? absl::string_view() : text.substr(pos);
}

absl::string_view PyRStripChars(absl::string_view text, absl::string_view chars) {
  const size_t pos = text.find_last_not_of(chars);
  return pos == absl::string_view::npos ? absl::string_view() : text.substr(0, pos + 1);
}

std::vector<absl::string_view> PySplit(absl::string_view text, absl::string_view separator) {
  std::vector<absl::string_view> parts;
  size_t start = 0;
  while (true) {
    const size_t pos = text.find(separator, start);
    if (pos == absl::string_view::npos) break;
    parts.push_back(text.substr(start, pos - start));
    start = pos + separator.size();
  }
  parts.push_back(text.substr(start));
  return parts;
}

}  // namespace nq::chat
