// Streaming detokenization: whole characters only, held bytes, U+FFFD and the invalid count.
#include "services/tokenizer/stream_detokenizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/common/metrics/counter.h"
#include "services/tokenizer/byte_level.h"
#include "tests/common/status_matchers.h"
#include "tests/tokenizer/test_data.h"

namespace nq::tokenizer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using testing::LoadedTokenizer;

constexpr std::string_view kFffd = "\xEF\xBF\xBD";

// The id of the single-byte token for `byte` in a byte-level vocabulary.
int32_t ByteToken(const Tokenizer& tokenizer, uint8_t byte) {
  std::string alphabet;
  BytesToByteLevel(std::string_view(reinterpret_cast<const char*>(&byte), 1), &alphabet);
  std::optional<int32_t> id = tokenizer.TokenToId(alphabet);
  EXPECT_TRUE(id.has_value()) << "byte " << int{byte};
  return id.value_or(0);
}

std::vector<int32_t> ByteTokens(const Tokenizer& tokenizer, std::string_view bytes) {
  std::vector<int32_t> ids;
  for (char b : bytes) ids.push_back(ByteToken(tokenizer, static_cast<uint8_t>(b)));
  return ids;
}

// Feeds `ids`, checking every chunk is valid UTF-8; returns the chunks (Flush's last).
std::vector<std::string> Stream(StreamDetokenizer& stream, const std::vector<int32_t>& ids) {
  std::vector<std::string> chunks;
  for (int32_t id : ids) {
    absl::StatusOr<std::string> chunk = stream.Feed(id);
    EXPECT_THAT(chunk, IsOk());
    EXPECT_TRUE(IsValidUtf8(chunk.value_or(""))) << "id " << id;
    chunks.push_back(chunk.value_or(""));
  }
  chunks.push_back(stream.Flush());
  return chunks;
}

std::string Join(const std::vector<std::string>& chunks) {
  std::string out;
  for (const auto& c : chunks) out += c;
  return out;
}

class StreamDetokenizerTest : public ::testing::TestWithParam<std::string> {
 protected:
  const Tokenizer& tokenizer() const { return LoadedTokenizer(GetParam()); }
};

TEST_P(StreamDetokenizerTest, StreamsEveryCorpusEntryAsTheReferenceDecodesIt) {
  for (const auto& entry : testing::Expected(GetParam())) {
    StreamDetokenizer stream(tokenizer());
    const std::vector<std::string> chunks = Stream(stream, entry.ids);
    EXPECT_EQ(Join(chunks), entry.decoded) << entry.name;
  }
}

TEST_P(StreamDetokenizerTest, EmojiSplitAcrossByteTokensAppearsWhole) {
  // U+1F600 as four single-byte tokens: nothing until the fourth.
  StreamDetokenizer stream(tokenizer());
  const std::vector<std::string> chunks = Stream(stream, ByteTokens(tokenizer(), "\xF0\x9F\x98\x80"));
  EXPECT_THAT(chunks, ::testing::ElementsAre("", "", "", "\xF0\x9F\x98\x80", ""));
  EXPECT_EQ(stream.invalid_sequences(), 0);
}

TEST_P(StreamDetokenizerTest, ZwjFamilyFromRealTokensNeverSplitsACharacter) {
  const std::string family = "👨‍👩‍👧‍👦 ok 한국어";
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer().Encode(family, false);
  ASSERT_THAT(ids, IsOk());
  StreamDetokenizer stream(tokenizer());
  const std::vector<std::string> chunks = Stream(stream, *ids);
  EXPECT_EQ(Join(chunks), family);
  EXPECT_EQ(stream.invalid_sequences(), 0);
  // The emoji's bytes span several tokens, so some were held back.
  EXPECT_GT(std::count(chunks.begin(), chunks.end(), ""), 1);
}

TEST_P(StreamDetokenizerTest, InvalidSequencesBecomeOneReplacementEachAndAreCounted) {
  struct Case {
    std::string bytes;
    std::string text;
    int64_t invalid;
  };
  const std::string r(kFffd);
  const std::vector<Case> cases = {
      {"\xE2\x82" "A", r + "A", 1},          // truncated euro sign, then a letter
      {"\x80\x80", r + r, 2},                // two lone continuation bytes
      {"\xC0\xAF", r + r, 2},                // overlong: C0 never starts a character
      {"\xED\xA0\x80", r + r + r, 3},        // a surrogate
      {"\xF0\x9F\x98", r, 1},                // incomplete at the end: Flush
      {"\xF0\x9F\xF0\x9F\x98\x80", r + "\xF0\x9F\x98\x80", 1},
  };
  for (const Case& c : cases) {
    metrics::Counter counter;
    StreamDetokenizer stream(tokenizer(), {.skip_special_tokens = false, .invalid_utf8_counter = &counter});
    EXPECT_EQ(Join(Stream(stream, ByteTokens(tokenizer(), c.bytes))), c.text);
    EXPECT_EQ(stream.invalid_sequences(), c.invalid);
    EXPECT_EQ(counter.Value(), static_cast<double>(c.invalid));
    EXPECT_EQ(SanitizeUtf8(c.bytes), c.text) << "agrees with whole-string decoding";
  }
}

TEST_P(StreamDetokenizerTest, HeldBytesBeforeASpecialTokenAreInvalid) {
  std::vector<int32_t> ids = ByteTokens(tokenizer(), "\xF0\x9F");
  const std::string eos = GetParam() == "qwen3" ? "<|im_end|>" : GetParam() == "llama3" ? "<|eot_id|>" : "<｜end▁of▁sentence｜>";
  ids.push_back(*tokenizer().TokenToId(eos));
  StreamDetokenizer stream(tokenizer());
  const std::vector<std::string> chunks = Stream(stream, ids);
  EXPECT_THAT(chunks, ::testing::ElementsAre("", "", std::string(kFffd) + eos, ""));
  EXPECT_EQ(stream.invalid_sequences(), 1);
}

TEST_P(StreamDetokenizerTest, SkipsSpecialTokensWhenAsked) {
  const std::string eos = GetParam() == "qwen3" ? "<|im_end|>" : GetParam() == "llama3" ? "<|eot_id|>" : "<｜end▁of▁sentence｜>";
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer().Encode("done." + eos, false);
  ASSERT_THAT(ids, IsOk());
  StreamDetokenizer stream(tokenizer(), {.skip_special_tokens = true});
  EXPECT_EQ(Join(Stream(stream, *ids)), "done.");
}

TEST_P(StreamDetokenizerTest, UnknownIdIsAnErrorAndLeavesTheStreamIntact) {
  StreamDetokenizer stream(tokenizer());
  ASSERT_THAT(stream.Feed(ByteToken(tokenizer(), 0xE2)), IsOk());
  EXPECT_THAT(stream.Feed(tokenizer().vocab_size() + 5), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("not in the vocabulary")));
  EXPECT_EQ(stream.pending_bytes(), 1u);
  ASSERT_THAT(stream.Feed(ByteToken(tokenizer(), 0x82)), IsOk());
  absl::StatusOr<std::string> last = stream.Feed(ByteToken(tokenizer(), 0xAC));
  ASSERT_THAT(last, IsOk());
  EXPECT_EQ(*last, "\xE2\x82\xAC");
  EXPECT_EQ(stream.invalid_sequences(), 0);
}

TEST_P(StreamDetokenizerTest, ReusableAfterFlush) {
  StreamDetokenizer stream(tokenizer());
  EXPECT_EQ(Join(Stream(stream, ByteTokens(tokenizer(), "\xE2\x82"))), std::string(kFffd));
  EXPECT_EQ(Join(Stream(stream, ByteTokens(tokenizer(), "\xE2\x82\xAC"))), "\xE2\x82\xAC");
  EXPECT_EQ(stream.invalid_sequences(), 1);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, StreamDetokenizerTest, ::testing::ValuesIn(testing::TokenizerNames()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace nq::tokenizer
