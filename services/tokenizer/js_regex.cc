#include "services/tokenizer/js_regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstdio>

#include "services/tokenizer/utf8.h"

namespace nq::tokenizer {
namespace {

// JavaScript's \s (ECMA-262 WhiteSpace + LineTerminator) as the body of a PCRE2 class.
constexpr std::string_view kJsSpaceClassBody =
    "\\t\\n\\x{0B}\\f\\r \\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}\\x{FEFF}";

// JavaScript's `.` without the `s` flag.
constexpr std::string_view kJsDot = "[^\\n\\r\\x{2028}\\x{2029}]";

// A JIT stack larger than PCRE2's 32 KiB default: long pieces (a page of spaces, a CJK run)
// backtrack deeply through lookaheads.
constexpr size_t kJitStackStart = 32 * 1024;
constexpr size_t kJitStackMax = 8 * 1024 * 1024;

std::string PcreError(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// Per-thread match state: match data and a JIT stack may not be shared between threads.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;

  ThreadMatchState() {
    // One pair suffices: only the whole match is read (rc 0 means "more groups than pairs").
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(kJitStackStart, kJitStackMax, nullptr);
    if (context != nullptr && jit_stack != nullptr) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& MatchState() {
  thread_local ThreadMatchState state;
  return state;
}

bool IsHex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
uint32_t HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return c - 'A' + 10;
}

void ReplaceAll(std::string* s, std::string_view from, std::string_view to) {
  size_t pos = 0;
  while ((pos = s->find(from, pos)) != std::string::npos) {
    s->replace(pos, from.size(), to);
    pos += to.size();
  }
}

}  // namespace

std::string ApplyReferenceRewrites(std::string_view pattern) {
  // pattern.Regex.replace(/\\([#&~])/g, "$1"): drop a backslash before #, & or ~.
  std::string out;
  out.reserve(pattern.size());
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\' && i + 1 < pattern.size() &&
        (pattern[i + 1] == '#' || pattern[i + 1] == '&' || pattern[i + 1] == '~')) {
      out.push_back(pattern[++i]);
      continue;
    }
    out.push_back(pattern[i]);
  }
  // PROBLEMATIC_REGEX_MAP: the case-insensitive contraction group, spelled out (JavaScript has
  // no inline modifiers); and the Bloom pre-tokenizer's class.
  ReplaceAll(&out, "(?i:'s|'t|'re|'ve|'m|'ll|'d)", "(?:'([sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD]))");
  const std::string bloom_chars = ".,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c";
  ReplaceAll(&out, " ?[^(\\s|[" + bloom_chars + "])]+", " ?[^\\s" + bloom_chars + "]+");
  return out;
}

absl::StatusOr<std::string> TranslateJsPattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  size_t i = 0;
  // Parses \uXXXX or \u{X..} whose 'u' is at p[at]; sets *next past it.
  auto parse_u_escape = [&](size_t at, size_t* next, uint32_t* cp) -> bool {
    if (at + 1 < p.size() && p[at + 1] == '{') {
      size_t j = at + 2;
      uint32_t v = 0;
      while (j < p.size() && IsHex(p[j]) && v <= 0x10FFFF) v = v * 16 + HexValue(p[j++]);
      if (j >= p.size() || p[j] != '}' || j == at + 2 || v > 0x10FFFF) return false;
      *cp = v;
      *next = j + 1;
      return true;
    }
    if (at + 4 >= p.size()) return false;
    uint32_t v = 0;
    for (size_t k = 1; k <= 4; ++k) {
      if (!IsHex(p[at + k])) return false;
      v = v * 16 + HexValue(p[at + k]);
    }
    *cp = v;
    *next = at + 5;
    return true;
  };
  while (i < p.size()) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) return absl::InvalidArgumentError("regex ends with a lone backslash");
      const char e = p[i + 1];
      if (e == 's') {
        if (in_class) {
          out.append(kJsSpaceClassBody);
        } else {
          out.append("[").append(kJsSpaceClassBody).append("]");
        }
        i += 2;
        continue;
      }
      if (e == 'S') {
        if (in_class) return absl::UnimplementedError("\\S inside a character class is not supported");
        out.append("[^").append(kJsSpaceClassBody).append("]");
        i += 2;
        continue;
      }
      if (e == 'u') {
        uint32_t cp = 0;
        size_t next = 0;
        if (!parse_u_escape(i + 1, &next, &cp)) return absl::InvalidArgumentError("malformed \\u escape in regex");
        // A surrogate pair written as two escapes is one code point in u-mode.
        if (cp >= 0xD800 && cp <= 0xDBFF && next + 1 < p.size() && p[next] == '\\' && p[next + 1] == 'u') {
          uint32_t low = 0;
          size_t after = 0;
          if (parse_u_escape(next + 1, &after, &low) && low >= 0xDC00 && low <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            next = after;
          }
        }
        if (cp >= 0xD800 && cp <= 0xDFFF) return absl::UnimplementedError("lone surrogate escape in regex");
        char buffer[16];
        std::snprintf(buffer, sizeof(buffer), "\\x{%X}", cp);
        out.append(buffer);
        i = next;
        continue;
      }
      // Every other escape means the same in both dialects (\d \w \b ASCII without UCP,
      // \p{..}, \n, \t, \xHH, escaped punctuation). Copy the escaped character whole.
      out.push_back('\\');
      const size_t len = Utf8CharLength(static_cast<uint8_t>(e));
      out.append(p.substr(i + 1, len));
      i += 1 + len;
      continue;
    }
    if (in_class) {
      if (c == ']') in_class = false;
      out.push_back(c);
      ++i;
      continue;
    }
    if (c == '[') {
      // JavaScript's `[]` matches nothing and `[^]` anything; in PCRE2 a leading ] is literal.
      if (p.substr(i, 2) == "[]") {
        out.append("(?!)");
        i += 2;
        continue;
      }
      if (p.substr(i, 3) == "[^]") {
        out.append("(?s:.)");
        i += 3;
        continue;
      }
      in_class = true;
      out.push_back(c);
      ++i;
      if (i < p.size() && p[i] == '^') out.push_back(p[i++]);
      continue;
    }
    if (c == '.') {
      out.append(kJsDot);
      ++i;
      continue;
    }
    out.push_back(c);
    ++i;
  }
  return out;
}

absl::StatusOr<std::unique_ptr<JsRegex>> JsRegex::Compile(std::string_view pattern) {
  const std::string rewritten = ApplyReferenceRewrites(pattern);
  absl::StatusOr<std::string> translated = TranslateJsPattern(rewritten);
  if (!translated.ok()) {
    return absl::Status(translated.status().code(),
                        "regex '" + std::string(pattern) + "': " + std::string(translated.status().message()));
  }
  std::unique_ptr<JsRegex> regex(new JsRegex());
  regex->translated_ = *std::move(translated);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(regex->translated_.data()),
                                   regex->translated_.size(), PCRE2_UTF | PCRE2_DOLLAR_ENDONLY,
                                   &error_code, &error_offset, nullptr);
  if (code == nullptr) {
    return absl::InvalidArgumentError("regex '" + std::string(pattern) + "' does not compile (as '" +
                                      regex->translated_ + "' at offset " + std::to_string(error_offset) +
                                      "): " + PcreError(error_code));
  }
  regex->code_ = code;
  // JIT is an optimisation: without it (unsupported CPU, no executable memory) the
  // interpreter gives the same matches.
  regex->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
  return regex;
}

std::unique_ptr<JsRegex> JsRegex::Literal(std::string_view text) {
  std::unique_ptr<JsRegex> regex(new JsRegex());
  regex->literal_ = std::string(text);
  return regex;
}

JsRegex::~JsRegex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

absl::Status JsRegex::FindAll(std::string_view subject, std::vector<MatchSpan>* matches) const {
  matches->clear();
  if (code_ == nullptr) {
    // A literal pattern is `new RegExp(escapeRegExp(text), "gu")`; an empty one matches
    // (emptily) at every code point boundary.
    size_t pos = 0;
    while (pos <= subject.size()) {
      const size_t found = subject.find(literal_, pos);
      if (found == std::string_view::npos) break;
      matches->push_back({found, found + literal_.size()});
      if (literal_.empty()) {
        if (found >= subject.size()) break;
        pos = found + Utf8CharLength(static_cast<uint8_t>(subject[found]));
      } else {
        pos = found + literal_.size();
      }
    }
    return absl::OkStatus();
  }
  ThreadMatchState& state = MatchState();
  if (state.data == nullptr || state.context == nullptr) return absl::ResourceExhaustedError("cannot allocate regex match state");
  const auto* code = static_cast<const pcre2_code*>(code_);
  const auto* data = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t pos = 0;
  while (pos <= subject.size()) {
    // The input was validated (or sanitised) before it got here.
    const int rc = pcre2_match(code, data, subject.size(), pos, PCRE2_NO_UTF_CHECK, state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) return absl::ResourceExhaustedError("regex match failed: " + PcreError(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const size_t begin = ovector[0], end = ovector[1];
    matches->push_back({begin, end});
    if (end == begin) {
      // lastIndex = AdvanceStringIndex(S, lastIndex, fullUnicode): one code point on.
      if (end >= subject.size()) break;
      pos = end + Utf8CharLength(static_cast<uint8_t>(subject[end]));
    } else {
      pos = end;
    }
  }
  return absl::OkStatus();
}

}  // namespace nq::tokenizer
