#include "services/chat/output_parser.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/chat/tool_call_parsers.h"

namespace nq::chat {
namespace {

constexpr absl::string_view kThinkOpen = "<think>";
constexpr absl::string_view kThinkClose = "</think>";

// The markers that open and close a tool-call section.
struct ToolSyntax {
  absl::string_view open;
  absl::string_view close;
};

ToolSyntax ToolSyntaxOf(ChatFormat format) {
  switch (format) {
    case ChatFormat::kGlm5: return {"<tool_call>", "</tool_call>"};
    case ChatFormat::kDeepSeekV3: return {"<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"};
  }
  return {"<tool_call>", "</tool_call>"};
}

// Length of the longest proper prefix of `marker` that `text` ends with: the bytes that must
// wait for more text before they can be called ordinary text.
size_t HeldBack(absl::string_view text, absl::string_view marker) {
  const size_t longest = std::min(text.size(), marker.size() - 1);
  for (size_t k = longest; k > 0; --k) {
    if (absl::EndsWith(text, marker.substr(0, k))) return k;
  }
  return 0;
}

}  // namespace

class StreamingSplitter::Impl {
 public:
  Impl(ChatFormat format, ParseOptions options)
      : format_(format),
        syntax_(ToolSyntaxOf(format)),
        options_(std::move(options)),
        string_parameters_(internal::CollectStringParameters(options_.tools)),
        state_(options_.starts_in_reasoning ? State::kReasoning : State::kStart) {}

  StreamDelta Push(absl::string_view text) {
    StreamDelta delta;
    if (state_ == State::kFinished) return delta;
    pending_.append(text.data(), text.size());
    Drain(/*final=*/false, delta);
    Record(delta);
    return delta;
  }

  StreamDelta Finish() {
    StreamDelta delta;
    if (state_ == State::kFinished) return delta;
    Drain(/*final=*/true, delta);
    Record(delta);
    state_ = State::kFinished;
    return delta;
  }

  const ParsedAssistantOutput& result() const { return result_; }

 private:
  enum class State {
    kStart,      // only whitespace so far: a "<think>" here opens reasoning
    kReasoning,  // inside <think> ... </think>
    kContent,
    kToolCall,  // after a tool-call open marker, waiting for its close marker
    kFinished,
  };

  // Moves decided text from pending_ into `delta`; with `final`, decides everything.
  void Drain(bool final, StreamDelta& delta) {
    while (true) {
      switch (state_) {
        case State::kStart: {
          const absl::string_view rest = absl::StripLeadingAsciiWhitespace(pending_);
          if (absl::StartsWith(rest, kThinkOpen)) {
            pending_.erase(0, pending_.size() - rest.size() + kThinkOpen.size());
            state_ = State::kReasoning;
            continue;
          }
          if (!final && rest.size() < kThinkOpen.size() && absl::StartsWith(kThinkOpen, rest)) {
            return;  // "", "<", "<th", ...: cannot tell yet
          }
          state_ = State::kContent;
          continue;
        }
        case State::kReasoning: {
          const size_t close = absl::string_view(pending_).find(kThinkClose);
          if (close != std::string::npos) {
            delta.reasoning.append(pending_, 0, close);
            pending_.erase(0, close + kThinkClose.size());
            state_ = State::kContent;
            continue;
          }
          if (final) result_.reasoning_unterminated = true;
          Emit(final ? 0 : HeldBack(pending_, kThinkClose), delta.reasoning);
          return;
        }
        case State::kContent: {
          const size_t open = absl::string_view(pending_).find(syntax_.open);
          if (open != std::string::npos) {
            delta.content.append(pending_, 0, open);
            pending_.erase(0, open + syntax_.open.size());
            state_ = State::kToolCall;
            continue;
          }
          Emit(final ? 0 : HeldBack(pending_, syntax_.open), delta.content);
          return;
        }
        case State::kToolCall: {
          const size_t close = absl::string_view(pending_).find(syntax_.close);
          if (close == std::string::npos) {
            if (final) {
              // Cut off inside a call: it is not a call; give the text back as content.
              absl::StrAppend(&delta.content, syntax_.open, pending_);
              pending_.clear();
              result_.tool_call_unterminated = true;
            }
            return;
          }
          const absl::string_view body(pending_.data(), close);
          if (!AddToolCalls(body, delta)) {
            absl::StrAppend(&delta.content, syntax_.open, body, syntax_.close);
            result_.tool_call_malformed = true;
          }
          pending_.erase(0, close + syntax_.close.size());
          state_ = State::kContent;
          continue;
        }
        case State::kFinished: return;
      }
    }
  }

  // Appends all of pending_ but its last `keep` bytes to `out`.
  void Emit(size_t keep, std::string& out) {
    out.append(pending_, 0, pending_.size() - keep);
    pending_.erase(0, pending_.size() - keep);
  }

  bool AddToolCalls(absl::string_view body, StreamDelta& delta) {
    std::vector<ToolCall> calls;
    if (format_ == ChatFormat::kGlm5) {
      std::optional<ToolCall> call = internal::ParseGlmToolCall(body, string_parameters_);
      if (!call.has_value()) return false;
      calls.push_back(*std::move(call));
    } else {
      std::optional<std::vector<ToolCall>> parsed = internal::ParseDeepSeekV3ToolCalls(body);
      if (!parsed.has_value()) return false;
      calls = *std::move(parsed);
    }
    for (ToolCall& call : calls) {
      call.id = absl::StrCat(options_.tool_call_id_prefix,
                             result_.tool_calls.size() + delta.tool_calls.size());
      delta.tool_calls.push_back(std::move(call));
    }
    return true;
  }

  void Record(const StreamDelta& delta) {
    result_.reasoning_content += delta.reasoning;
    result_.content += delta.content;
    result_.tool_calls.insert(result_.tool_calls.end(), delta.tool_calls.begin(),
                              delta.tool_calls.end());
  }

  const ChatFormat format_;
  const ToolSyntax syntax_;
  const ParseOptions options_;
  const internal::StringParameters string_parameters_;
  State state_;
  std::string pending_;  // received, not yet decided
  ParsedAssistantOutput result_;
};

StreamingSplitter::StreamingSplitter(ChatFormat format, ParseOptions options)
    : impl_(std::make_unique<Impl>(format, std::move(options))) {}
StreamingSplitter::~StreamingSplitter() = default;
StreamDelta StreamingSplitter::Push(absl::string_view text) { return impl_->Push(text); }
StreamDelta StreamingSplitter::Finish() { return impl_->Finish(); }
const ParsedAssistantOutput& StreamingSplitter::result() const { return impl_->result(); }

ParsedAssistantOutput ParseAssistantOutput(ChatFormat format, absl::string_view text,
                                           const ParseOptions& options) {
  StreamingSplitter splitter(format, options);
  splitter.Push(text);
  splitter.Finish();
  return splitter.result();
}

}  // namespace nq::chat
