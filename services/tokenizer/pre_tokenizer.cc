#include "services/tokenizer/pre_tokenizer.h"

#include <algorithm>

#include "services/common/status_macros.h"
#include "services/tokenizer/js_regex.h"
#include "services/tokenizer/json_fields.h"

namespace nq::tokenizer {
namespace {

using json_fields::Json;

// GPT-2's pattern, which ByteLevel(use_regex=true) applies (the reference's spelling).
constexpr std::string_view kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> steps) : steps_(std::move(steps)) {}
  absl::Status Split(Pieces* pieces, PieceArena* arena) const override {
    for (const auto& step : steps_) RETURN_IF_ERROR(step->Split(pieces, arena));
    return absl::OkStatus();
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> steps_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::unique_ptr<JsRegex> pattern, Behavior behavior, bool invert)
      : pattern_(std::move(pattern)), behavior_(behavior), invert_(invert) {}

  absl::Status Split(Pieces* pieces, PieceArena* arena) const override {
    Pieces out;
    out.reserve(pieces->size() * 2);
    std::vector<MatchSpan> matches;
    for (std::string_view piece : *pieces) {
      RETURN_IF_ERROR(pattern_->FindAll(piece, &matches));
      SplitOne(piece, matches, &out);
    }
    pieces->swap(out);
    return absl::OkStatus();
  }

 private:
  void SplitOne(std::string_view piece, const std::vector<MatchSpan>& matches, Pieces* out) const {
    if (behavior_ == Behavior::kIsolated) {
      // The common case (every tokenizer we serve): gaps and matches in order, no merging.
      size_t prev = 0;
      for (const MatchSpan& m : matches) {
        if (m.end == m.begin) continue;
        if (m.begin > prev) out->push_back(piece.substr(prev, m.begin - prev));
        out->push_back(piece.substr(m.begin, m.end - m.begin));
        prev = m.end;
      }
      if (prev < piece.size()) out->push_back(piece.substr(prev));
      return;
    }
    // Segments alternate gap / match; empty matches delimit nothing.
    struct Segment {
      size_t begin, end;
      bool delimiter;
    };
    std::vector<Segment> segments;
    size_t prev = 0;
    for (const MatchSpan& m : matches) {
      if (m.end == m.begin) continue;
      if (m.begin > prev) segments.push_back({prev, m.begin, invert_});
      segments.push_back({m.begin, m.end, !invert_});
      prev = m.end;
    }
    if (prev < piece.size()) segments.push_back({prev, piece.size(), invert_});

    // The Hugging Face fold for each behavior (normalizer.rs, NormalizedString::split). Pieces
    // of one split are contiguous, so merging widens a [begin, end) range.
    std::vector<std::pair<size_t, size_t>> ranges;
    bool previous_delimiter = false;
    switch (behavior_) {
      case Behavior::kRemoved:
        for (const Segment& s : segments) {
          if (!s.delimiter) ranges.push_back({s.begin, s.end});
        }
        break;
      case Behavior::kIsolated:
        for (const Segment& s : segments) ranges.push_back({s.begin, s.end});
        break;
      case Behavior::kMergedWithPrevious:
        for (const Segment& s : segments) {
          if (s.delimiter && !previous_delimiter && !ranges.empty()) {
            ranges.back().second = s.end;
          } else {
            ranges.push_back({s.begin, s.end});
          }
          previous_delimiter = s.delimiter;
        }
        break;
      case Behavior::kMergedWithNext:
        // The same fold from the right.
        for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
          if (it->delimiter && !previous_delimiter && !ranges.empty()) {
            ranges.back().first = it->begin;
          } else {
            ranges.push_back({it->begin, it->end});
          }
          previous_delimiter = it->delimiter;
        }
        std::reverse(ranges.begin(), ranges.end());
        break;
      case Behavior::kContiguous:
        for (const Segment& s : segments) {
          if (s.delimiter == previous_delimiter && !ranges.empty()) {
            ranges.back().second = s.end;
          } else {
            ranges.push_back({s.begin, s.end});
          }
          previous_delimiter = s.delimiter;
        }
        break;
    }
    for (const auto& [begin, end] : ranges) out->push_back(piece.substr(begin, end - begin));
  }

  std::unique_ptr<JsRegex> pattern_;
  Behavior behavior_;
  bool invert_;
};

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::unique_ptr<JsRegex> gpt2)
      : add_prefix_space_(add_prefix_space), gpt2_(std::move(gpt2)) {}

  absl::Status Split(Pieces* pieces, PieceArena* arena) const override {
    // The byte mapping itself happens in the model, which works on raw bytes. What remains:
    // the optional prefix space (every piece, as the reference applies it per piece) and the
    // optional GPT-2 split (`text.match(pattern)`: the matches, and nothing between them).
    if (add_prefix_space_) {
      for (std::string_view& piece : *pieces) {
        if (piece.empty() || piece.front() != ' ') {
          arena->push_back(" " + std::string(piece));
          piece = arena->back();
        }
      }
    }
    if (gpt2_ == nullptr) return absl::OkStatus();
    Pieces out;
    out.reserve(pieces->size() * 2);
    std::vector<MatchSpan> matches;
    for (std::string_view piece : *pieces) {
      RETURN_IF_ERROR(gpt2_->FindAll(piece, &matches));
      for (const MatchSpan& m : matches) {
        if (m.end > m.begin) out.push_back(piece.substr(m.begin, m.end - m.begin));
      }
    }
    pieces->swap(out);
    return absl::OkStatus();
  }

 private:
  bool add_prefix_space_;
  std::unique_ptr<JsRegex> gpt2_;  // null when use_regex is false
};

class DigitsPreTokenizer final : public PreTokenizer {
 public:
  explicit DigitsPreTokenizer(bool individual) : individual_(individual) {}
  absl::Status Split(Pieces* pieces, PieceArena* arena) const override {
    // `[^\d]+|\d+` (or `\d` each with individual_digits); \d is ASCII in JavaScript and in the
    // Hugging Face implementation alike.
    Pieces out;
    out.reserve(pieces->size() * 2);
    for (std::string_view piece : *pieces) {
      size_t i = 0;
      while (i < piece.size()) {
        const bool digit = piece[i] >= '0' && piece[i] <= '9';
        size_t j = i + 1;
        if (!digit || !individual_) {
          while (j < piece.size() && ((piece[j] >= '0' && piece[j] <= '9') == digit)) ++j;
        }
        out.push_back(piece.substr(i, j - i));
        i = j;
      }
    }
    pieces->swap(out);
    return absl::OkStatus();
  }

 private:
  bool individual_;
};

absl::StatusOr<std::unique_ptr<JsRegex>> SplitPattern(const Json& config, const std::string& path) {
  auto it = config.find("pattern");
  if (it == config.end() || !it->is_object()) return json_fields::Missing(path + ".pattern", "an object");
  if (auto s = it->find("String"); s != it->end() && s->is_string()) return JsRegex::Literal(s->get<std::string>());
  if (auto r = it->find("Regex"); r != it->end() && r->is_string()) {
    absl::StatusOr<std::unique_ptr<JsRegex>> regex = JsRegex::Compile(r->get<std::string>());
    if (!regex.ok()) return Annotate(regex.status(), path);
    return regex;
  }
  return json_fields::Missing(path + ".pattern", "{\"String\": ...} or {\"Regex\": ...}");
}

absl::StatusOr<Behavior> ParseBehavior(const std::string& name, const std::string& path) {
  if (name == "Removed") return Behavior::kRemoved;
  if (name == "Isolated") return Behavior::kIsolated;
  if (name == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return Behavior::kMergedWithNext;
  if (name == "Contiguous") return Behavior::kContiguous;
  return absl::InvalidArgumentError("tokenizer.json: " + path + ".behavior '" + name +
                                    "' is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, "
                                    "Contiguous");
}

// Builds one step; `*byte_level` reports whether it (or its last sub-step) is ByteLevel.
absl::StatusOr<std::unique_ptr<PreTokenizer>> Make(const Json& config, const std::string& path, bool* byte_level) {
  *byte_level = false;
  ASSIGN_OR_RETURN(const std::string type, json_fields::Type(config, path));
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, json_fields::Array(config, "pretokenizers", path));
    std::vector<std::unique_ptr<PreTokenizer>> steps;
    for (size_t i = 0; i < list->size(); ++i) {
      if (*byte_level) {
        return absl::UnimplementedError(path + ": a pre-tokenizer after ByteLevel is not supported "
                                        "(ByteLevel must be the last step)");
      }
      ASSIGN_OR_RETURN(std::unique_ptr<PreTokenizer> step,
                       Make((*list)[i], path + ".pretokenizers[" + std::to_string(i) + "]", byte_level));
      steps.push_back(std::move(step));
    }
    return std::unique_ptr<PreTokenizer>(new SequencePreTokenizer(std::move(steps)));
  }
  if (type == "Split") {
    ASSIGN_OR_RETURN(std::unique_ptr<JsRegex> pattern, SplitPattern(config, path));
    ASSIGN_OR_RETURN(std::string behavior_name, json_fields::String(config, "behavior", path));
    ASSIGN_OR_RETURN(Behavior behavior, ParseBehavior(behavior_name, path));
    ASSIGN_OR_RETURN(bool invert, json_fields::Bool(config, "invert", path, false));
    return std::unique_ptr<PreTokenizer>(new SplitPreTokenizer(std::move(pattern), behavior, invert));
  }
  if (type == "ByteLevel") {
    ASSIGN_OR_RETURN(bool add_prefix_space, json_fields::Bool(config, "add_prefix_space", path, false));
    ASSIGN_OR_RETURN(bool use_regex, json_fields::Bool(config, "use_regex", path, true));
    std::unique_ptr<JsRegex> gpt2;
    if (use_regex) {
      ASSIGN_OR_RETURN(gpt2, JsRegex::Compile(kGpt2Pattern));
    }
    *byte_level = true;
    return std::unique_ptr<PreTokenizer>(new ByteLevelPreTokenizer(add_prefix_space, std::move(gpt2)));
  }
  if (type == "Digits") {
    ASSIGN_OR_RETURN(bool individual, json_fields::Bool(config, "individual_digits", path, false));
    return std::unique_ptr<PreTokenizer>(new DigitsPreTokenizer(individual));
  }
  return absl::UnimplementedError(path + ": pre-tokenizer type '" + type +
                                  "' is not supported (supported: Sequence, Split, ByteLevel, Digits)");
}

}  // namespace

absl::StatusOr<PreTokenizerConfig> MakePreTokenizer(const Json& config) {
  PreTokenizerConfig result;
  if (config.is_null()) return result;
  ASSIGN_OR_RETURN(result.pre_tokenizer, Make(config, "pre_tokenizer", &result.byte_level));
  return result;
}

}  // namespace nq::tokenizer
