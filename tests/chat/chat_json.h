// Test helpers: the chat schema of scripts/chat/conversations.json as nq::chat structs.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "services/chat/chat.h"

namespace nq::chat::testing {

using Json = nlohmann::ordered_json;

// Reads a JSON file; fails the calling test (ADD_FAILURE) and returns null when it cannot.
Json LoadJsonFile(const std::string& path);

// {"messages": [...], "tools": [...], "add_generation_prompt": b, "enable_thinking"?: b}
Chat ChatFromJson(const Json& chat);

}  // namespace nq::chat::testing
