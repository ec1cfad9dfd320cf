// OpenAI logprobs end to end (router, worker, streamer, the embedded model): the worker's
// numbers reach both endpoints in OpenAI's shapes, streamed and not, and they mean what
// proto/nq/v1/sampling.proto says (the model's distribution at temperature 1).
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

using Json = nlohmann::json;

// Slack for float32 logprobs summed or compared after a JSON round trip.
constexpr double kTolerance = 1e-5;

const Json kMessages = Json::array({{{"role", "user"}, {"content", "def fibonacci(n):"}}});

std::string Bytes(const Json& entry) {
  std::string out;
  for (const Json& b : entry["bytes"]) out.push_back(static_cast<char>(b.get<int>()));
  return out;
}

// Checks one chat logprobs entry of a greedy step: the chosen token is the most likely one,
// the alternatives are ordered and are probabilities of one distribution.
void ExpectGreedyChatEntry(const Json& entry, size_t top, const std::string& where) {
  ASSERT_EQ(entry["top_logprobs"].size(), top) << where << entry.dump();
  const Json& best = entry["top_logprobs"][0];
  EXPECT_EQ(entry["token"], best["token"]) << where;
  EXPECT_EQ(entry["bytes"], best["bytes"]) << where;
  EXPECT_NEAR(entry["logprob"].get<double>(), best["logprob"].get<double>(), kTolerance) << where;
  double mass = 0;
  double previous = 0;
  for (const Json& alt : entry["top_logprobs"]) {
    const double logprob = alt["logprob"].get<double>();
    EXPECT_LE(logprob, previous + kTolerance) << where << ": most likely first";
    previous = logprob;
    mass += std::exp(logprob);
    EXPECT_EQ(Bytes(alt), alt["token"].get<std::string>()) << where;
  }
  EXPECT_LE(mass, 1.0 + kTolerance) << where;
  EXPECT_GT(mass, 0.0) << where;
}

TEST_F(ServingTest, ChatLogprobsNameTheGreedyTokenAsTheMostLikelyStreamedOrNot) {
  StartCluster({"--chat_format=plain"});
  Json request = {{"model", "embedded"}, {"messages", kMessages}, {"max_tokens", 12}, {"temperature", 0},
                  {"ignore_eos", true}, {"logprobs", true}, {"top_logprobs", 5}};
  absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/chat/completions", request);
  ASSERT_TRUE(reply.ok());
  ASSERT_EQ(reply->first, 200) << reply->second.dump();
  const Json& choice = reply->second["choices"][0];
  ASSERT_TRUE(choice["logprobs"].is_object()) << choice.dump();
  const Json& content = choice["logprobs"]["content"];
  ASSERT_EQ(content.size(), 12u) << "one entry per generated token";
  std::string joined;
  for (size_t i = 0; i < content.size(); ++i) {
    ExpectGreedyChatEntry(content[i], 5, "token " + std::to_string(i));
    joined += Bytes(content[i]);
  }
  EXPECT_EQ(joined, choice["message"]["content"].get<std::string>()) << "the entries spell the answer";

  // The stream's chunks carry the same entries, spread over more than one chunk.
  Streamed streamed = Stream("/v1/chat/completions", request);
  EXPECT_EQ(streamed.text, choice["message"]["content"].get<std::string>());
  Json streamed_content = Json::array();
  int chunks_with_entries = 0;
  for (const Json& chunk : streamed.chunks) {
    for (const Json& c : chunk.value("choices", Json::array())) {
      if (!c.contains("logprobs") || c["logprobs"].is_null()) continue;
      chunks_with_entries += !c["logprobs"]["content"].empty();
      for (const Json& entry : c["logprobs"]["content"]) streamed_content.push_back(entry);
    }
  }
  EXPECT_GT(chunks_with_entries, 1);
  ASSERT_EQ(streamed_content.size(), content.size());
  for (size_t i = 0; i < content.size(); ++i) {
    EXPECT_EQ(streamed_content[i]["bytes"], content[i]["bytes"]) << i;
    EXPECT_NEAR(streamed_content[i]["logprob"].get<double>(), content[i]["logprob"].get<double>(), kTolerance) << i;
  }

  // Not asked for, not returned.
  request.erase("logprobs");
  request.erase("top_logprobs");
  absl::StatusOr<std::pair<int, Json>> plain = PostJson("/v1/chat/completions", request);
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->second["choices"][0]["logprobs"].is_null()) << plain->second.dump();
}

TEST_F(ServingTest, CompletionLogprobsListTokensOffsetsAndTopMapsStreamedOrNot) {
  StartCluster();
  const Json request = {{"model", "embedded"}, {"prompt", "def fibonacci(n):"}, {"max_tokens", 10},
                        {"temperature", 0}, {"ignore_eos", true}, {"logprobs", 3}};
  absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/completions", request);
  ASSERT_TRUE(reply.ok());
  ASSERT_EQ(reply->first, 200) << reply->second.dump();
  const Json& choice = reply->second["choices"][0];
  const Json& logprobs = choice["logprobs"];
  ASSERT_TRUE(logprobs.is_object()) << choice.dump();
  const std::string text = choice["text"].get<std::string>();
  ASSERT_EQ(logprobs["tokens"].size(), 10u);
  ASSERT_EQ(logprobs["token_logprobs"].size(), 10u);
  ASSERT_EQ(logprobs["top_logprobs"].size(), 10u);
  ASSERT_EQ(logprobs["text_offset"].size(), 10u);
  std::string joined;
  for (size_t i = 0; i < 10; ++i) {
    const std::string token = logprobs["tokens"][i].get<std::string>();
    // The generated text is ASCII Python here, so code points are bytes.
    EXPECT_EQ(logprobs["text_offset"][i].get<size_t>(), joined.size()) << i;
    joined += token;
    const Json& top = logprobs["top_logprobs"][i];
    ASSERT_TRUE(top.contains(token)) << i << top.dump();
    double best = -1e9;
    double mass = 0;
    for (const auto& [alt, value] : top.items()) {
      best = std::max(best, value.get<double>());
      mass += std::exp(value.get<double>());
    }
    EXPECT_LE(top.size(), 3u) << "greedy: the sampled token is one of the top 3";
    EXPECT_NEAR(logprobs["token_logprobs"][i].get<double>(), best, kTolerance) << "greedy picks the maximum, " << i;
    EXPECT_LE(mass, 1.0 + kTolerance) << i;
  }
  EXPECT_EQ(joined, text);

  Streamed streamed = Stream("/v1/completions", request);
  EXPECT_EQ(streamed.text, text);
  Json tokens = Json::array(), offsets = Json::array(), values = Json::array();
  for (const Json& chunk : streamed.chunks) {
    for (const Json& c : chunk.value("choices", Json::array())) {
      if (!c.contains("logprobs") || c["logprobs"].is_null()) continue;
      for (const Json& t : c["logprobs"]["tokens"]) tokens.push_back(t);
      for (const Json& o : c["logprobs"]["text_offset"]) offsets.push_back(o);
      for (const Json& v : c["logprobs"]["token_logprobs"]) values.push_back(v);
    }
  }
  EXPECT_EQ(tokens, logprobs["tokens"]);
  EXPECT_EQ(offsets, logprobs["text_offset"]) << "the chunks continue each other's offsets";
  ASSERT_EQ(values.size(), 10u);
  for (size_t i = 0; i < 10; ++i) {
    EXPECT_NEAR(values[i].get<double>(), logprobs["token_logprobs"][i].get<double>(), kTolerance) << i;
  }
}

// The first position's distribution depends on the prompt only: a greedy and a hot, seeded
// request report the same alternatives there (the values are the temperature-1 distribution,
// whatever the sampling settings), and a sampled token's own logprob is its value in that list.
TEST_F(ServingTest, LogprobsDoNotDependOnTemperature) {
  StartCluster({"--chat_format=plain"});
  Json request = {{"model", "embedded"}, {"messages", kMessages}, {"max_tokens", 1}, {"ignore_eos", true},
                  {"logprobs", true}, {"top_logprobs", 20}};
  std::vector<Json> firsts;
  for (double temperature : {0.0, 1.5}) {
    request["temperature"] = temperature;
    request["seed"] = 11;
    absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/chat/completions", request);
    ASSERT_TRUE(reply.ok());
    ASSERT_EQ(reply->first, 200) << reply->second.dump();
    const Json& entry = reply->second["choices"][0]["logprobs"]["content"][0];
    ASSERT_EQ(entry["top_logprobs"].size(), 20u);
    for (const Json& alt : entry["top_logprobs"]) {
      if (alt["bytes"] == entry["bytes"]) {
        EXPECT_NEAR(alt["logprob"].get<double>(), entry["logprob"].get<double>(), kTolerance);
      }
    }
    firsts.push_back(entry["top_logprobs"]);
  }
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ(firsts[0][i]["bytes"], firsts[1][i]["bytes"]) << i;
    EXPECT_NEAR(firsts[0][i]["logprob"].get<double>(), firsts[1][i]["logprob"].get<double>(), kTolerance) << i;
  }
}

}  // namespace
}  // namespace nq::testing
