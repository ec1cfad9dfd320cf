#include "services/tokenizer/normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/locid.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>

#include <vector>

#include "services/common/status_macros.h"
#include "services/tokenizer/js_regex.h"
#include "services/tokenizer/json_fields.h"
#include "services/tokenizer/utf8.h"

namespace nq::tokenizer {
namespace {

using json_fields::Json;

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> steps) : steps_(std::move(steps)) {}
  absl::Status Normalize(std::string* text) const override {
    for (const auto& step : steps_) RETURN_IF_ERROR(step->Normalize(text));
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> steps_;
};

class UnicodeNormalizer final : public Normalizer {
 public:
  UnicodeNormalizer(const icu::Normalizer2* form, std::string name) : form_(form), name_(std::move(name)) {}
  absl::Status Normalize(std::string* text) const override {
    UErrorCode status = U_ZERO_ERROR;
    // Most text is already normalized; the quick check avoids a copy.
    if (form_->isNormalizedUTF8(*text, status) && U_SUCCESS(status)) return absl::OkStatus();
    status = U_ZERO_ERROR;
    std::string out;
    out.reserve(text->size() + text->size() / 8);
    icu::StringByteSink<std::string> sink(&out);
    form_->normalizeUTF8(0, *text, sink, nullptr, status);
    if (U_FAILURE(status)) return absl::InternalError(name_ + " normalization failed: " + u_errorName(status));
    *text = std::move(out);
    return absl::OkStatus();
  }

 private:
  const icu::Normalizer2* form_;  // owned by ICU
  std::string name_;
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(std::unique_ptr<JsRegex> pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  absl::Status Normalize(std::string* text) const override {
    std::vector<MatchSpan> matches;
    RETURN_IF_ERROR(pattern_->FindAll(*text, &matches));
    if (matches.empty()) return absl::OkStatus();
    std::string out;
    size_t prev = 0;
    for (const MatchSpan& m : matches) {
      out.append(*text, prev, m.begin - prev);
      out.append(content_);
      prev = m.end;
    }
    out.append(*text, prev);
    *text = std::move(out);
    return absl::OkStatus();
  }

 private:
  std::unique_ptr<JsRegex> pattern_;
  std::string content_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  absl::Status Normalize(std::string* text) const override {
    text->insert(0, prefix_);
    return absl::OkStatus();
  }

 private:
  std::string prefix_;
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  absl::Status Normalize(std::string* text) const override {
    std::string_view view = *text;
    if (left_) view = JsTrimStart(view);
    if (right_) view = JsTrimEnd(view);
    *text = std::string(view);
    return absl::OkStatus();
  }

 private:
  bool left_, right_;
};

class StripAccentsNormalizer final : public Normalizer {
 public:
  absl::Status Normalize(std::string* text) const override {
    // text.replace(/\p{M}/gu, ""): drop every combining mark.
    std::string out;
    out.reserve(text->size());
    size_t i = 0;
    while (i < text->size()) {
      const size_t start = i;
      const char32_t cp = NextCodePoint(*text, &i);
      if ((U_GET_GC_MASK(cp) & U_GC_M_MASK) == 0) out.append(*text, start, i - start);
    }
    *text = std::move(out);
    return absl::OkStatus();
  }
};

class LowercaseNormalizer final : public Normalizer {
 public:
  absl::Status Normalize(std::string* text) const override {
    // String.prototype.toLowerCase: Unicode default full case mapping (with Final_Sigma),
    // which is ICU's root-locale toLower.
    icu::UnicodeString s = icu::UnicodeString::fromUTF8(*text);
    s.toLower(icu::Locale::getRoot());
    text->clear();
    s.toUTF8String(*text);
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<JsRegex>> MakePattern(const Json& config, const std::string& path) {
  auto it = config.find("pattern");
  if (it == config.end() || !it->is_object()) return json_fields::Missing(path + ".pattern", "an object");
  if (auto s = it->find("String"); s != it->end() && s->is_string()) return JsRegex::Literal(s->get<std::string>());
  if (auto r = it->find("Regex"); r != it->end() && r->is_string()) return JsRegex::Compile(r->get<std::string>());
  return json_fields::Missing(path + ".pattern", "{\"String\": ...} or {\"Regex\": ...}");
}

}  // namespace

bool IsJsWhitespace(char32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0xA0: case 0x1680:
    case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000: case 0xFEFF:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

std::string_view JsTrimStart(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    size_t next = i;
    if (!IsJsWhitespace(NextCodePoint(s, &next))) break;
    i = next;
  }
  return s.substr(i);
}

std::string_view JsTrimEnd(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
    size_t next = start;
    if (!IsJsWhitespace(NextCodePoint(s, &next))) break;
    end = start;
  }
  return s.substr(0, end);
}

absl::StatusOr<std::unique_ptr<Normalizer>> MakeNormalizer(const Json& config, const std::string& path) {
  if (config.is_null()) return std::unique_ptr<Normalizer>();
  ASSIGN_OR_RETURN(const std::string type, json_fields::Type(config, path));
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, json_fields::Array(config, "normalizers", path));
    std::vector<std::unique_ptr<Normalizer>> steps;
    for (size_t i = 0; i < list->size(); ++i) {
      ASSIGN_OR_RETURN(std::unique_ptr<Normalizer> step,
                       MakeNormalizer((*list)[i], path + ".normalizers[" + std::to_string(i) + "]"));
      if (step != nullptr) steps.push_back(std::move(step));
    }
    // An empty Sequence (DeepSeek-V3's) normalizes nothing: skip the per-section copy.
    if (steps.empty()) return std::unique_ptr<Normalizer>();
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(steps)));
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    UErrorCode status = U_ZERO_ERROR;
    const icu::Normalizer2* form = type == "NFC"    ? icu::Normalizer2::getNFCInstance(status)
                                   : type == "NFD"  ? icu::Normalizer2::getNFDInstance(status)
                                   : type == "NFKC" ? icu::Normalizer2::getNFKCInstance(status)
                                                    : icu::Normalizer2::getNFKDInstance(status);
    if (U_FAILURE(status) || form == nullptr) {
      return absl::InternalError(type + " normalizer unavailable from ICU: " + u_errorName(status));
    }
    return std::unique_ptr<Normalizer>(new UnicodeNormalizer(form, type));
  }
  if (type == "Replace") {
    ASSIGN_OR_RETURN(std::unique_ptr<JsRegex> pattern, MakePattern(config, path));
    ASSIGN_OR_RETURN(std::string content, json_fields::String(config, "content", path));
    // JavaScript's replaceAll would expand $&, $1, $$ ... in the content; we substitute it
    // verbatim, so refuse a content whose meaning would differ.
    if (content.find('$') != std::string::npos) {
      return absl::UnimplementedError(path + ": Replace content with '$' (a JavaScript replacement pattern) is not supported");
    }
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(std::move(pattern), std::move(content)));
  }
  if (type == "Prepend") {
    ASSIGN_OR_RETURN(std::string prefix, json_fields::String(config, "prepend", path));
    return std::unique_ptr<Normalizer>(new PrependNormalizer(std::move(prefix)));
  }
  if (type == "Strip") {
    ASSIGN_OR_RETURN(bool left, json_fields::Bool(config, "strip_left", path, false));
    ASSIGN_OR_RETURN(bool right, json_fields::Bool(config, "strip_right", path, false));
    return std::unique_ptr<Normalizer>(new StripNormalizer(left, right));
  }
  if (type == "StripAccents") return std::unique_ptr<Normalizer>(new StripAccentsNormalizer());
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  return absl::UnimplementedError(path + ": normalizer type '" + type +
                                  "' is not supported (supported: Sequence, NFC, NFD, NFKC, NFKD, Replace, "
                                  "Prepend, Strip, StripAccents, Lowercase)");
}

}  // namespace nq::tokenizer
