#include "tests/chat/chat_json.h"

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

namespace nq::chat::testing {

Json LoadJsonFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    ADD_FAILURE() << "cannot open " << path;
    return Json();
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  Json json = Json::parse(buffer.str(), nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) {
    ADD_FAILURE() << path << " is not valid JSON";
    return Json();
  }
  return json;
}

Chat ChatFromJson(const Json& chat) {
  Chat out;
  for (const Json& m : chat.at("messages")) {
    ChatMessage message;
    message.role = m.at("role").get<std::string>();
    message.content = m.value("content", "");
    message.reasoning_content = m.value("reasoning_content", "");
    message.tool_call_id = m.value("tool_call_id", "");
    message.name = m.value("name", "");
    for (const Json& c : m.value("tool_calls", Json::array())) {
      message.tool_calls.push_back(ToolCall{c.value("id", ""), c.at("name").get<std::string>(),
                                            c.at("arguments_json").get<std::string>()});
    }
    out.messages.push_back(std::move(message));
  }
  for (const Json& t : chat.value("tools", Json::array())) {
    out.tools.push_back(ToolDefinition{t.at("name").get<std::string>(), t.value("description", ""),
                                       t.value("parameters_json", "")});
  }
  out.add_generation_prompt = chat.at("add_generation_prompt").get<bool>();
  if (chat.contains("enable_thinking")) out.enable_thinking = chat["enable_thinking"].get<bool>();
  return out;
}

}  // namespace nq::chat::testing
