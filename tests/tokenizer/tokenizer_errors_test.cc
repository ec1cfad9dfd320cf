// Malformed and unsupported tokenizer.json files: precise errors, never a crash.
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "services/tokenizer/tokenizer.h"
#include "tests/common/status_matchers.h"
#include "tests/tokenizer/mini_tokenizer.h"

namespace nq::tokenizer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using testing::MiniTokenizerJson;
using Json = nlohmann::json;
using Code = absl::StatusCode;

absl::Status LoadStatus(const Json& json) { return Tokenizer::FromJson(json.dump()).status(); }

TEST(TokenizerErrorsTest, TheMiniTokenizerLoads) { EXPECT_THAT(LoadStatus(MiniTokenizerJson({})), IsOk()); }

TEST(TokenizerErrorsTest, NotJson) {
  EXPECT_THAT(Tokenizer::FromJson("{\"model\": "), StatusIs(Code::kInvalidArgument, HasSubstr("not valid JSON")));
  EXPECT_THAT(Tokenizer::FromJson(""), StatusIs(Code::kInvalidArgument, HasSubstr("not valid JSON")));
  EXPECT_THAT(Tokenizer::FromJson("[1, 2]"), StatusIs(Code::kInvalidArgument, HasSubstr("top level")));
}

TEST(TokenizerErrorsTest, UnsupportedModelTypesAreNamed) {
  auto json = MiniTokenizerJson({});
  json["model"]["type"] = "WordPiece";
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("model type 'WordPiece'")));
  json["model"]["type"] = "Unigram";
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("'Unigram'")));
  json = MiniTokenizerJson({});
  json["model"]["continuing_subword_prefix"] = "##";
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("continuing_subword_prefix")));
  json = MiniTokenizerJson({});
  json.erase("model");
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("model must be an object")));
}

TEST(TokenizerErrorsTest, UnsupportedNormalizersAreNamed) {
  auto json = MiniTokenizerJson({});
  json["normalizer"] = {{"type", "BertNormalizer"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("normalizer type 'BertNormalizer'")));
  json["normalizer"] = {{"type", "Sequence"}, {"normalizers", Json::array({{{"type", "Precompiled"}}})}};
  EXPECT_THAT(LoadStatus(json),
              StatusIs(Code::kUnimplemented, HasSubstr("normalizer.normalizers[0]: normalizer type 'Precompiled'")));
  json["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", "a(b)"}}}, {"content", "$1"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("'$'")));
  json["normalizer"] = {{"name", "NFC"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("normalizer.type")));
}

TEST(TokenizerErrorsTest, UnsupportedPreTokenizersAreNamed) {
  auto json = MiniTokenizerJson({});
  json["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("pre-tokenizer type 'Metaspace'")));
  json["pre_tokenizer"] = {{"type", "Sequence"},
                           {"pretokenizers", Json::array({{{"type", "ByteLevel"}}, {{"type", "Digits"}}})}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("after ByteLevel")));
  json["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "[a-"}}}, {"behavior", "Isolated"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("does not compile")));
  json["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Sideways"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("behavior 'Sideways'")));
  json["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Glob", "*"}}}, {"behavior", "Isolated"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("pre_tokenizer.pattern")));
}

TEST(TokenizerErrorsTest, UnsupportedDecodersAndPostProcessorsAreNamed) {
  auto json = MiniTokenizerJson({});
  json["decoder"] = {{"type", "Metaspace"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("decoder type 'Metaspace'")));
  json = MiniTokenizerJson({});
  json["post_processor"] = {{"type", "RobertaMagic"}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("post-processor type 'RobertaMagic'")));
  json["post_processor"] = {{"type", "TemplateProcessing"},
                            {"single", Json::array({{{"SpecialToken", {{"id", "<nope>"}, {"type_id", 0}}}}})}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("'<nope>'")));
}

TEST(TokenizerErrorsTest, MalformedFields) {
  auto json = MiniTokenizerJson({});
  json["model"]["vocab"]["Ġbad"] = "seven";
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("model.vocab['Ġbad']")));
  json = MiniTokenizerJson({});
  json["model"]["merges"] = Json::array({"nospace"});
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("model.merges[0] 'nospace'")));
  json["model"]["merges"] = Json::array({Json::array({"a", "b", "c"})});
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("model.merges[0]")));
  json = MiniTokenizerJson({});
  json["model"].erase("merges");
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("model.merges must be an array")));
  json = MiniTokenizerJson({});
  json["added_tokens"] = Json::array({{{"id", -4}, {"content", "<x>"}}});
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("added_tokens[0].id")));
  json["added_tokens"] = Json::array({{{"id", 400}, {"content", 5}}});
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("added_tokens[0].content")));
  json["added_tokens"] = "none";
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("added_tokens must be an array")));
  json = MiniTokenizerJson({});
  json["truncation"] = {{"max_length", 8}};
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kUnimplemented, HasSubstr("truncation")));
}

// A vocabulary whose ids run far past its size would need an id table as large as the largest
// id (a fuzzed file asked for 48 GB): refused by name. Gaps within the limit still load.
TEST(TokenizerErrorsTest, IdsFarPastTheVocabularyAreRefused) {
  auto json = MiniTokenizerJson({});
  json["model"]["vocab"]["Ġfar"] = 666666214;
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("model.vocab: ids run to 666666214 for 257")));
  json["model"]["vocab"]["Ġfar"] = 4 * 257 + 65536 - 1;
  EXPECT_THAT(LoadStatus(json), IsOk());
  json["model"]["vocab"]["Ġfar"] = 4 * 257 + 65536;
  EXPECT_THAT(LoadStatus(json), StatusIs(Code::kInvalidArgument, HasSubstr("ids must stay below 4 x the tokens")));
}

TEST(TokenizerErrorsTest, Files) {
  EXPECT_THAT(Tokenizer::FromFile("/nonexistent/tokenizer.json"),
              StatusIs(Code::kNotFound, HasSubstr("/nonexistent/tokenizer.json")));
  const std::string path = ::testing::TempDir() + "/broken_tokenizer.json";
  {
    std::ofstream out(path);
    out << "{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": []}, \"decoder\": {\"type\": \"CTC\"}}";
  }
  EXPECT_THAT(Tokenizer::FromFile(path), StatusIs(Code::kUnimplemented, HasSubstr(path + ": decoder: decoder type 'CTC'")));
  {
    // A gzip header followed by garbage.
    std::ofstream out(path, std::ios::binary);
    out << std::string("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03garbage-garbage", 25);
  }
  EXPECT_THAT(Tokenizer::FromFile(path), StatusIs(Code::kDataLoss, HasSubstr("invalid block type")));
  {
    // A gzip stream cut short.
    std::ifstream in(std::string(NQ_TOKENIZER_TEST_DATA) + "/qwen3.tokenizer.json.gz", std::ios::binary);
    std::string head(4096, '\0');
    in.read(head.data(), static_cast<std::streamsize>(head.size()));
    std::ofstream out(path, std::ios::binary);
    out << head;
  }
  EXPECT_THAT(Tokenizer::FromFile(path), StatusIs(Code::kDataLoss, HasSubstr("unexpected end of file")));
}

}  // namespace
}  // namespace nq::tokenizer
