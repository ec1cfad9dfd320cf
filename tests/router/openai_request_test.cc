#include "services/router/openai_request.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"

namespace nq::router {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

TEST(OpenAiRequestTest, ParsesACompletion) {
  absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(
      R"({"model":"m","prompt":"hi","max_tokens":5,"temperature":0.5,"top_p":0.9,"top_k":40,"seed":-3,
          "stop":["a","b"],"stream":true,"stream_options":{"include_usage":true},"logprobs":0})");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(*r->prompt_text, "hi");
  EXPECT_EQ(r->sampling.max_tokens(), 5u);
  EXPECT_FLOAT_EQ(r->sampling.temperature(), 0.5f);
  EXPECT_EQ(r->sampling.top_k(), 40u);
  EXPECT_EQ(r->sampling.seed(), static_cast<uint64_t>(-3));
  EXPECT_EQ(r->sampling.stop_size(), 2);
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  // `logprobs: 0` asks for the sampled tokens' logprobs without alternatives.
  EXPECT_TRUE(r->logprobs.enabled);
  EXPECT_EQ(r->logprobs.top, 0);
  EXPECT_EQ(r->sampling.top_logprobs(), 0u);
  EXPECT_TRUE(r->sampling.has_logprobs() && r->sampling.logprobs()) << "the worker computes them";
}

TEST(OpenAiRequestTest, ParsesLogprobsOnBothEndpoints) {
  absl::StatusOr<OpenAiRequest> completion = ParseCompletionRequest(R"({"model":"m","prompt":"x","logprobs":5})");
  ASSERT_THAT(completion, IsOk());
  EXPECT_TRUE(completion->logprobs.enabled);
  EXPECT_EQ(completion->logprobs.top, 5);
  EXPECT_EQ(completion->sampling.top_logprobs(), 5u);
  absl::StatusOr<OpenAiRequest> none = ParseCompletionRequest(R"({"model":"m","prompt":"x","logprobs":null})");
  ASSERT_THAT(none, IsOk());
  EXPECT_FALSE(none->logprobs.enabled);
  // Not asked for: the worker is told not to compute them (greedy then skips the softmax).
  EXPECT_TRUE(none->sampling.has_logprobs());
  EXPECT_FALSE(none->sampling.logprobs());

  const std::string head = R"({"model":"m","messages":[{"role":"user","content":"x"}],)";
  absl::StatusOr<OpenAiRequest> chat = ParseChatRequest(head + R"("logprobs":true,"top_logprobs":20})");
  ASSERT_THAT(chat, IsOk());
  EXPECT_TRUE(chat->logprobs.enabled);
  EXPECT_EQ(chat->logprobs.top, 20);
  EXPECT_EQ(chat->sampling.top_logprobs(), 20u);
  absl::StatusOr<OpenAiRequest> bare = ParseChatRequest(head + R"("logprobs":true})");
  ASSERT_THAT(bare, IsOk());
  EXPECT_TRUE(bare->logprobs.enabled);
  EXPECT_EQ(bare->sampling.top_logprobs(), 0u);
  EXPECT_TRUE(bare->sampling.logprobs());
  absl::StatusOr<OpenAiRequest> plain = ParseChatRequest(head + R"("temperature":0})");
  ASSERT_THAT(plain, IsOk());
  EXPECT_TRUE(plain->sampling.has_logprobs());
  EXPECT_FALSE(plain->sampling.logprobs());

  EXPECT_THAT(ParseCompletionRequest(R"({"model":"m","prompt":"x","logprobs":21})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'logprobs' must be in [0, 20]")));
  EXPECT_THAT(ParseCompletionRequest(R"({"model":"m","prompt":"x","logprobs":true})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'logprobs' must be an integer")));
  EXPECT_THAT(ParseChatRequest(head + R"("logprobs":1})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'logprobs' must be a boolean")));
  EXPECT_THAT(ParseChatRequest(head + R"("logprobs":true,"top_logprobs":21})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'top_logprobs' must be in [0, 20]")));
  EXPECT_THAT(ParseChatRequest(head + R"("top_logprobs":3})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'top_logprobs' requires 'logprobs': true")));
  EXPECT_THAT(ParseChatRequest(head + R"("logprobs":false,"top_logprobs":3})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'top_logprobs' requires 'logprobs': true")));
}

TEST(OpenAiRequestTest, TokenIdPromptsAndSingleStop) {
  absl::StatusOr<OpenAiRequest> r = ParseCompletionRequest(R"({"model":"m","prompt":[1,2,3],"stop":"x"})");
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->prompt_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_FALSE(r->sampling.has_temperature());
}

TEST(OpenAiRequestTest, ParsesAChatWithToolsAndToolCalls) {
  absl::StatusOr<OpenAiRequest> r = ParseChatRequest(R"({"model":"m","messages":[
      {"role":"system","content":"s"},
      {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
      {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function",
        "function":{"name":"f","arguments":"{\"x\":1}"}}]},
      {"role":"tool","tool_call_id":"c1","content":"42"}],
    "tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object"}}}],
    "chat_template_kwargs":{"enable_thinking":false}})");
  ASSERT_THAT(r, IsOk());
  ASSERT_EQ(r->chat_input.messages_size(), 4);
  EXPECT_EQ(r->chat_input.messages(1).content(), "ab");
  EXPECT_EQ(r->chat_input.messages(2).tool_calls(0).arguments_json(), "{\"x\":1}");
  EXPECT_EQ(r->chat_input.messages(3).tool_call_id(), "c1");
  EXPECT_EQ(r->chat_input.tools(0).parameters_json(), "{\"type\":\"object\"}");
  EXPECT_FALSE(r->chat_input.enable_thinking());
  EXPECT_TRUE(r->chat_input.add_generation_prompt());
}

TEST(OpenAiRequestTest, RejectsEachBadField) {
  const std::pair<const char*, const char*> cases[] = {
      {"not json", "not valid JSON"},
      {"[1]", "JSON object"},
      {R"({"prompt":"x"})", "'model' is required"},
      {R"({"model":1,"prompt":"x"})", "'model' must be a string"},
      {R"({"model":"m"})", "'prompt' is required"},
      {R"({"model":"m","prompt":{}})", "'prompt' must be"},
      {R"({"model":"m","prompt":["a","b"]})", "batches"},
      {R"({"model":"m","prompt":[1,-2]})", "non-negative"},
      {R"({"model":"m","prompt":"x","max_tokens":0})", "'max_tokens' must be in"},
      {R"({"model":"m","prompt":"x","max_tokens":1.5})", "'max_tokens' must be an integer"},
      {R"({"model":"m","prompt":"x","temperature":"hot"})", "'temperature' must be a number"},
      {R"({"model":"m","prompt":"x","top_p":0})", "'top_p' must be greater than 0"},
      {R"({"model":"m","prompt":"x","n":2})", "'n' must be in [1, 1]"},
      {R"({"model":"m","prompt":"x","stop":[1]})", "'stop' must be"},
      {R"({"model":"m","prompt":"x","stop":["a","b","c","d","e"]})", "at most 4"},
      {R"({"model":"m","prompt":"x","stream":"yes"})", "'stream' must be a boolean"},
      {R"({"model":"m","prompt":"x","echo":true})", "'echo' is not supported"},
  };
  for (const auto& [body, message] : cases) {
    EXPECT_THAT(ParseCompletionRequest(body), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)))
        << body;
  }
  const std::pair<const char*, const char*> chat_cases[] = {
      {R"({"model":"m"})", "'messages' is required"},
      {R"({"model":"m","messages":[]})", "non-empty array"},
      {R"({"model":"m","messages":[{"role":"wizard","content":"x"}]})", "messages[0].role"},
      {R"({"model":"m","messages":[{"role":"user","content":[{"type":"image_url"}]}]})", "text only"},
      {R"({"model":"m","messages":[{"role":"user","content":5}]})", "messages[0].content"},
      {R"({"model":"m","messages":[{"role":"assistant","tool_calls":[{"id":1}]}]})", "tool_calls"},
      {R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})", "'tools'"},
  };
  for (const auto& [body, message] : chat_cases) {
    EXPECT_THAT(ParseChatRequest(body), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message))) << body;
  }
}

TEST(OpenAiRequestTest, ParsesPenaltiesAndLogitBiasForTheSampler) {
  for (const std::string& head : {std::string(R"({"model":"m","prompt":"x",)"),
                                  std::string(R"({"model":"m","messages":[{"role":"user","content":"x"}],)")}) {
    const std::string body = head + R"("presence_penalty":0.5,"frequency_penalty":-1.25,"logit_bias":{"7":-100,"42":3.5}})";
    absl::StatusOr<OpenAiRequest> r = head.find("prompt") != std::string::npos ? ParseCompletionRequest(body)
                                                                                : ParseChatRequest(body);
    ASSERT_THAT(r, IsOk()) << body;
    EXPECT_FLOAT_EQ(r->sampling.presence_penalty(), 0.5f);
    EXPECT_FLOAT_EQ(r->sampling.frequency_penalty(), -1.25f);
    ASSERT_EQ(r->sampling.logit_bias_size(), 2);
    EXPECT_FLOAT_EQ(r->sampling.logit_bias().at(7), -100.0f);
    EXPECT_FLOAT_EQ(r->sampling.logit_bias().at(42), 3.5f);
  }
}

// Bad penalty values and the fields the server does not implement are refused by name, on
// both endpoints, instead of being parsed and dropped.
TEST(OpenAiRequestTest, RefusesBadPenaltiesAndUnimplementedFieldsByName) {
  const std::pair<const char*, const char*> common[] = {
      {R"("presence_penalty":3)", "'presence_penalty' must be in [-2, 2]"},
      {R"("frequency_penalty":"x")", "'frequency_penalty' must be a number"},
      {R"("logit_bias":[1])", "'logit_bias' must be an object"},
      {R"("logit_bias":{"abc":1})", R"('logit_bias["abc"]' must be keyed by a token id)"},
      {R"("logit_bias":{"-3":1})", R"('logit_bias["-3"]' must be keyed by a token id)"},
      {R"("logit_bias":{"99999999999":1})", "must be keyed by a token id"},
      {R"("logit_bias":{"5":101})", R"('logit_bias["5"]' must be in [-100, 100])"},
      {R"("logit_bias":{"5":"x"})", R"('logit_bias["5"]' must be a number)"},
      {R"("response_format":{"type":"json_object"})", "'response_format' is not supported"},
      {R"("response_format":{"type":"json_schema","json_schema":{}})", "'response_format' is not supported"},
      {R"("response_format":"json")", "'response_format' must be an object"},
  };
  for (const auto& [field, message] : common) {
    const std::string completion = std::string(R"({"model":"m","prompt":"x",)") + field + "}";
    EXPECT_THAT(ParseCompletionRequest(completion), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message)))
        << completion;
    const std::string chat = std::string(R"({"model":"m","messages":[{"role":"user","content":"x"}],)") + field + "}";
    EXPECT_THAT(ParseChatRequest(chat), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(message))) << chat;
  }
}

TEST(OpenAiRequestTest, AcceptsTheDefaultsOfUnimplementedFields) {
  const char* defaults = R"("logit_bias":{},"response_format":{"type":"text"})";
  ASSERT_THAT(ParseCompletionRequest(std::string(R"({"model":"m","prompt":"x",)") + defaults + "}"), IsOk());
  absl::StatusOr<OpenAiRequest> chat = ParseChatRequest(
      std::string(R"({"model":"m","messages":[{"role":"user","content":"x"}],"logprobs":false,"top_logprobs":0,)") +
      defaults + "}");
  ASSERT_THAT(chat, IsOk());
  EXPECT_FALSE(chat->logprobs.enabled);
  EXPECT_EQ(chat->sampling.top_logprobs(), 0u);
}

}  // namespace
}  // namespace nq::router
