// Every conversation of scripts/chat/conversations.json renders byte for byte as transformers'
// apply_chat_template rendered it (tests/chat/data/expected_<model>.json, made on the GPU
// machine by scripts/chat/make_chat_fixtures.py).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "services/chat/chat.h"
#include "tests/chat/chat_json.h"
#include "tests/common/status_matchers.h"

namespace nq::chat {
namespace {

using ::nq::chat::testing::ChatFromJson;
using ::nq::chat::testing::Json;
using ::nq::chat::testing::LoadJsonFile;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr size_t kMinCases = 30;  // conversations.json has 34; guards against an empty file

// The index of the first differing byte, with context, for a readable failure.
std::string FirstDifference(const std::string& want, const std::string& got) {
  size_t i = 0;
  while (i < want.size() && i < got.size() && want[i] == got[i]) ++i;
  const size_t from = i < 40 ? 0 : i - 40;
  return "first difference at byte " + std::to_string(i) + "\n want: ..." + want.substr(from, 80) +
         "\n  got: ..." + got.substr(from, 80);
}

class RenderFixtureTest : public ::testing::TestWithParam<ChatFormat> {};

TEST_P(RenderFixtureTest, MatchesTransformers) {
  const ChatFormat format = GetParam();
  const std::string name(ChatFormatName(format));
  const Json doc = LoadJsonFile(std::string(NQ_CHAT_TEST_DATA) + "/expected_" + name + ".json");
  ASSERT_TRUE(doc.is_object());
  const Json conversations = LoadJsonFile(NQ_CHAT_CONVERSATIONS);
  ASSERT_TRUE(conversations.is_object());

  // Fixtures from the replica environment are for development only.
  EXPECT_EQ(doc["generator"]["backend"], "transformers")
      << "regenerate with transformers: python3 scripts/chat/make_chat_fixtures.py";
  // The fixtures must have been made from the conversations committed beside them.
  ASSERT_EQ(doc["cases"].size(), conversations["cases"].size())
      << "conversations.json changed; regenerate the fixtures";
  ASSERT_GE(doc["cases"].size(), kMinCases);

  size_t rendered = 0;
  for (size_t i = 0; i < doc["cases"].size(); ++i) {
    const Json& c = doc["cases"][i];
    SCOPED_TRACE(name + "/" + c["name"].get<std::string>());
    EXPECT_EQ(c["chat"], conversations["cases"][i]["chat"]) << "regenerate the fixtures";
    const Chat chat = ChatFromJson(c["chat"]);
    const absl::StatusOr<std::string> got = RenderChat(format, chat);
    if (c.contains("expect_error")) {
      EXPECT_THAT(got, StatusIs(absl::StatusCode::kInvalidArgument,
                                HasSubstr(c["expect_error"].get<std::string>())));
      continue;
    }
    ASSERT_TRUE(got.ok()) << got.status();
    const std::string want = c["rendered"].get<std::string>();
    EXPECT_EQ(*got, want) << FirstDifference(want, *got);
    ++rendered;
  }
  EXPECT_GE(rendered, kMinCases - 4);
}

INSTANTIATE_TEST_SUITE_P(AllFormats, RenderFixtureTest,
                         ::testing::Values(ChatFormat::kGlm5, ChatFormat::kDeepSeekV3),
                         [](const ::testing::TestParamInfo<ChatFormat>& info) {
                           return std::string(ChatFormatName(info.param));
                         });

}  // namespace
}  // namespace nq::chat
