// The per-family template transcriptions behind RenderChat. Each takes a chat that
// ValidateChat accepted and renders exactly what its Jinja template renders.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "services/chat/chat.h"

namespace nq::chat::internal {

// scripts/chat/templates/glm5.jinja. Fails only on tool-call arguments that are not a JSON
// object and tool parameters that are not JSON.
absl::StatusOr<std::string> RenderGlm5(const Chat& chat);

// scripts/chat/templates/deepseek_v3.jinja.
std::string RenderDeepSeekV3(const Chat& chat);

}  // namespace nq::chat::internal
