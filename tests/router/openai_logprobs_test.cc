// The OpenAI logprobs shapes (services/router/openai_logprobs.h) from hand-made worker tokens
// and a fake vocabulary, so every field is checked against values the test chose.
#include "services/router/openai_logprobs.h"

#include <cmath>
#include <limits>
#include <map>

#include <gtest/gtest.h>

namespace nq::router {
namespace {

using Json = nlohmann::json;

// Ids 0..4: "a", "bc", "\xC3" + "\xA9" (an é split over two tokens), and 4, a special token
// "<eos>" that the returned text skips.
const std::map<int32_t, std::string> kVocab = {{0, "a"}, {1, "bc"}, {2, "\xC3"}, {3, "\xA9"}, {4, "<eos>"}};

TokenText FakeText() {
  return {.bytes = [](int32_t id) { return kVocab.count(id) ? kVocab.at(id) : std::string(); },
          .text_bytes = [](int32_t id) { return id == 4 || !kVocab.count(id) ? std::string() : kVocab.at(id); }};
}

nq::v1::TokenLogprob Token(uint32_t id, float logprob, std::vector<std::pair<uint32_t, float>> top = {}) {
  nq::v1::TokenLogprob token;
  token.set_token_id(id);
  token.set_logprob(logprob);
  for (const auto& [alt_id, alt_logprob] : top) {
    nq::v1::TokenAlternative* alt = token.add_top();
    alt->set_token_id(alt_id);
    alt->set_logprob(alt_logprob);
  }
  return token;
}

TEST(OpenAiLogprobsTest, ChatEntriesCarryTokenLogprobBytesAndAlternatives) {
  const std::vector<nq::v1::TokenLogprob> tokens = {Token(1, -0.25f, {{1, -0.25f}, {0, -1.5f}}),
                                                    Token(2, -3.0f, {{0, -0.1f}, {2, -3.0f}})};
  const Json content = ChatLogprobContent(tokens, FakeText());
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "bc");
  EXPECT_FLOAT_EQ(content[0]["logprob"].get<float>(), -0.25f);
  EXPECT_EQ(content[0]["bytes"], Json::array({98, 99}));
  ASSERT_EQ(content[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(content[0]["top_logprobs"][1]["token"], "a");
  EXPECT_FLOAT_EQ(content[0]["top_logprobs"][1]["logprob"].get<float>(), -1.5f);
  EXPECT_EQ(content[0]["top_logprobs"][1]["bytes"], Json::array({97}));
  // Half a character: its exact byte, and text that dumps as U+FFFD instead of failing.
  EXPECT_EQ(content[1]["bytes"], Json::array({0xC3}));
  EXPECT_EQ(content[1]["top_logprobs"][0]["token"], "a");
  EXPECT_NE(content.dump(-1, ' ', false, Json::error_handler_t::replace).find("\xEF\xBF\xBD"), std::string::npos);
}

TEST(OpenAiLogprobsTest, ChatWithoutAlternativesHasEmptyTopLists) {
  const std::vector<nq::v1::TokenLogprob> tokens = {Token(0, -0.5f)};
  const Json content = ChatLogprobContent(tokens, FakeText());
  ASSERT_EQ(content.size(), 1u);
  EXPECT_EQ(content[0]["top_logprobs"], Json::array());
}

TEST(OpenAiLogprobsTest, ImpossibleTokensReportOpenAisFloorInsteadOfInfinity) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<nq::v1::TokenLogprob> tokens = {Token(0, -inf, {{1, 0.0f}, {0, -inf}})};
  const Json content = ChatLogprobContent(tokens, FakeText());
  EXPECT_EQ(content[0]["logprob"].get<double>(), kMinLogprob);
  EXPECT_EQ(content[0]["top_logprobs"][1]["logprob"].get<double>(), kMinLogprob);
  CompletionLogprobs completion(FakeText(), 1);
  const Json legacy = completion.Next(tokens);
  EXPECT_EQ(legacy["token_logprobs"][0].get<double>(), kMinLogprob);
}

TEST(OpenAiLogprobsTest, CompletionsListTokensLogprobsTopMapsAndOffsets) {
  CompletionLogprobs logprobs(FakeText(), 1);
  const std::vector<nq::v1::TokenLogprob> first = {Token(0, -0.5f, {{0, -0.5f}, {1, -1.0f}}),
                                                   Token(1, -2.0f, {{0, -0.3f}, {1, -2.0f}})};
  const Json a = logprobs.Next(first);
  EXPECT_EQ(a["tokens"], Json::array({"a", "bc"}));
  EXPECT_EQ(a["token_logprobs"], Json::array({-0.5, -2.0}));
  // top 1 plus the sampled token when it is not among them (up to logprobs + 1 keys).
  EXPECT_EQ(a["top_logprobs"][0], Json({{"a", -0.5}}));
  EXPECT_EQ(a["top_logprobs"][1], Json({{"a", -0.30000001192092896}, {"bc", -2.0}}));
  EXPECT_EQ(a["text_offset"], Json::array({0, 1}));
  // A later chunk continues the offsets: "a" + "bc" = 3 code points; the split é counts once
  // (at its first byte), and the skipped <eos> adds nothing.
  const std::vector<nq::v1::TokenLogprob> second = {Token(2, -1.0f), Token(3, -0.1f), Token(4, -0.2f),
                                                    Token(0, -0.7f)};
  const Json b = logprobs.Next(second);
  EXPECT_EQ(b["text_offset"], Json::array({3, 4, 4, 4}));
  EXPECT_EQ(b["tokens"][2], "<eos>");
  EXPECT_EQ(b["top_logprobs"][3], Json({{"a", -0.699999988079071}}));
}

TEST(OpenAiLogprobsTest, CompletionsWithZeroAlternativesStillReportTheSampledToken) {
  CompletionLogprobs logprobs(FakeText(), 0);
  const std::vector<nq::v1::TokenLogprob> tokens = {Token(1, -0.25f, {{0, -0.1f}})};
  const Json out = logprobs.Next(tokens);
  EXPECT_EQ(out["top_logprobs"][0], Json({{"bc", -0.25}}));
}

}  // namespace
}  // namespace nq::router
