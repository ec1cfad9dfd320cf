// Tokenizer components on small in-memory tokenizer.json files: BPE merging, added tokens,
// normalizers, pre-tokenizers, post-processors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/tokenizer/pre_tokenizer.h"
#include "services/tokenizer/tokenizer.h"
#include "tests/common/status_matchers.h"
#include "tests/tokenizer/mini_tokenizer.h"

namespace nq::tokenizer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::AddToken;
using testing::MiniTokenizerJson;
using Json = nlohmann::json;

std::unique_ptr<Tokenizer> Load(const Json& json) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = Tokenizer::FromJson(json.dump());
  EXPECT_THAT(tokenizer, IsOk());
  return tokenizer.ok() ? *std::move(tokenizer) : nullptr;
}

std::vector<int32_t> Encode(const Tokenizer& tokenizer, std::string_view text, bool add_special = false) {
  absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(text, add_special);
  EXPECT_THAT(ids, IsOk());
  return ids.value_or(std::vector<int32_t>{});
}

std::vector<std::string> Tokens(const Tokenizer& tokenizer, std::string_view text) {
  std::vector<std::string> out;
  for (int32_t id : Encode(tokenizer, text)) out.push_back(tokenizer.IdToToken(id).value_or("?"));
  return out;
}

TEST(BpeTest, MergesByRank) {
  auto tok = Load(MiniTokenizerJson({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}}));
  EXPECT_THAT(Tokens(*tok, "hello"), ElementsAre("hello"));
  EXPECT_THAT(Tokens(*tok, "hellx"), ElementsAre("hell", "x"));
  EXPECT_THAT(Tokens(*tok, "hello world"), ElementsAre("hello", "Ġw", "o", "r", "l", "d"));
}

TEST(BpeTest, LowerRankWinsAndTiesGoLeft) {
  auto tok = Load(MiniTokenizerJson({{"b", "c"}, {"a", "b"}, {"a", "a"}}));
  EXPECT_THAT(Tokens(*tok, "abc"), ElementsAre("a", "bc"));
  EXPECT_THAT(Tokens(*tok, "aaa"), ElementsAre("aa", "a"));
}

TEST(BpeTest, LongPiecesMergeLikeShortOnes) {
  // Pieces above the linear-scan limit use the heap; the result must follow the same order.
  auto tok = Load(MiniTokenizerJson({{"a", "b"}, {"ab", "ab"}, {"a", "a"}}));
  for (int pairs : {5, 20, 24, 25, 40, 101}) {
    std::string text;
    for (int i = 0; i < pairs; ++i) text += "ab";
    std::vector<std::string> expected(pairs / 2, "abab");
    if (pairs % 2 == 1) expected.push_back("ab");
    EXPECT_EQ(Tokens(*tok, text), expected) << pairs;
  }
  const std::vector<std::string> as = Tokens(*tok, std::string(101, 'a'));
  ASSERT_EQ(as.size(), 51u);
  EXPECT_EQ(as.back(), "a");
  EXPECT_EQ(as.front(), "aa");
}

TEST(BpeTest, RepeatedMergeKeepsItsLastRank) {
  // ("b","c") appears at ranks 0 and 2; its rank is 2, so ("a","b") at rank 1 wins.
  auto json = MiniTokenizerJson({{"b", "c"}, {"a", "b"}});
  json["model"]["merges"].push_back({"b", "c"});
  auto tok = Load(json);
  EXPECT_THAT(Tokens(*tok, "abc"), ElementsAre("ab", "c"));
}

TEST(BpeTest, AcceptsTheOldStringMergeFormat) {
  auto json = MiniTokenizerJson({{"h", "i"}});
  json["model"]["merges"] = Json::array({"h i"});
  auto tok = Load(json);
  EXPECT_THAT(Tokens(*tok, "hi"), ElementsAre("hi"));
}

TEST(BpeTest, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  auto json = MiniTokenizerJson({});
  json["model"]["vocab"]["xyz"] = 256;
  EXPECT_THAT(Tokens(*Load(json), "xyz"), ElementsAre("x", "y", "z"));
  json["model"]["ignore_merges"] = true;
  EXPECT_THAT(Tokens(*Load(json), "xyz"), ElementsAre("xyz"));
}

Json CharLevelJson() {
  // A character-level (not byte-level) BPE with byte fallback tokens.
  return {{"added_tokens", Json::array()},
          {"normalizer", nullptr},
          {"pre_tokenizer", nullptr},
          {"post_processor", nullptr},
          {"decoder", {{"type", "Sequence"}, {"decoders", Json::array({{{"type", "ByteFallback"}}, {{"type", "Fuse"}}})}}},
          {"model",
           {{"type", "BPE"},
            {"unk_token", "<unk>"},
            {"byte_fallback", true},
            {"vocab", {{"<unk>", 0}, {"<0xC3>", 1}, {"<0xA9>", 2}, {"a", 3}, {"b", 4}, {"ab", 5}}},
            {"merges", Json::array({Json::array({"a", "b"})})}}}};
}

TEST(BpeTest, ByteFallbackAndUnknownTokens) {
  Json json = CharLevelJson();
  auto tok = Load(json);
  EXPECT_THAT(Encode(*tok, "abé"), ElementsAre(5, 1, 2));
  EXPECT_EQ(*tok->Decode(Encode(*tok, "abé"), false), "abé");
  // ü needs <0xC3><0xBC>, and <0xBC> is missing: the unknown token.
  EXPECT_THAT(Encode(*tok, "aü"), ElementsAre(3, 0));
  json["model"]["byte_fallback"] = false;
  EXPECT_THAT(Encode(*Load(json), "éé"), ElementsAre(0, 0));
  json["model"]["fuse_unk"] = true;
  EXPECT_THAT(Encode(*Load(json), "ééa"), ElementsAre(0, 3));
  json["model"]["unk_token"] = nullptr;
  EXPECT_THAT(Load(json)->Encode("é", false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no unk_token")));
}

TEST(AddedTokensTest, MatchedFirstAndLongestFirst) {
  auto json = MiniTokenizerJson({});
  AddToken(&json, 300, "<x>", true);
  AddToken(&json, 301, "<x>>", false);
  auto tok = Load(json);
  EXPECT_THAT(Encode(*tok, "a<x>b<x>>"), ElementsAre('a', 300, 'b', 301));
  EXPECT_THAT(Encode(*tok, "<x<x>"), ElementsAre('<', 'x', 300));
  EXPECT_EQ(*tok->Decode(Encode(*tok, "a<x>b"), false), "a<x>b");
  EXPECT_EQ(*tok->Decode(Encode(*tok, "a<x>b<x>>"), true), "ab<x>>") << "only special tokens are skipped";
}

TEST(AddedTokensTest, LstripAndRstripEatNeighbouringWhitespace) {
  auto json = MiniTokenizerJson({});
  AddToken(&json, 300, "<l>", true, /*lstrip=*/true, /*rstrip=*/false);
  AddToken(&json, 301, "<r>", true, /*lstrip=*/false, /*rstrip=*/true);
  auto tok = Load(json);
  const int32_t space = 32;  // ' ' is byte 32, 'Ġ' in the alphabet
  EXPECT_THAT(Encode(*tok, "a \t<l> b"), ElementsAre('a', 300, space, 'b'));
  EXPECT_THAT(Encode(*tok, "a <r> \n b"), ElementsAre('a', space, 301, 'b'));
  EXPECT_THAT(Encode(*tok, "a\xC2\xA0<l>"), ElementsAre('a', 300)) << "U+00A0 is JavaScript whitespace";
}

TEST(PostProcessorTest, TemplateWrapsOnlyWithAddSpecialTokens) {
  auto json = MiniTokenizerJson({});
  AddToken(&json, 300, "<s>", true);
  AddToken(&json, 301, "</s>", true);
  json["post_processor"] = {{"type", "TemplateProcessing"},
                            {"single", Json::array({{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                                    {{"SpecialToken", {{"id", "</s>"}, {"type_id", 0}}}}})},
                            {"pair", Json::array()},
                            {"special_tokens", Json::object()}};
  auto tok = Load(json);
  EXPECT_THAT(Encode(*tok, "a", true), ElementsAre(300, 'a', 301));
  EXPECT_THAT(Encode(*tok, "a", false), ElementsAre('a'));
  json["post_processor"] = {{"type", "Sequence"},
                            {"processors", Json::array({{{"type", "ByteLevel"}}, json["post_processor"]})}};
  EXPECT_THAT(Encode(*Load(json), "", true), ElementsAre(300, 301));
}

std::string RoundTrip(const Json& normalizer, std::string_view text) {
  auto json = MiniTokenizerJson({});
  json["normalizer"] = normalizer;
  auto tok = Load(json);
  if (tok == nullptr) return "<load failed>";
  return tok->Decode(Encode(*tok, text), false).value_or("<decode failed>");
}

TEST(NormalizerTest, UnicodeForms) {
  EXPECT_EQ(RoundTrip({{"type", "NFC"}}, "e\u0301 \u1100\u1161"), "\u00e9 \uac00");
  EXPECT_EQ(RoundTrip({{"type", "NFD"}}, "\u00e9"), "e\u0301");
  EXPECT_EQ(RoundTrip({{"type", "NFKC"}}, "\ufb01 \uff21 \u2460"), "fi A 1");
  EXPECT_EQ(RoundTrip({{"type", "NFKD"}}, "\u00e9\ufb01"), "e\u0301fi");
}

TEST(NormalizerTest, CaseAccentsStripReplacePrependSequence) {
  EXPECT_EQ(RoundTrip({{"type", "Lowercase"}}, "\u00c0B \u03a3\u039f\u03a3"), "\u00e0b \u03c3\u03bf\u03c2");
  EXPECT_EQ(RoundTrip({{"type", "Sequence"},
                       {"normalizers", Json::array({{{"type", "NFD"}}, {{"type", "StripAccents"}}})}},
                      "cr\u00e8me br\u00fbl\u00e9e"),
            "creme brulee");
  EXPECT_EQ(RoundTrip({{"type", "Strip"}, {"strip_left", true}, {"strip_right", true}}, " \u3000x y\t\n"), "x y");
  EXPECT_EQ(RoundTrip({{"type", "Strip"}, {"strip_left", false}, {"strip_right", true}}, "  x  "), "  x");
  EXPECT_EQ(RoundTrip({{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}, "a b c"),
            "a\u2581b\u2581c");
  EXPECT_EQ(RoundTrip({{"type", "Replace"}, {"pattern", {{"Regex", "\\d+"}}}, {"content", "#"}}, "a12b3"), "a#b#");
  EXPECT_EQ(RoundTrip({{"type", "Prepend"}, {"prepend", "\u2581"}}, "x"), "\u2581x");
  EXPECT_EQ(RoundTrip({{"type", "Sequence"}, {"normalizers", Json::array()}}, "same"), "same");
}

std::vector<std::string> PreTokenize(const Json& config, std::string_view text) {
  absl::StatusOr<PreTokenizerConfig> pre = MakePreTokenizer(config);
  EXPECT_THAT(pre, IsOk());
  if (!pre.ok()) return {};
  Pieces pieces{text};
  PieceArena arena;
  EXPECT_THAT(pre->pre_tokenizer->Split(&pieces, &arena), IsOk());
  return std::vector<std::string>(pieces.begin(), pieces.end());
}

Json SplitConfig(const std::string& behavior, const Json& pattern = {{"String", "-"}}, bool invert = false) {
  return {{"type", "Split"}, {"pattern", pattern}, {"behavior", behavior}, {"invert", invert}};
}

TEST(PreTokenizerTest, SplitBehaviorsFollowHuggingFace) {
  // The example of the Hugging Face documentation for SplitDelimiterBehavior.
  const std::string text = "the-final--countdown";
  EXPECT_THAT(PreTokenize(SplitConfig("Removed"), text), ElementsAre("the", "final", "countdown"));
  EXPECT_THAT(PreTokenize(SplitConfig("Isolated"), text), ElementsAre("the", "-", "final", "-", "-", "countdown"));
  EXPECT_THAT(PreTokenize(SplitConfig("MergedWithPrevious"), text), ElementsAre("the-", "final-", "-", "countdown"));
  EXPECT_THAT(PreTokenize(SplitConfig("MergedWithNext"), text), ElementsAre("the", "-final", "-", "-countdown"));
  EXPECT_THAT(PreTokenize(SplitConfig("Contiguous"), text), ElementsAre("the", "-", "final", "--", "countdown"));
  EXPECT_THAT(PreTokenize(SplitConfig("Removed", {{"Regex", "\\w+"}}, /*invert=*/true), "the-final--countdown"),
              ElementsAre("the", "final", "countdown"));
}

TEST(PreTokenizerTest, DigitsAndByteLevel) {
  EXPECT_THAT(PreTokenize({{"type", "Digits"}, {"individual_digits", true}}, "abc123d4"),
              ElementsAre("abc", "1", "2", "3", "d", "4"));
  EXPECT_THAT(PreTokenize({{"type", "Digits"}, {"individual_digits", false}}, "abc123d4"),
              ElementsAre("abc", "123", "d", "4"));
  EXPECT_THAT(PreTokenize({{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}}, "hi you"),
              ElementsAre(" hi", " you"));
  EXPECT_THAT(PreTokenize({{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}, "hi you"),
              ElementsAre("hi you"));
  EXPECT_THAT(PreTokenize({{"type", "Sequence"},
                           {"pretokenizers", Json::array({{{"type", "Digits"}, {"individual_digits", true}},
                                                          {{"type", "ByteLevel"}, {"use_regex", false}}})}},
                          "a12"),
              ElementsAre("a", "1", "2"));
}

}  // namespace
}  // namespace nq::tokenizer
