#include "services/router/chat_adapter_impl.h"

#include <random>

#include "absl/strings/str_format.h"
#include "services/chat/output_parser.h"

namespace nq::router {
namespace {

ChatDelta ToDelta(const chat::StreamDelta& d) { return ChatDelta{d.content, d.reasoning}; }

class StreamParser final : public ChatStreamParser {
 public:
  StreamParser(chat::ChatFormat format, chat::ParseOptions options) : splitter_(format, std::move(options)) {}
  ChatDelta Feed(const std::string& text) override { return ToDelta(splitter_.Push(text)); }
  ChatDelta Finish() override { return ToDelta(splitter_.Finish()); }
  ParsedAssistant Result() const override {
    const chat::ParsedAssistantOutput& r = splitter_.result();
    ParsedAssistant out{r.content, r.reasoning_content, {}};
    for (const chat::ToolCall& call : r.tool_calls) {
      nq::v1::ToolCall& proto = out.tool_calls.emplace_back();
      proto.set_id(call.id);
      proto.set_name(call.name);
      proto.set_arguments_json(call.arguments_json);
    }
    return out;
  }

 private:
  chat::StreamingSplitter splitter_;
};

class Adapter final : public ChatAdapter {
 public:
  explicit Adapter(chat::ChatFormat format) : format_(format) {}

  absl::StatusOr<std::string> Render(const nq::v1::Chat& chat) const override {
    return chat::RenderChat(format_, ToChat(chat));
  }

  std::unique_ptr<ChatStreamParser> NewParser(const nq::v1::Chat& proto) const override {
    const chat::Chat chat = ToChat(proto);
    chat::ParseOptions options;
    options.starts_in_reasoning = chat::GenerationOpensReasoning(format_, chat);
    options.tools = chat.tools;
    // Tool-call ids must be unique within a conversation: a per-request prefix.
    thread_local std::mt19937_64 rng(std::random_device{}());
    options.tool_call_id_prefix = absl::StrFormat("call_%012x_", rng() & 0xffffffffffffull);
    return std::make_unique<StreamParser>(format_, std::move(options));
  }

 private:
  const chat::ChatFormat format_;
};

// Everything is content: for the plain format (whose prompt opens nothing), and when no
// format could be resolved.
class PassThroughParser final : public ChatStreamParser {
 public:
  ChatDelta Feed(const std::string& text) override {
    content_ += text;
    return ChatDelta{text, ""};
  }
  ChatDelta Finish() override { return {}; }
  ParsedAssistant Result() const override { return ParsedAssistant{content_, "", {}}; }

 private:
  std::string content_;
};

// A base model's chat (chat::RenderPlainChat): the messages' text, continued as content.
class PlainAdapter final : public ChatAdapter {
 public:
  absl::StatusOr<std::string> Render(const nq::v1::Chat& chat) const override {
    return chat::RenderPlainChat(ToChat(chat));
  }
  std::unique_ptr<ChatStreamParser> NewParser(const nq::v1::Chat&) const override {
    return std::make_unique<PassThroughParser>();
  }
};

}  // namespace

absl::StatusOr<const ChatAdapter*> AutoChatAdapter::Resolve() const {
  absl::MutexLock lock(&mu_);
  if (resolved_ != nullptr) return resolved_.get();
  std::optional<nq::v1::WorkerInfo> info = worker_->info();
  if (!info.has_value() || info->architecture().empty()) {
    return absl::UnavailableError("the worker has not reported its model yet; retry later");
  }
  absl::StatusOr<std::unique_ptr<ChatAdapter>> adapter = MakeChatAdapter(info->architecture());
  if (!adapter.ok()) {
    return absl::UnimplementedError("no chat format for architecture " + info->architecture());
  }
  resolved_ = *std::move(adapter);
  return resolved_.get();
}

absl::StatusOr<std::string> AutoChatAdapter::Render(const nq::v1::Chat& chat) const {
  absl::StatusOr<const ChatAdapter*> adapter = Resolve();
  if (!adapter.ok()) return adapter.status();
  return (*adapter)->Render(chat);
}

std::unique_ptr<ChatStreamParser> AutoChatAdapter::NewParser(const nq::v1::Chat& chat) const {
  absl::StatusOr<const ChatAdapter*> adapter = Resolve();
  if (!adapter.ok()) return std::make_unique<PassThroughParser>();
  return (*adapter)->NewParser(chat);
}

chat::Chat ToChat(const nq::v1::Chat& proto) {
  chat::Chat chat;
  for (const nq::v1::ChatMessage& m : proto.messages()) {
    chat::ChatMessage& out = chat.messages.emplace_back();
    out.role = m.role();
    out.content = m.content();
    out.reasoning_content = m.reasoning_content();
    out.tool_call_id = m.tool_call_id();
    out.name = m.name();
    for (const nq::v1::ToolCall& call : m.tool_calls()) {
      out.tool_calls.push_back(chat::ToolCall{call.id(), call.name(), call.arguments_json()});
    }
  }
  for (const nq::v1::ToolDefinition& tool : proto.tools()) {
    chat.tools.push_back(chat::ToolDefinition{tool.name(), tool.description(), tool.parameters_json()});
  }
  chat.add_generation_prompt = proto.add_generation_prompt();
  if (proto.has_enable_thinking()) chat.enable_thinking = proto.enable_thinking();
  return chat;
}

absl::StatusOr<std::unique_ptr<ChatAdapter>> MakeChatAdapter(const std::string& name) {
  if (name == "plain") return std::unique_ptr<ChatAdapter>(new PlainAdapter());
  chat::ChatFormat format;
  if (name == "glm5") {
    format = chat::ChatFormat::kGlm5;
  } else if (name == "deepseek_v3") {
    format = chat::ChatFormat::kDeepSeekV3;
  } else {
    absl::StatusOr<chat::ChatFormat> by_architecture = chat::ChatFormatForArchitecture(name);
    if (!by_architecture.ok()) {
      return absl::InvalidArgumentError("unknown chat format '" + name +
                                        "': want glm5, deepseek_v3, plain, or a supported HF architecture");
    }
    format = *by_architecture;
  }
  return std::unique_ptr<ChatAdapter>(new Adapter(format));
}

}  // namespace nq::router
