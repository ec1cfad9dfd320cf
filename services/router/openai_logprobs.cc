#include "services/router/openai_logprobs.h"

#include <cmath>

namespace nq::router {
namespace {

using Json = nlohmann::json;

double Logprob(float value) { return std::isfinite(value) ? value : kMinLogprob; }

Json Bytes(const std::string& bytes) {
  Json out = Json::array();
  for (unsigned char c : bytes) out.push_back(static_cast<int>(c));
  return out;
}

Json Entry(uint32_t id, float logprob, const TokenText& text) {
  const std::string bytes = text.bytes(static_cast<int32_t>(id));
  return {{"token", bytes}, {"logprob", Logprob(logprob)}, {"bytes", Bytes(bytes)}};
}

// Code points in `bytes`: every byte that is not a UTF-8 continuation byte (10xxxxxx) starts
// one, which also counts an invalid byte as the one U+FFFD it becomes in the text.
int64_t CodePoints(const std::string& bytes) {
  int64_t n = 0;
  for (unsigned char c : bytes) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace

Json ChatLogprobContent(std::span<const nq::v1::TokenLogprob> tokens, const TokenText& text) {
  Json content = Json::array();
  for (const nq::v1::TokenLogprob& token : tokens) {
    Json entry = Entry(token.token_id(), token.logprob(), text);
    Json top = Json::array();
    for (const nq::v1::TokenAlternative& alt : token.top()) top.push_back(Entry(alt.token_id(), alt.logprob(), text));
    entry["top_logprobs"] = std::move(top);
    content.push_back(std::move(entry));
  }
  return content;
}

Json CompletionLogprobs::Next(std::span<const nq::v1::TokenLogprob> tokens) {
  Json out = {{"tokens", Json::array()}, {"token_logprobs", Json::array()}, {"top_logprobs", Json::array()},
              {"text_offset", Json::array()}};
  for (const nq::v1::TokenLogprob& token : tokens) {
    const int32_t id = static_cast<int32_t>(token.token_id());
    out["tokens"].push_back(text_.bytes(id));
    out["token_logprobs"].push_back(Logprob(token.logprob()));
    Json top = Json::object();
    for (int i = 0; i < top_ && i < token.top_size(); ++i) {
      // Two ids with the same text (e.g. two halves of characters, both U+FFFD) share a
      // key: the more likely one, listed first, keeps it.
      const std::string key = text_.bytes(static_cast<int32_t>(token.top(i).token_id()));
      if (!top.contains(key)) top[key] = Logprob(token.top(i).logprob());
    }
    const std::string sampled = text_.bytes(id);
    if (!top.contains(sampled)) top[sampled] = Logprob(token.logprob());
    out["top_logprobs"].push_back(std::move(top));
    out["text_offset"].push_back(offset_);
    offset_ += CodePoints(text_.text_bytes(id));
  }
  return out;
}

}  // namespace nq::router
