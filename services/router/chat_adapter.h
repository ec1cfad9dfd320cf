// What the router needs from a model family's chat format: the prompt a chat renders to, and
// the assistant output split back into content, reasoning and tool calls, also while it
// streams. Implemented over services/chat (chat_adapter.cc).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nq/v1/inference.pb.h"

namespace nq::router {

struct ChatDelta {
  std::string content;
  std::string reasoning;
};

struct ParsedAssistant {
  std::string content;
  std::string reasoning;
  std::vector<nq::v1::ToolCall> tool_calls;
};

// Splits streamed assistant text into reasoning and content deltas; text that may start a
// tool call is held until it can be decided.
class ChatStreamParser {
 public:
  virtual ~ChatStreamParser() = default;
  virtual ChatDelta Feed(const std::string& text) = 0;
  // The end of the output: what was held, and the complete parse (tool calls included).
  virtual ChatDelta Finish() = 0;
  virtual ParsedAssistant Result() const = 0;
};

class ChatAdapter {
 public:
  virtual ~ChatAdapter() = default;
  // INVALID_ARGUMENT for a conversation the template refuses.
  virtual absl::StatusOr<std::string> Render(const nq::v1::Chat& chat) const = 0;
  // `thinking`: whether the rendered prompt opened a reasoning block (the output then starts
  // inside it).
  virtual std::unique_ptr<ChatStreamParser> NewParser(const nq::v1::Chat& chat) const = 0;
};

}  // namespace nq::router
