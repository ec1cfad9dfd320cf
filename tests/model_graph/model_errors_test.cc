// Bad checkpoints, configs and inputs give precise errors; synthetic checkpoints load.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <span>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/model/model.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_load.h"
#include "services/model/safetensors_writer.h"
#include "services/model/synth_checkpoint.h"
#include "tests/common/status_matchers.h"
#include "tests/model_graph/fixture_util.h"

namespace nq::model {
namespace {

using ::nq::model::testing::FixtureDir;
using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

namespace fs = std::filesystem;

class ModelErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
    ASSERT_THAT(backend, IsOk());
    backend_ = *std::move(backend);
    dir_ = fs::temp_directory_path() /
           absl::StrCat("nq-model-errors-", getpid(), "-",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // A copy of a fixture's config with `edit` applied, and its weights minus `drop`.
  void CopyFixture(const std::string& name, const std::function<void(nlohmann::json&)>& edit,
                   const std::string& drop = "") {
    const std::string src = FixtureDir(name);
    std::ifstream in(src + "/config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    if (edit) edit(config);
    std::ofstream(dir_ / "config.json") << config.dump(2);
    absl::StatusOr<Checkpoint> checkpoint = Checkpoint::Open(src);
    ASSERT_THAT(checkpoint, IsOk());
    SafetensorsWriter writer;
    for (const std::string& tensor : checkpoint->Names()) {
      if (tensor == drop) continue;
      absl::StatusOr<FloatTensor> values = LoadFloat32(*checkpoint, tensor);
      ASSERT_THAT(values, IsOk());
      ASSERT_THAT(writer.AddFloat32(tensor, values->shape, values->values), IsOk());
    }
    ASSERT_THAT(writer.WriteCheckpoint(dir_.string()), IsOk());
  }

  absl::StatusOr<std::unique_ptr<Model>> Load(int rank = 0, int world = 1) {
    return Model::Load(dir_.string(), *backend_, nullptr, ModelOptions{.max_tokens = 16, .tp = {rank, world}});
  }

  std::unique_ptr<kernels::Backend> backend_;
  fs::path dir_;
};

TEST_F(ModelErrorsTest, MissingTensorIsNamed) {
  CopyFixture("dsv3_tiny", nullptr, "model.layers.1.mlp.experts.7.down_proj.weight");
  EXPECT_THAT(Load(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.layers.1.mlp.experts.7.down_proj.weight")));
}

TEST_F(ModelErrorsTest, ShapeThatDisagreesWithTheConfigIsNamed) {
  CopyFixture("dsv3_tiny", [](nlohmann::json& c) { c["kv_lora_rank"] = 40; });
  EXPECT_THAT(Load(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("kv_a_proj_with_mqa.weight has shape [48, 64], the config implies [56, 64]")));
}

TEST_F(ModelErrorsTest, UnsupportedArchitecture) {
  CopyFixture("dsv3_tiny", [](nlohmann::json& c) { c["architectures"] = {"LlamaForCausalLM"}; });
  EXPECT_THAT(Load(), StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("LlamaForCausalLM")));
}

TEST_F(ModelErrorsTest, SplitThatDoesNotDivide) {
  CopyFixture("dsv3_tiny", nullptr);
  EXPECT_THAT(Model::Load(dir_.string(), *backend_, nullptr, ModelOptions{.tp = {0, 3}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("num_attention_heads (4) does not divide by the tensor-parallel size 3")));
  // A world of 2 needs a communicator of that world.
  EXPECT_THAT(Model::Load(dir_.string(), *backend_, nullptr, ModelOptions{.tp = {0, 2}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs a communicator")));
}

TEST_F(ModelErrorsTest, BadInputs) {
  CopyFixture("glm5_tiny", nullptr);
  absl::StatusOr<std::unique_ptr<Model>> model = Load();
  ASSERT_THAT(model, IsOk());
  EXPECT_THAT((*model)->Forward({}), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tokens")));
  const std::vector<int32_t> out_of_vocab = {1, 512};
  EXPECT_THAT((*model)->Forward(out_of_vocab), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("512")));
  const std::vector<int32_t> too_long(17, 1);
  EXPECT_THAT((*model)->Forward(too_long), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceed")));
  EXPECT_EQ((*model)->cache_length(), 0) << "a failed forward must not advance the cache";
  EXPECT_THAT((*model)->TruncateCache(3), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncate")));
}

// ForwardSampled (the draw where the logits are): parameters outside their ranges are refused
// before anything runs; otherwise the id is the reference draw from Forward's last row (on the CPU
// backend, which captures no step graph, that is the path it takes), plus a logit delta if given.
TEST_F(ModelErrorsTest, ForwardSampledRefusesBadDrawsAndPicksTheReferenceId) {
  CopyFixture("glm5_tiny", nullptr);
  absl::StatusOr<std::unique_ptr<Model>> sampled = Load();
  absl::StatusOr<std::unique_ptr<Model>> plain = Load();
  ASSERT_THAT(sampled, IsOk());
  ASSERT_THAT(plain, IsOk());
  EXPECT_FALSE((*sampled)->SamplesOnDevice(1));
  const std::vector<int32_t> tokens = {5, 9, 2};
  for (const kernels::SampleParams& bad : {kernels::SampleParams{.temperature = -1},
                                           kernels::SampleParams{.u01 = 1.5, .temperature = 1},
                                           kernels::SampleParams{.temperature = 1, .top_p = 0}}) {
    EXPECT_THAT((*sampled)->ForwardSampled(tokens, bad), StatusIs(absl::StatusCode::kInvalidArgument,
                                                                  HasSubstr("ForwardSampled")));
  }
  EXPECT_EQ((*sampled)->cache_length(), 0);
  const kernels::SampleParams draw{.u01 = 0.37, .temperature = 0.9f, .top_p = 0.9f, .top_k = 40};
  absl::StatusOr<int32_t> id = (*sampled)->ForwardSampled(tokens, draw);
  ASSERT_THAT(id, IsOk());
  absl::StatusOr<std::vector<float>> logits = (*plain)->ForwardLast(tokens);
  ASSERT_THAT(logits, IsOk());
  EXPECT_EQ(*id, kernels::SampleRowHost(*logits, draw));
  EXPECT_EQ((*sampled)->cache_length(), 3);
  EXPECT_EQ((*sampled)->last_hidden(), (*plain)->last_hidden());

  // With a logit delta (a request's logit_bias and penalties) the draw reads the last row plus
  // the delta: a bias that lifts the least likely id past the best one makes greedy pick it. A
  // delta of another length, or with more than one token, is refused before anything runs.
  const int64_t vocab = (*sampled)->config().vocab_size;
  const std::vector<int32_t> token = {7};
  const kernels::SampleParams greedy{};
  std::vector<float> delta(static_cast<size_t>(vocab), 0.0f);
  EXPECT_THAT((*sampled)->ForwardSampled(token, greedy, std::span<const float>(delta).first(3)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logit delta")));
  EXPECT_THAT((*sampled)->ForwardSampled(tokens, greedy, delta),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("logit delta")));
  EXPECT_EQ((*sampled)->cache_length(), 3) << "a refused draw must not run";
  absl::StatusOr<std::vector<float>> next = (*plain)->ForwardLast(token);
  ASSERT_THAT(next, IsOk());
  const auto worst = std::min_element(next->begin(), next->end()) - next->begin();
  const float best = *std::max_element(next->begin(), next->end());
  delta[static_cast<size_t>(worst)] = best - (*next)[static_cast<size_t>(worst)] + 1.0f;
  absl::StatusOr<int32_t> lifted = (*sampled)->ForwardSampled(token, greedy, delta);
  ASSERT_THAT(lifted, IsOk());
  EXPECT_EQ(*lifted, worst);
  EXPECT_EQ((*sampled)->cache_length(), 4);
}

TEST_F(ModelErrorsTest, MtpNeedsAnMtpLayer) {
  const std::string src = FixtureDir("glm5_tiny");
  std::ifstream in(src + "/config.json");
  nlohmann::json json = nlohmann::json::parse(in);
  json["num_nextn_predict_layers"] = 0;
  absl::StatusOr<ModelConfig> config = ParseModelConfig(json.dump());
  ASSERT_THAT(config, IsOk());
  ASSERT_THAT(WriteSyntheticCheckpoint(*config, dir_.string(), SynthOptions{.seed = 1}), IsOk());
  absl::StatusOr<std::unique_ptr<Model>> model = Load();
  ASSERT_THAT(model, IsOk());
  const std::vector<int32_t> tokens = {3, 4};
  ASSERT_THAT((*model)->Forward(tokens), IsOk());
  EXPECT_THAT((*model)->ForwardMtp(std::span<const int32_t>(tokens).first(1), (*model)->last_hidden()),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("0 MTP layers")));
}

class SynthCheckpointTest : public ModelErrorsTest, public ::testing::WithParamInterface<SynthDtype> {};

TEST_P(SynthCheckpointTest, LoadsAndRunsEveryDtypeAndShardedLikeUnsharded) {
  for (const char* name : {"glm5_tiny", "dsv3_tiny"}) {
    std::ifstream in(FixtureDir(name) + "/config.json");
    absl::StatusOr<ModelConfig> config = ParseModelConfig(nlohmann::json::parse(in).dump());
    ASSERT_THAT(config, IsOk());
    const std::vector<int32_t> tokens = {5, 17, 300, 2, 9, 11};
    std::vector<float> unsharded;
    for (uint64_t shard_bytes : {0ull, 256ull << 10}) {
      fs::remove_all(dir_);
      ASSERT_THAT(WriteSyntheticCheckpoint(*config, dir_.string(),
                                           SynthOptions{.dtype = GetParam(), .seed = 7, .max_shard_bytes = shard_bytes}),
                  IsOk());
      EXPECT_EQ(fs::exists(dir_ / "model.safetensors.index.json"), shard_bytes != 0);
      absl::StatusOr<std::unique_ptr<Model>> model = Load();
      ASSERT_THAT(model, IsOk()) << name;
      absl::StatusOr<std::vector<float>> logits = (*model)->Forward(tokens);
      ASSERT_THAT(logits, IsOk());
      for (float v : *logits) ASSERT_TRUE(std::isfinite(v));
      absl::StatusOr<std::vector<float>> mtp = (*model)->ForwardMtp(
          std::span<const int32_t>(tokens).subspan(1),
          std::span<const float>((*model)->last_hidden()).first(5 * config->hidden_size));
      ASSERT_THAT(mtp, IsOk());
      if (shard_bytes == 0) {
        unsharded = *logits;
      } else {
        EXPECT_EQ(*logits, unsharded) << name << ": sharding must not change the weights";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, SynthCheckpointTest,
                         ::testing::Values(SynthDtype::kF32, SynthDtype::kBF16, SynthDtype::kFp8));

}  // namespace
}  // namespace nq::model
