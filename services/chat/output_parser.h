// Splitting the model's output into reasoning, content and OpenAI tool calls, whole or as it
// streams.
//
// GLM-5:       [reasoning</think>]content<tool_call>NAME<arg_key>K</arg_key>
//              <arg_value>V</arg_value>...</tool_call>...   (the prompt "<|assistant|><think>"
//              opened the reasoning; values that are not strings were written as JSON)
// DeepSeek-V3: content<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//              ```json ARGS ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
// Both: an output that starts (after whitespace) with "<think>" opens a reasoning block too.
//
// The router strips stop tokens before the text gets here; the markers above are special
// tokens and must be detokenized, not skipped.
//
// Contract between the two entry points: ParseAssistantOutput(text) equals what a
// StreamingSplitter reports for the same text cut into any chunks: its content deltas
// concatenate to `content`, its reasoning deltas to `reasoning_content`, its tool calls are
// `tool_calls`. Truncated output (max_tokens) is tolerated: reasoning whose "</think>" never
// came stays reasoning (it was streamed as such) with `reasoning_unterminated`; a tool call
// that never closed, or one that closed but does not parse, goes to content verbatim, flagged.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "services/chat/chat.h"

namespace nq::chat {

struct ParseOptions {
  // The prompt ended inside a reasoning block (GenerationOpensReasoning).
  bool starts_in_reasoning = false;
  // Tool call ids are this prefix and the call's index in the output (0, 1, ...). The router
  // passes one unique per request ("call_<request id>_").
  std::string tool_call_id_prefix = "call_";
  // The request's tools. GLM writes string values raw, so a value that reads as JSON ("42",
  // "true") is ambiguous; a parameter the schema types as "string" keeps it a string.
  std::vector<ToolDefinition> tools;
};

struct ParsedAssistantOutput {
  std::string content;
  std::string reasoning_content;
  std::vector<ToolCall> tool_calls;     // arguments_json: a compact JSON object
  bool reasoning_unterminated = false;  // "</think>" never came
  bool tool_call_unterminated = false;  // a tool call never closed; its text is in content
  bool tool_call_malformed = false;     // a closed tool call did not parse; text in content
};

ParsedAssistantOutput ParseAssistantOutput(ChatFormat format, absl::string_view text,
                                           const ParseOptions& options = {});

// What one Push (or Finish) lets the router send.
struct StreamDelta {
  std::string reasoning;
  std::string content;
  std::vector<ToolCall> tool_calls;  // calls completed by this text
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

// Separates reasoning from content as text arrives, and withholds text that may be the
// start of a marker ("</think>", "<tool_call>", ...) until the next text decides it. A tool
// call is withheld whole and reported once it closes. Not thread-safe.
class StreamingSplitter {
 public:
  StreamingSplitter(ChatFormat format, ParseOptions options);
  ~StreamingSplitter();
  StreamingSplitter(const StreamingSplitter&) = delete;
  StreamingSplitter& operator=(const StreamingSplitter&) = delete;

  // Feeds the next text (whole UTF-8 characters, as the router's detokenizer emits them).
  StreamDelta Push(absl::string_view text);
  // The output ended: releases what was withheld. Push must not be called afterwards.
  StreamDelta Finish();
  // Everything reported so far, with the truncation flags (complete after Finish).
  const ParsedAssistantOutput& result() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nq::chat
