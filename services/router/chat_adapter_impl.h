// ChatAdapter over services/chat: the model family's template and output parser.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "services/chat/chat.h"
#include "services/router/chat_adapter.h"
#include "services/router/worker_connection.h"

namespace nq::router {

// The chat format for an HF architecture ("GlmMoeDsaForCausalLM", "DeepseekV3ForCausalLM"),
// or a format name ("glm5", "deepseek_v3", or "plain": a base model's chat, see
// chat::RenderPlainChat). INVALID_ARGUMENT for anything else.
absl::StatusOr<std::unique_ptr<ChatAdapter>> MakeChatAdapter(const std::string& format_or_architecture);

// Takes the chat format from the leader worker's architecture the first time it is needed.
class AutoChatAdapter final : public ChatAdapter {
 public:
  explicit AutoChatAdapter(const WorkerConnection* worker) : worker_(worker) {}
  // UNAVAILABLE until the worker has reported its model; UNIMPLEMENTED for an architecture
  // without a chat format.
  absl::StatusOr<std::string> Render(const nq::v1::Chat& chat) const override;
  // After a successful Render; before one, a parser that passes text through as content.
  std::unique_ptr<ChatStreamParser> NewParser(const nq::v1::Chat& chat) const override;

 private:
  absl::StatusOr<const ChatAdapter*> Resolve() const;

  const WorkerConnection* const worker_;
  mutable absl::Mutex mu_;
  mutable std::unique_ptr<ChatAdapter> resolved_ ABSL_GUARDED_BY(mu_);
};

// The proto chat as the chat library's plain structs.
chat::Chat ToChat(const nq::v1::Chat& chat);

}  // namespace nq::router
