// ParseModelConfig / LoadModelConfig on real full-size configs and tiny ones: every field,
// the HF defaults, the per-layer schedules, RoPE standardization and the ToJson round trip.
#include "services/model/model_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/common/status_matchers.h"
#include "tests/model_config/test_configs.h"

namespace nq::model {
namespace {

using ::nq::model::testing::DataDir;
using ::nq::model::testing::ReadDataConfig;
using ::nq::model::testing::TinyDeepseekV3;
using ::nq::model::testing::TinyGlmMoeDsa;
using ::nq::testing::IsOk;
using ::testing::Each;
using ::testing::ElementsAre;
using ::testing::Eq;
using Json = nlohmann::json;

ModelConfig ParseOrDie(const Json& json) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(json.dump());
  EXPECT_THAT(config, IsOk()) << json.dump(2);
  return config.ok() ? *std::move(config) : ModelConfig{};
}

void ExpectRoundTrip(const ModelConfig& config) {
  const std::string written = config.ToJson();
  absl::StatusOr<ModelConfig> back = ParseModelConfig(written);
  ASSERT_THAT(back, IsOk()) << written;
  EXPECT_TRUE(*back == config) << written;
}

TEST(ModelConfigTest, Glm5) {
  absl::StatusOr<ModelConfig> loaded = LoadModelConfig(DataDir("glm5"));
  ASSERT_THAT(loaded, IsOk());
  const ModelConfig& c = *loaded;
  EXPECT_EQ(c.architecture, Architecture::kGlmMoeDsa);
  EXPECT_EQ(c.model_type, "glm_moe_dsa");
  EXPECT_EQ(c.vocab_size, 154880);
  EXPECT_EQ(c.hidden_size, 6144);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 78);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 64);
  EXPECT_TRUE(c.HasQLora());
  EXPECT_EQ(c.q_lora_rank, 2048);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 192);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.QkHeadDim(), 256);
  EXPECT_EQ(c.v_head_dim, 256);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.FirstKDenseReplace(), 3);
  ASSERT_EQ(c.mlp_kinds.size(), 78u);
  EXPECT_FALSE(c.IsMoeLayer(2));
  EXPECT_TRUE(c.IsMoeLayer(3));
  EXPECT_TRUE(c.IsMoeLayer(77));
  EXPECT_TRUE(c.IsMoeLayer(78));   // the MTP layer
  EXPECT_FALSE(c.IsMoeLayer(79));  // past it
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.max_position_embeddings, 202752);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 0);  // absent: HF default
  EXPECT_THAT(c.eos_token_ids, ElementsAre(154820, 154827, 154829));
  EXPECT_EQ(c.pad_token_id, 154820);
  EXPECT_EQ(c.rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(c.rope.theta, 1e6);
  EXPECT_TRUE(c.rope_interleave);
  EXPECT_DOUBLE_EQ(c.AttentionScaling(), 1.0);
  EXPECT_DOUBLE_EQ(c.SoftmaxScale(), 0.0625);  // 256^-0.5
  ASSERT_EQ(c.RopeInvFreq().size(), 32u);
  EXPECT_NEAR(c.RopeInvFreq()[16], 1e-3, 1e-15);
  EXPECT_TRUE(c.indexer.enabled);
  EXPECT_EQ(c.indexer.topk, 2048);
  EXPECT_EQ(c.indexer.head_dim, 128);
  EXPECT_EQ(c.indexer.n_heads, 32);
  EXPECT_TRUE(c.indexer.rope_interleave);
  EXPECT_FALSE(c.indexer.share_for_mtp_iteration);
  EXPECT_THAT(c.indexer.kinds, Each(Eq(IndexerKind::kFull)));  // no schedule: all full
  EXPECT_EQ(c.indexer.SelectionSourceLayer(40), 40);
  EXPECT_DOUBLE_EQ(c.indexer.ScoreScale(), 1.0 / std::sqrt(128.0));
  EXPECT_DOUBLE_EQ(c.indexer.HeadWeightScale(), 1.0 / std::sqrt(32.0));
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  EXPECT_FALSE(c.quantization.has_value());
  EXPECT_EQ(c.dtype, "bfloat16");
  ExpectRoundTrip(c);
}

TEST(ModelConfigTest, Glm5Fp8) {
  absl::StatusOr<ModelConfig> loaded = LoadModelConfig(DataDir("glm5_fp8"));
  ASSERT_THAT(loaded, IsOk());
  ASSERT_TRUE(loaded->quantization.has_value());
  const QuantizationConfig& quant = *loaded->quantization;
  EXPECT_EQ(quant.method, QuantMethod::kFp8);
  EXPECT_EQ(quant.fmt, "e4m3");
  EXPECT_EQ(quant.activation_scheme, "dynamic");
  EXPECT_EQ(quant.weight_block_rows, 128);
  EXPECT_EQ(quant.weight_block_cols, 128);
  ASSERT_TRUE(quant.modules_to_not_convert.has_value());
  EXPECT_TRUE(quant.IsNotConverted("lm_head"));
  EXPECT_TRUE(quant.IsNotConverted("model.layers.3.mlp.gate"));
  EXPECT_TRUE(quant.IsNotConverted("model.layers.0.self_attn.indexer.weights_proj"));
  EXPECT_TRUE(quant.IsNotConverted("model.embed_tokens.weight"));      // below a listed module
  EXPECT_FALSE(quant.IsNotConverted("model.layers.0.mlp.gate_proj"));  // not a '.' boundary
  EXPECT_FALSE(quant.IsNotConverted("model.layers.3.mlp.experts.0.gate_proj"));
  EXPECT_FALSE(quant.IsNotConverted("model.layers.0.self_attn.q_b_proj"));
  ExpectRoundTrip(*loaded);
}

TEST(ModelConfigTest, DeepseekV3) {
  absl::StatusOr<ModelConfig> loaded = LoadModelConfig(DataDir("deepseek_v3"));
  ASSERT_THAT(loaded, IsOk());
  const ModelConfig& c = *loaded;
  EXPECT_EQ(c.architecture, Architecture::kDeepseekV3);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.vocab_size, 129280);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.num_attention_heads, 128);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.QkHeadDim(), 192);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.n_routed_experts, 256);
  EXPECT_EQ(c.n_group, 8);
  EXPECT_EQ(c.topk_group, 4);
  EXPECT_EQ(c.FirstKDenseReplace(), 3);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 163840);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(1));
  EXPECT_FALSE(c.pad_token_id.has_value());
  EXPECT_TRUE(c.rope_interleave);  // absent: DeepseekV3Config default
  EXPECT_EQ(c.rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_DOUBLE_EQ(c.rope.yarn.factor, 40.0);
  EXPECT_EQ(c.rope.yarn.original_max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rope.yarn.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.yarn.beta_slow, 1.0);
  EXPECT_EQ(c.rope.yarn.mscale, 1.0);
  EXPECT_EQ(c.rope.yarn.mscale_all_dim, 1.0);
  EXPECT_TRUE(c.rope.yarn.truncate);
  EXPECT_DOUBLE_EQ(c.AttentionScaling(), 1.0);
  // 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.07216878364870323 * 1.8738542070926265.
  EXPECT_NEAR(c.SoftmaxScale(), 0.1352337788608801, 1e-15);
  EXPECT_NEAR(c.RopeInvFreq()[16], 0.0055, 1e-15);
  EXPECT_FALSE(c.indexer.enabled);
  EXPECT_TRUE(c.indexer.kinds.empty());
  EXPECT_EQ(c.num_nextn_predict_layers, 1);
  ASSERT_TRUE(c.quantization.has_value());
  EXPECT_EQ(c.quantization->weight_block_rows, 128);
  EXPECT_FALSE(c.quantization->modules_to_not_convert.has_value());
  EXPECT_FALSE(c.quantization->IsNotConverted("lm_head"));
  EXPECT_EQ(c.dtype, "bfloat16");  // from torch_dtype
  ExpectRoundTrip(c);
}

TEST(ModelConfigTest, DeepseekV3Defaults) {
  Json json = TinyDeepseekV3();
  json["n_group"] = 1;  // the class default 8 would leave one expert per group
  json.erase("topk_group");
  json["topk_group"] = 1;
  json.erase("first_k_dense_replace");
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.model_type, "deepseek_v3");
  EXPECT_EQ(c.num_key_value_heads, 4);  // = num_attention_heads
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_DOUBLE_EQ(c.routed_scaling_factor, 2.5);
  EXPECT_TRUE(c.norm_topk_prob);
  EXPECT_EQ(c.FirstKDenseReplace(), 3);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 0);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(1));
  EXPECT_FALSE(c.pad_token_id.has_value());
  EXPECT_EQ(c.rope.type, RopeType::kDefault);
  EXPECT_DOUBLE_EQ(c.rope.theta, 10000.0);
  EXPECT_TRUE(c.rope_interleave);
  EXPECT_EQ(c.num_nextn_predict_layers, 0);
  EXPECT_FALSE(c.quantization.has_value());
  EXPECT_EQ(c.dtype, "");
  EXPECT_DOUBLE_EQ(c.SoftmaxScale(), 1.0 / std::sqrt(24.0));

  // The class defaults for n_group / topk_group are DeepSeek-V3's 8 / 4.
  json = TinyDeepseekV3();
  json.erase("n_group");
  json.erase("topk_group");
  json["n_routed_experts"] = 16;
  const ModelConfig grouped = ParseOrDie(json);
  EXPECT_EQ(grouped.n_group, 8);
  EXPECT_EQ(grouped.topk_group, 4);
}

TEST(ModelConfigTest, GlmMoeDsaDefaults) {
  Json json = TinyGlmMoeDsa();
  for (const char* key :
       {"n_group", "topk_group", "index_topk", "index_head_dim", "index_n_heads"}) {
    json.erase(key);
  }
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.model_type, "glm_moe_dsa");
  EXPECT_EQ(c.n_group, 1);
  EXPECT_EQ(c.topk_group, 1);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.max_position_embeddings, 202752);
  EXPECT_EQ(c.indexer.topk, 2048);
  EXPECT_EQ(c.indexer.head_dim, 128);
  EXPECT_EQ(c.indexer.n_heads, 32);
  EXPECT_FALSE(c.indexer.rope_interleave);
  EXPECT_THAT(c.indexer.kinds, Each(Eq(IndexerKind::kFull)));
}

TEST(ModelConfigTest, NullQLoraRankMeansPlainQProj) {
  Json json = TinyDeepseekV3();
  json["q_lora_rank"] = nullptr;
  const ModelConfig c = ParseOrDie(json);
  EXPECT_FALSE(c.HasQLora());
  EXPECT_EQ(c.q_lora_rank, 0);
  ExpectRoundTrip(c);
  json["q_lora_rank"] = 0;
  EXPECT_FALSE(ParseOrDie(json).HasQLora());
}

TEST(ModelConfigTest, TokenIdForms) {
  Json json = TinyDeepseekV3();
  json["eos_token_id"] = {3, 5};
  json["bos_token_id"] = nullptr;
  json["pad_token_id"] = 7;
  ModelConfig c = ParseOrDie(json);
  EXPECT_THAT(c.eos_token_ids, ElementsAre(3, 5));
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_EQ(c.pad_token_id, 7);
  ExpectRoundTrip(c);
  json["eos_token_id"] = nullptr;
  c = ParseOrDie(json);
  EXPECT_TRUE(c.eos_token_ids.empty());
  ExpectRoundTrip(c);
}

TEST(ModelConfigTest, GlmMlpLayerTypes) {
  Json json = TinyGlmMoeDsa();
  json.erase("first_k_dense_replace");
  json["mlp_layer_types"] = {"dense", "sparse", "dense", "sparse"};
  ModelConfig c = ParseOrDie(json);
  EXPECT_THAT(c.mlp_kinds,
              ElementsAre(MlpKind::kDense, MlpKind::kMoe, MlpKind::kDense, MlpKind::kMoe));
  EXPECT_EQ(c.FirstKDenseReplace(), 1);
  ExpectRoundTrip(c);
  // Both keys, agreeing on the leading dense run.
  json["first_k_dense_replace"] = 1;
  EXPECT_THAT(ParseOrDie(json).mlp_kinds,
              ElementsAre(MlpKind::kDense, MlpKind::kMoe, MlpKind::kDense, MlpKind::kMoe));
}

TEST(ModelConfigTest, IndexerScheduleFromFreqAndOffset) {
  // GLM-5.2's IndexShare schedule: index_topk_freq 4, index_skip_topk_offset 3:
  // full when max(i - 2, 0) % 4 == 0 -> layers 0, 1, 2, 6, 10.
  Json json = TinyGlmMoeDsa();
  json["num_hidden_layers"] = 12;
  json["index_topk_freq"] = 4;
  json["index_skip_topk_offset"] = 3;
  const ModelConfig c = ParseOrDie(json);
  constexpr IndexerKind F = IndexerKind::kFull;
  constexpr IndexerKind S = IndexerKind::kShared;
  EXPECT_THAT(c.indexer.kinds, ElementsAre(F, F, F, S, S, S, F, S, S, S, F, S));
  EXPECT_EQ(c.indexer.SelectionSourceLayer(2), 2);
  EXPECT_EQ(c.indexer.SelectionSourceLayer(3), 2);
  EXPECT_EQ(c.indexer.SelectionSourceLayer(5), 2);
  EXPECT_EQ(c.indexer.SelectionSourceLayer(6), 6);
  EXPECT_EQ(c.indexer.SelectionSourceLayer(11), 10);
  EXPECT_EQ(c.indexer.SelectionSourceLayer(12), 12);  // MTP layer: its own
  ExpectRoundTrip(c);

  // An explicit list wins over the schedule; a pattern string is read per character.
  json["num_hidden_layers"] = 4;
  json["index_topk_pattern"] = "FSFS";
  EXPECT_THAT(ParseOrDie(json).indexer.kinds, ElementsAre(F, S, F, S));
  json["indexer_types"] = {"full", "full", "shared", "full"};
  EXPECT_THAT(ParseOrDie(json).indexer.kinds, ElementsAre(F, F, S, F));
}

TEST(ModelConfigTest, YarnInRopeParameters) {
  // transformers 5 layout: everything, rope_theta included, inside rope_parameters.
  Json json = TinyDeepseekV3();
  json["max_position_embeddings"] = 32768;
  json["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 50000.0},
                             {"factor", 8},         {"beta_fast", 0},  // HF: `or 32`
                             {"truncate", false},   {"attention_factor", 1.25}};
  json["rope_theta"] = 1.0;  // the dict's value wins
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.theta, 50000.0);
  EXPECT_DOUBLE_EQ(c.rope.yarn.factor, 8.0);
  EXPECT_EQ(c.rope.yarn.original_max_position_embeddings, 32768);  // max_position_embeddings
  EXPECT_DOUBLE_EQ(c.rope.yarn.beta_fast, 32.0);
  EXPECT_DOUBLE_EQ(c.rope.yarn.beta_slow, 1.0);
  EXPECT_FALSE(c.rope.yarn.truncate);
  EXPECT_DOUBLE_EQ(c.AttentionScaling(), 1.25);
  EXPECT_FALSE(c.rope.yarn.mscale_all_dim.has_value());
  EXPECT_DOUBLE_EQ(c.SoftmaxScale(), 1.0 / std::sqrt(24.0));  // no mscale_all_dim
  ExpectRoundTrip(c);
}

TEST(ModelConfigTest, RopeScalingWinsAndTopLevelOriginalLengthWins) {
  Json json = TinyDeepseekV3();
  json["rope_theta"] = 20000;
  json["original_max_position_embeddings"] = 1024;
  json["rope_parameters"] = {{"rope_type", "default"}};
  json["rope_scaling"] = {{"type", "yarn"},
                          {"factor", 4},
                          {"original_max_position_embeddings", 2048},
                          {"mscale", 0.707},
                          {"mscale_all_dim", 0.707}};
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.rope.type, RopeType::kYarn);
  EXPECT_DOUBLE_EQ(c.rope.theta, 20000.0);
  EXPECT_EQ(c.rope.yarn.original_max_position_embeddings, 1024);
  EXPECT_DOUBLE_EQ(c.AttentionScaling(), 1.0);
  const double mscale = 0.1 * 0.707 * std::log(4.0) + 1.0;
  EXPECT_NEAR(c.SoftmaxScale(), mscale * mscale / std::sqrt(24.0), 1e-15);
  ExpectRoundTrip(c);

  // transformers 5.17's GlmMoeDsaAttention applies the same mscale correction
  // (docs/model_math.md 5.2).
  json["architectures"] = {"GlmMoeDsaForCausalLM"};
  EXPECT_NEAR(ParseOrDie(json).SoftmaxScale(), mscale * mscale / std::sqrt(24.0), 1e-15);
}

TEST(ModelConfigTest, FirstSupportedArchitectureIsTaken) {
  Json json = TinyDeepseekV3();
  json["architectures"] = {"SomethingElse", "DeepseekV3ForCausalLM"};
  json["model_type"] = "kimi_k2";
  const ModelConfig c = ParseOrDie(json);
  EXPECT_EQ(c.architecture, Architecture::kDeepseekV3);
  EXPECT_EQ(c.model_type, "kimi_k2");
  ExpectRoundTrip(c);
}

TEST(ModelConfigTest, ToJsonIsHfShaped) {
  absl::StatusOr<ModelConfig> loaded = ParseModelConfig(ReadDataConfig("deepseek_v3"));
  ASSERT_THAT(loaded, IsOk());
  const Json written = Json::parse(loaded->ToJson());
  EXPECT_EQ(written["architectures"], Json({"DeepseekV3ForCausalLM"}));
  EXPECT_EQ(written["rope_theta"], 10000.0);
  EXPECT_EQ(written["rope_parameters"]["rope_type"], "yarn");
  EXPECT_EQ(written["rope_parameters"]["rope_theta"], 10000.0);
  EXPECT_EQ(written["rope_scaling"]["factor"], 40.0);
  EXPECT_EQ(written["head_dim"], 64);
  EXPECT_EQ(written["qk_head_dim"], 192);
  EXPECT_EQ(written["quantization_config"]["weight_block_size"], Json({128, 128}));
  EXPECT_EQ(written["dtype"], "bfloat16");
  EXPECT_FALSE(written.contains("mlp_layer_types"));  // DeepseekV3Config has no such key
  EXPECT_FALSE(written.contains("index_topk"));

  const ModelConfig glm = ParseOrDie(TinyGlmMoeDsa());
  const Json glm_written = Json::parse(glm.ToJson());
  EXPECT_EQ(glm_written["indexer_types"].size(), 4u);
  EXPECT_EQ(glm_written["mlp_layer_types"][0], "dense");
  EXPECT_FALSE(glm_written.contains("rope_scaling"));
  EXPECT_EQ(glm_written["q_lora_rank"], 32);
  ExpectRoundTrip(glm);
}

}  // namespace
}  // namespace nq::model
