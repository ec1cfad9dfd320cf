// libFuzzer target for OpenAI request bodies (scripts/fuzz.sh openai_request).
//
// Every HTTP client reaches these parsers before anything else, so on any body they must return
// a Status naming what is wrong (the 400 the client gets) without crashing or tripping a
// sanitizer, and a request they accept must be one the generator can run: a prompt (text or
// ids, or a conversation), sampling values inside their documented ranges. The first input
// byte picks /v1/completions or /v1/chat/completions.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_require.h"
#include "services/router/openai_request.h"

using nq::fuzz::Require;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const bool chat = data[0] % 2 == 1;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  const absl::StatusOr<nq::router::OpenAiRequest> request =
      chat ? nq::router::ParseChatRequest(body) : nq::router::ParseCompletionRequest(body);
  if (!request.ok()) {
    Require(request.status().code() == absl::StatusCode::kInvalidArgument);
    Require(!request.status().message().empty());
    return 0;
  }
  Require(request->chat == chat);
  if (chat) {
    Require(request->chat_input.messages_size() > 0);
  } else {
    Require(request->prompt_text.has_value() || !request->prompt_ids.empty());
  }
  const nq::v1::SamplingParams& s = request->sampling;
  Require(std::isfinite(s.temperature()) && s.temperature() >= 0);
  Require(std::isfinite(s.top_p()) && s.top_p() >= 0 && s.top_p() <= 1);
  return 0;
}
