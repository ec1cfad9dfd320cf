// Decoding: against the reference's decode of the expected ids, round trips, id lookups.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/tokenizer/normalizer.h"
#include "services/tokenizer/utf8.h"
#include "tests/common/status_matchers.h"
#include "tests/tokenizer/test_data.h"

namespace nq::tokenizer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using testing::Corpus;
using testing::Expected;
using testing::LoadedTokenizer;

class DecodeTest : public ::testing::TestWithParam<std::string> {
 protected:
  const Tokenizer& tokenizer() const { return LoadedTokenizer(GetParam()); }
};

TEST_P(DecodeTest, MatchesTheReferenceDecodingOfEveryEntry) {
  const auto& expected = Expected(GetParam());
  for (const auto& entry : expected) {
    absl::StatusOr<std::string> bytes = tokenizer().Decode(entry.ids, /*skip_special_tokens=*/false);
    ASSERT_THAT(bytes, IsOk()) << entry.name;
    // The reference returns text through TextDecoder; Decode returns the raw bytes.
    EXPECT_EQ(SanitizeUtf8(*bytes), entry.decoded) << entry.name;
    absl::StatusOr<std::string> skipped = tokenizer().Decode(entry.ids, /*skip_special_tokens=*/true);
    ASSERT_THAT(skipped, IsOk()) << entry.name;
    EXPECT_EQ(SanitizeUtf8(*skipped), entry.decoded_skip_special) << entry.name;
  }
}

TEST_P(DecodeTest, RoundTripsValidText) {
  // Without a normalizer the bytes come back exactly; Qwen3 normalizes to NFC first.
  std::unique_ptr<Normalizer> nfc;
  if (GetParam() == "qwen3") nfc = *MakeNormalizer({{"type", "NFC"}}, "test");
  for (const auto& entry : Corpus()) {
    if (!IsValidUtf8(entry.bytes)) continue;
    std::string expected = entry.bytes;
    if (nfc != nullptr) ASSERT_THAT(nfc->Normalize(&expected), IsOk());
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer().Encode(entry.bytes, false);
    ASSERT_THAT(ids, IsOk());
    absl::StatusOr<std::string> text = tokenizer().Decode(*ids, false);
    ASSERT_THAT(text, IsOk());
    EXPECT_EQ(*text, expected) << entry.name;
  }
}

TEST_P(DecodeTest, InvalidInputEncodesAsItsReplacement) {
  // Documented input rule: invalid UTF-8 is first sanitised (WHATWG), so it tokenizes exactly
  // like the text with U+FFFD in place of each maximal invalid subsequence.
  for (const auto& entry : Corpus()) {
    if (IsValidUtf8(entry.bytes)) continue;
    absl::StatusOr<std::vector<int32_t>> raw = tokenizer().Encode(entry.bytes, false);
    absl::StatusOr<std::vector<int32_t>> replaced = tokenizer().Encode(SanitizeUtf8(entry.bytes), false);
    ASSERT_THAT(raw, IsOk());
    ASSERT_THAT(replaced, IsOk());
    EXPECT_EQ(*raw, *replaced) << entry.name;
  }
}

TEST_P(DecodeTest, DecodeIsTheConcatenationOfTokenBytes) {
  for (const auto& entry : Expected(GetParam())) {
    std::string concatenated;
    for (int32_t id : entry.ids) {
      absl::StatusOr<std::string_view> bytes = tokenizer().TokenBytes(id, false);
      ASSERT_THAT(bytes, IsOk());
      concatenated.append(*bytes);
    }
    EXPECT_EQ(concatenated, *tokenizer().Decode(entry.ids, false)) << entry.name;
  }
}

TEST_P(DecodeTest, RejectsIdsOutsideTheVocabulary) {
  const std::vector<int32_t> too_large = {1, tokenizer().vocab_size()};
  EXPECT_THAT(tokenizer().Decode(too_large, false), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token id")));
  const std::vector<int32_t> negative = {-1};
  EXPECT_THAT(tokenizer().Decode(negative, false), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("-1")));
}

TEST_P(DecodeTest, EveryTokenIdRoundTripsThroughItsString) {
  int present = 0;
  for (int32_t id = 0; id < tokenizer().vocab_size(); ++id) {
    std::optional<std::string> token = tokenizer().IdToToken(id);
    if (!token.has_value()) continue;
    ++present;
    ASSERT_EQ(tokenizer().TokenToId(*token), id) << *token;
  }
  EXPECT_EQ(present, tokenizer().vocab_size()) << "the three vocabularies have no holes";
  EXPECT_EQ(tokenizer().TokenToId("no such token, surely"), std::nullopt);
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, DecodeTest, ::testing::ValuesIn(testing::TokenizerNames()),
                         [](const auto& info) { return info.param; });

TEST(TokenizerFacts, VocabularySizesAndSpecialTokens) {
  const Tokenizer& deepseek = LoadedTokenizer("deepseek_v3");
  const Tokenizer& qwen = LoadedTokenizer("qwen3");
  const Tokenizer& llama = LoadedTokenizer("llama3");
  EXPECT_EQ(deepseek.vocab_size(), 128815);
  EXPECT_EQ(qwen.vocab_size(), 151669);
  EXPECT_EQ(llama.vocab_size(), 128256);
  EXPECT_TRUE(deepseek.byte_level());

  EXPECT_EQ(deepseek.TokenToId("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_EQ(deepseek.TokenToId("<｜end▁of▁sentence｜>"), 1);
  EXPECT_TRUE(deepseek.IsSpecial(0));
  EXPECT_FALSE(deepseek.IsSpecial(128803)) << "<｜User｜> is an added token but not special";
  EXPECT_EQ(qwen.TokenToId("<|im_end|>"), 151645);
  EXPECT_TRUE(qwen.IsSpecial(151645));
  EXPECT_FALSE(qwen.IsSpecial(151667)) << "<think> is not special";
  EXPECT_EQ(llama.TokenToId("<|begin_of_text|>"), 128000);
  EXPECT_EQ(llama.TokenToId("<|eot_id|>"), 128009);
  EXPECT_EQ(llama.SpecialTokenIds().size(), 256u);
  EXPECT_EQ(qwen.SpecialTokenIds().size(), 14u);
  // Byte-alphabet spelling: "Ġthe" is " the".
  ASSERT_TRUE(llama.TokenToId("Ġthe").has_value());
  EXPECT_EQ(*llama.TokenBytes(*llama.TokenToId("Ġthe"), false), " the");
}

TEST(TokenizerFacts, SkipSpecialTokensDropsOnlySpecialOnes) {
  const Tokenizer& qwen = LoadedTokenizer("qwen3");
  absl::StatusOr<std::vector<int32_t>> ids = qwen.Encode("<|im_start|>hi<think>x</think><|im_end|>", false);
  ASSERT_THAT(ids, IsOk());
  EXPECT_EQ(*qwen.Decode(*ids, true), "hi<think>x</think>");
  EXPECT_EQ(*qwen.Decode(*ids, false), "<|im_start|>hi<think>x</think><|im_end|>");
}

}  // namespace
}  // namespace nq::tokenizer
