// Every way ParseModelConfig / LoadModelConfig refuses a config, each with its status code
// and a message that names the offending key.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include "services/model/model_config.h"
#include "tests/common/status_matchers.h"
#include "tests/model_config/test_configs.h"

namespace nq::model {
namespace {

using ::nq::model::testing::TinyDeepseekV3;
using ::nq::model::testing::TinyGlmMoeDsa;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
using Json = nlohmann::json;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;
constexpr absl::StatusCode kUnimplemented = absl::StatusCode::kUnimplemented;

struct ErrorCase {
  const char* name;
  Json (*base)();
  std::function<void(Json&)> mutate;
  absl::StatusCode code;
  const char* message;
};

class ModelConfigErrorTest : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(ModelConfigErrorTest, IsRefusedWithAPreciseStatus) {
  const ErrorCase& c = GetParam();
  Json json = c.base();
  ASSERT_THAT(ParseModelConfig(json.dump()), IsOk()) << "the base config must parse";
  c.mutate(json);
  EXPECT_THAT(ParseModelConfig(json.dump()), StatusIs(c.code, HasSubstr(c.message)));
}

Json Dsv3() { return TinyDeepseekV3(); }
Json Glm() { return TinyGlmMoeDsa(); }

const ErrorCase kErrorCases[] = {
    // Architecture.
    {"UnsupportedArchitecture", Dsv3, [](Json& j) { j["architectures"] = {"LlamaForCausalLM"}; },
     kUnimplemented,
     "unsupported architecture [LlamaForCausalLM]; supported: GlmMoeDsaForCausalLM, "
     "DeepseekV3ForCausalLM"},
    {"DeepseekV32", Dsv3, [](Json& j) { j["architectures"] = {"DeepseekV32ForCausalLM"}; },
     kUnimplemented, "unsupported architecture [DeepseekV32ForCausalLM]"},
    {"MissingArchitectures", Dsv3, [](Json& j) { j.erase("architectures"); }, kInvalid,
     "missing required key \"architectures\""},
    {"ArchitecturesNotAList", Dsv3, [](Json& j) { j["architectures"] = "DeepseekV3ForCausalLM"; },
     kInvalid, "key \"architectures\" must be an array of strings, got string"},
    // Missing required keys.
    {"MissingHiddenSize", Dsv3, [](Json& j) { j.erase("hidden_size"); }, kInvalid,
     "missing required key \"hidden_size\""},
    {"MissingVocabSize", Glm, [](Json& j) { j.erase("vocab_size"); }, kInvalid,
     "missing required key \"vocab_size\""},
    {"MissingKvLoraRank", Dsv3, [](Json& j) { j.erase("kv_lora_rank"); }, kInvalid,
     "missing required key \"kv_lora_rank\""},
    {"MissingNRoutedExperts", Glm, [](Json& j) { j.erase("n_routed_experts"); }, kInvalid,
     "missing required key \"n_routed_experts\""},
    {"MissingQLoraRank", Dsv3, [](Json& j) { j.erase("q_lora_rank"); }, kInvalid,
     "missing required key \"q_lora_rank\" (use null for a plain q_proj)"},
    {"YarnWithoutFactor", Dsv3,
     [](Json& j) {
       j["rope_scaling"] = {{"type", "yarn"}, {"beta_fast", 32}};
     },
     kInvalid, "missing required key \"rope_scaling.factor\""},
    {"QuantWithoutMethod", Dsv3,
     [](Json& j) {
       j["quantization_config"] = {{"fmt", "e4m3"}};
     },
     kInvalid, "missing required key \"quantization_config.quant_method\""},
    // Wrong JSON types.
    {"StringForInteger", Dsv3, [](Json& j) { j["hidden_size"] = "7168"; }, kInvalid,
     "key \"hidden_size\" must be an integer, got string \"7168\""},
    {"FloatForInteger", Dsv3, [](Json& j) { j["num_hidden_layers"] = 4.5; }, kInvalid,
     "key \"num_hidden_layers\" must be an integer, got number 4.5"},
    {"NullForInteger", Dsv3, [](Json& j) { j["v_head_dim"] = nullptr; }, kInvalid,
     "key \"v_head_dim\" must be an integer, got null"},
    {"IntegerForBoolean", Dsv3, [](Json& j) { j["norm_topk_prob"] = 1; }, kInvalid,
     "key \"norm_topk_prob\" must be a boolean, got number 1"},
    {"StringForNumber", Dsv3, [](Json& j) { j["rms_norm_eps"] = "1e-6"; }, kInvalid,
     "key \"rms_norm_eps\" must be a number, got string"},
    {"NestedWrongType", Dsv3,
     [](Json& j) {
       j["rope_scaling"] = {{"type", "yarn"}, {"factor", "40"}};
     },
     kInvalid, "key \"rope_scaling.factor\" must be a number, got string \"40\""},
    {"RopeNotAnObject", Dsv3, [](Json& j) { j["rope_parameters"] = 10000; }, kInvalid,
     "key \"rope_parameters\" must be an object, got number"},
    {"EosNotIntegers", Dsv3,
     [](Json& j) {
       j["eos_token_id"] = {1, "2"};
     },
     kInvalid, "key \"eos_token_id\" must be an integer or an array of integers"},
    {"BlockSizeShape", Dsv3,
     [](Json& j) {
       j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128}}};
     },
     kInvalid, "key \"quantization_config.weight_block_size\" must be an array of two integers"},
    {"LayerTypesNotStrings", Glm,
     [](Json& j) {
       j["mlp_layer_types"] = {0, 1, 1, 1};
     },
     kInvalid, "key \"mlp_layer_types\" must be an array of strings"},
    {"IntegerOutOfRange", Dsv3,
     [](Json& j) { j["vocab_size"] = std::numeric_limits<uint64_t>::max(); }, kInvalid,
     "key \"vocab_size\" is out of range"},
    // Unsupported values.
    {"SoftmaxScoring", Dsv3, [](Json& j) { j["scoring_func"] = "softmax"; }, kUnimplemented,
     "scoring_func \"softmax\" is not supported; supported: sigmoid"},
    {"GreedyTopk", Dsv3, [](Json& j) { j["topk_method"] = "group_limited_greedy"; }, kUnimplemented,
     "topk_method \"group_limited_greedy\" is not supported; supported: noaux_tc"},
    {"GeluActivation", Glm, [](Json& j) { j["hidden_act"] = "gelu"; }, kUnimplemented,
     "hidden_act \"gelu\" is not supported; supported: silu"},
    {"LinearRope", Dsv3,
     [](Json& j) {
       j["rope_scaling"] = {{"type", "linear"}, {"factor", 2}};
     },
     kUnimplemented,
     "rope_scaling.rope_type \"linear\" is not supported; supported: default, yarn"},
    {"Llama3Rope", Glm,
     [](Json& j) {
       j["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 1e4}};
     },
     kUnimplemented, "rope_parameters.rope_type \"llama3\" is not supported"},
    {"PartialRotary", Dsv3, [](Json& j) { j["partial_rotary_factor"] = 0.5; }, kUnimplemented,
     "partial_rotary_factor 0.5 is not supported"},
    {"PerLayerRope", Glm,
     [](Json& j) {
       j["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}}}};
     },
     kUnimplemented, "per-layer-type rope parameters are not supported"},
    {"AwqQuant", Dsv3,
     [](Json& j) {
       j["quantization_config"] = {{"quant_method", "awq"}};
     },
     kUnimplemented, "quantization_config.quant_method \"awq\" is not supported; supported: fp8"},
    {"E5m2", Dsv3,
     [](Json& j) {
       j["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e5m2"}};
     },
     kUnimplemented, "quantization_config.fmt \"e5m2\" is not supported"},
    {"StaticActivations", Dsv3,
     [](Json& j) {
       j["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "static"}};
     },
     kUnimplemented, "activation_scheme \"static\" is not supported"},
    {"MoeLayerFreq", Dsv3, [](Json& j) { j["moe_layer_freq"] = 2; }, kUnimplemented,
     "moe_layer_freq 2 is not supported"},
    {"Int8Dtype", Dsv3, [](Json& j) { j["torch_dtype"] = "int8"; }, kUnimplemented,
     "dtype \"int8\" is not supported"},
    // Out-of-range and inconsistent values.
    {"TooManyExpertsPerToken", Dsv3, [](Json& j) { j["num_experts_per_tok"] = 9; }, kInvalid,
     "num_experts_per_tok 9 exceeds n_routed_experts 8"},
    {"ExpertsNotDivisibleByGroups", Dsv3, [](Json& j) { j["n_group"] = 3; }, kInvalid,
     "n_routed_experts 8 is not divisible by n_group 3"},
    {"TopkGroupAboveGroups", Dsv3, [](Json& j) { j["topk_group"] = 3; }, kInvalid,
     "topk_group 3 exceeds n_group 2"},
    {"OneExpertPerGroup", Dsv3,
     [](Json& j) {
       j["n_group"] = 8;
       j["topk_group"] = 4;
     },
     kInvalid, "noaux_tc routing needs at least 2 experts per group"},
    {"MoreExpertsThanSelectedGroupsHold", Dsv3, [](Json& j) { j["num_experts_per_tok"] = 5; },
     kInvalid, "num_experts_per_tok 5 exceeds the 4 experts in topk_group 1 groups"},
    {"ZeroIndexTopk", Glm, [](Json& j) { j["index_topk"] = 0; }, kInvalid,
     "index_topk must be > 0"},
    {"IndexHeadDimBelowRope", Glm, [](Json& j) { j["index_head_dim"] = 4; }, kInvalid,
     "index_head_dim 4 is outside [8,"},
    {"KvHeadsMismatch", Dsv3, [](Json& j) { j["num_key_value_heads"] = 1; }, kInvalid,
     "num_key_value_heads 1 != num_attention_heads 4"},
    {"FirstKDenseBeyondLayers", Dsv3, [](Json& j) { j["first_k_dense_replace"] = 5; }, kInvalid,
     "first_k_dense_replace 5 is outside [0, num_hidden_layers = 4]"},
    {"ZeroLayers", Dsv3, [](Json& j) { j["num_hidden_layers"] = 0; }, kInvalid,
     "num_hidden_layers 0 is outside [1, 1024]"},
    {"AbsurdLayerCount", Glm, [](Json& j) { j["num_hidden_layers"] = 1 << 30; }, kInvalid,
     "num_hidden_layers 1073741824 is outside [1, 1024]"},
    {"ZeroHiddenSize", Dsv3, [](Json& j) { j["hidden_size"] = 0; }, kInvalid,
     "hidden_size 0 is outside [1,"},
    {"OddRopeDim", Dsv3, [](Json& j) { j["qk_rope_head_dim"] = 7; }, kInvalid,
     "qk_rope_head_dim 7 must be even"},
    {"QkHeadDimMismatch", Glm, [](Json& j) { j["qk_head_dim"] = 32; }, kInvalid,
     "qk_head_dim 32 != qk_nope_head_dim + qk_rope_head_dim = 24"},
    {"NegativeEps", Dsv3, [](Json& j) { j["rms_norm_eps"] = -1e-6; }, kInvalid,
     "rms_norm_eps must be a finite number > 0"},
    {"ZeroRoutedScaling", Dsv3, [](Json& j) { j["routed_scaling_factor"] = 0; }, kInvalid,
     "routed_scaling_factor must be a finite number > 0"},
    {"EosOutsideVocab", Dsv3,
     [](Json& j) {
       j["eos_token_id"] = {1, 256};
     },
     kInvalid, "eos_token_id 256 is outside the vocabulary [0, 256)"},
    {"MlpLayerTypesLength", Glm,
     [](Json& j) {
       j["mlp_layer_types"] = {"dense", "sparse"};
     },
     kInvalid, "mlp_layer_types has 2 entries but num_hidden_layers is 4"},
    {"MlpLayerTypesValue", Glm,
     [](Json& j) {
       j["mlp_layer_types"] = {"dense", "moe", "sparse", "sparse"};
     },
     kInvalid, "mlp_layer_types[1] is \"moe\"; expected dense or sparse"},
    {"MlpLayerTypesDisagreeWithFirstK", Glm,
     [](Json& j) {
       j["mlp_layer_types"] = {"dense", "dense", "sparse", "sparse"};
     },
     kInvalid, "mlp_layer_types starts with 2 dense layers but first_k_dense_replace is 1"},
    {"DeepseekV3IgnoresMlpLayerTypes", Dsv3,
     [](Json& j) {
       j.erase("first_k_dense_replace");
       j["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse"};
     },
     kInvalid, "mlp_layer_types disagrees with first_k_dense_replace 3"},
    {"IndexerTypesLength", Glm, [](Json& j) { j["indexer_types"] = {"full"}; }, kInvalid,
     "indexer_types has 1 entries but num_hidden_layers is 4"},
    {"IndexerTypesValue", Glm,
     [](Json& j) {
       j["indexer_types"] = {"full", "skip", "full", "full"};
     },
     kInvalid, "indexer type of layer 1 is \"skip\"; expected full or shared"},
    {"IndexerPatternValue", Glm, [](Json& j) { j["index_topk_pattern"] = "FSXF"; }, kInvalid,
     "index_topk_pattern holds 'X'; expected F or S"},
    {"IndexerOffsetOutOfRange", Glm,
     [](Json& j) { j["index_skip_topk_offset"] = std::numeric_limits<int64_t>::min(); }, kInvalid,
     "index_skip_topk_offset -9223372036854775808 is outside [-1024, 1024]"},
    {"SharedIndexerFirst", Glm,
     [](Json& j) {
       j["indexer_types"] = {"shared", "full", "full", "full"};
     },
     kInvalid, "indexer_types[0] is \"shared\" but no earlier layer runs the indexer"},
    {"IndexerOnDeepseekV3", Dsv3, [](Json& j) { j["index_topk"] = 2048; }, kInvalid,
     "the config sets index_topk but DeepseekV3ForCausalLM has no DSA indexer"},
    {"YarnFactorBelowOne", Dsv3,
     [](Json& j) {
       j["rope_scaling"] = {{"type", "yarn"}, {"factor", 0.5}};
     },
     kInvalid, "yarn factor must be a finite number >= 1, got 0.5"},
    {"BetaFastBelowBetaSlow", Dsv3,
     [](Json& j) {
       j["rope_scaling"] = {{"type", "yarn"}, {"factor", 4}, {"beta_fast", 1}, {"beta_slow", 2}};
     },
     kInvalid, "beta_fast (1) must be >= beta_slow (2)"},
    {"ZeroTheta", Dsv3, [](Json& j) { j["rope_theta"] = 0; }, kInvalid,
     "rope_theta must be a finite number > 1, got 0"},
    {"ZeroBlockSize", Dsv3,
     [](Json& j) {
       j["quantization_config"] = {{"quant_method", "fp8"}, {"weight_block_size", {128, 0}}};
     },
     kInvalid, "weight_block_size must be positive, got [128, 0]"},
};

INSTANTIATE_TEST_SUITE_P(All, ModelConfigErrorTest, ::testing::ValuesIn(kErrorCases),
                         [](const ::testing::TestParamInfo<ErrorCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(MalformedConfigTest, JsonErrorsGiveTheirPosition) {
  EXPECT_THAT(ParseModelConfig("{\"vocab_size\": 1,\n \"hidden_size\": }"),
              StatusIs(kInvalid, HasSubstr("malformed JSON: parse error at line 2, column 17: "
                                           "syntax error while parsing value")));
  EXPECT_THAT(ParseModelConfig(""), StatusIs(kInvalid, HasSubstr("malformed JSON")));
  EXPECT_THAT(ParseModelConfig("{} trailing"), StatusIs(kInvalid, HasSubstr("malformed JSON")));
  EXPECT_THAT(ParseModelConfig("{\"a\": NaN}"), StatusIs(kInvalid, HasSubstr("malformed JSON")));
  EXPECT_THAT(ParseModelConfig("{\"a\": \"\xff\"}"),
              StatusIs(kInvalid, HasSubstr("malformed JSON")));
}

TEST(MalformedConfigTest, RootMustBeAnObject) {
  EXPECT_THAT(ParseModelConfig("[1, 2]"),
              StatusIs(kInvalid, HasSubstr("config.json must be a JSON object, got array")));
}

class LoadModelConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("nq_model_config_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& text) { std::ofstream(dir_ / "config.json") << text; }

  std::filesystem::path dir_;
};

TEST_F(LoadModelConfigTest, MissingFileIsNotFoundAndNamesThePath) {
  const std::string path = (dir_ / "config.json").string();
  EXPECT_THAT(LoadModelConfig(dir_.string()),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("cannot open " + path)));
}

TEST_F(LoadModelConfigTest, ParseErrorsNameTheFile) {
  const std::string path = (dir_ / "config.json").string();
  Write("{\"architectures\": [\"DeepseekV3ForCausalLM\"],");
  EXPECT_THAT(LoadModelConfig(dir_.string()),
              StatusIs(kInvalid, HasSubstr(path + ": malformed JSON")));
  Json json = TinyGlmMoeDsa();
  json.erase("hidden_size");
  Write(json.dump());
  EXPECT_THAT(LoadModelConfig(dir_.string()),
              StatusIs(kInvalid, HasSubstr(path + ": missing required key \"hidden_size\"")));
}

TEST_F(LoadModelConfigTest, ReadsAWrittenConfig) {
  Write(TinyGlmMoeDsa().dump());
  absl::StatusOr<ModelConfig> config = LoadModelConfig(dir_.string());
  ASSERT_THAT(config, IsOk());
  EXPECT_EQ(config->architecture, Architecture::kGlmMoeDsa);
}

TEST_F(LoadModelConfigTest, DirectoryInsteadOfFileIsAnError) {
  std::filesystem::create_directories(dir_ / "config.json");
  const absl::StatusOr<ModelConfig> config = LoadModelConfig(dir_.string());
  ASSERT_FALSE(config.ok());
  EXPECT_THAT(std::string(config.status().message()), HasSubstr((dir_ / "config.json").string()));
}

}  // namespace
}  // namespace nq::model
