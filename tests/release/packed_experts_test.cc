// Routed experts served as the release's packed codes (issue #12): the model's logits equal the
// old dense decode's (every expert dequantised by the codec into dense weights) at 2 bits, 4 bits
// and the fixed set; a checkpoint without any expert weights serves; the memory the experts take
// is the packed planes, not 32 bits a weight. Both codecs: nested_scalar_v1 and (on a narrower
// model, the encoder being slow) trellis_v1.
#include "services/release/packed_experts.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "services/format/release_reader.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/model/model.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"
#include "services/model/synth_checkpoint.h"
#include "services/release/release_encoder.h"
#include "services/release/release_experts.h"
#include "tests/common/status_matchers.h"

namespace nq::release {
namespace {

using ::nq::testing::IsOk;
namespace fs = std::filesystem;

double MaxAbsDiffOverMax(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, max = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - want[i]));
    max = std::max(max, std::abs(static_cast<double>(want[i])));
  }
  return diff / max;
}

// The reference: every routed expert dequantised by the codec (ReleaseExpertDecoder::Upload)
// into dense F32 weights, run by the dense MoE path.
std::vector<float> DenseDecodeLogits(const std::string& model_dir, const std::string& release_dir, ExpertBits bits,
                                     const std::vector<int32_t>& tokens, kernels::Backend& backend) {
  absl::StatusOr<model::ModelConfig> config = model::LoadModelConfig(model_dir);
  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(model_dir);
  absl::StatusOr<std::unique_ptr<ReleaseExpertDecoder>> decoder =
      ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {});
  EXPECT_TRUE(config.ok() && checkpoint.ok() && decoder.ok());
  if (!config.ok() || !checkpoint.ok() || !decoder.ok()) return {};
  absl::StatusOr<model::ModelWeights> weights = model::LoadModelWeights(*checkpoint, *config, backend, {});
  EXPECT_THAT(weights, IsOk());
  if (!weights.ok()) return {};
  for (uint32_t layer : (*decoder)->moe_layer_ids()) {
    model::LayerWeights& lw = layer < config->num_hidden_layers ? weights->layers[layer]
                                                                : weights->mtp[layer - config->num_hidden_layers].block;
    const std::vector<uint32_t> fixed = (*decoder)->FixedSet(layer);
    for (uint32_t e = 0; e < lw.moe->experts.size(); ++e) {
      const bool four = bits == ExpertBits::k4Bit ||
                        (bits == ExpertBits::kFixedSet && std::find(fixed.begin(), fixed.end(), e) != fixed.end());
      absl::StatusOr<model::MlpWeights> w =
          (*decoder)->Upload(layer, e, four ? quant::Precision::k4Bit : quant::Precision::k2Bit, {}, backend);
      EXPECT_THAT(w, IsOk());
      if (!w.ok()) return {};
      lw.moe->experts[e] = *std::move(w);
    }
  }
  absl::StatusOr<std::unique_ptr<model::Model>> m =
      model::Model::Create(*std::move(config), *std::move(weights), backend, nullptr, {.max_tokens = 64});
  EXPECT_THAT(m, IsOk());
  if (!m.ok()) return {};
  absl::StatusOr<std::vector<float>> logits = (*m)->Forward(tokens);
  EXPECT_THAT(logits, IsOk());
  return logits.ok() ? *std::move(logits) : std::vector<float>();
}

absl::StatusOr<model::ModelConfig> EncodeConfig() {
  std::ifstream in(std::string(NQ_SOURCE_DIR) + "/configs/test/glm5_encode.json");
  std::stringstream text;
  text << in.rdbuf();
  return model::ParseModelConfig(text.str());
}

// A synthetic checkpoint and its release in a temporary directory, made once per suite.
class ReleaseSuite : public ::testing::Test {
 protected:
  static void Make(const std::string& name, const model::ModelConfig& config, uint64_t seed,
                   const EncodeReleaseOptions& options) {
    root_ = new fs::path(fs::temp_directory_path() / absl::StrCat(name, "-", getpid()));
    fs::remove_all(*root_);
    ASSERT_THAT(model::WriteSyntheticCheckpoint(config, (*root_ / "model").string(), {.seed = seed}), IsOk());
    ASSERT_THAT(EncodeRelease((*root_ / "model").string(), (*root_ / "release").string(), options), IsOk());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
    root_ = nullptr;
  }
  static std::string Dir(const char* name) { return (*root_ / name).string(); }

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> b = kernels::CreateBackend("cpu");
    ASSERT_THAT(b, IsOk());
    backend_ = *std::move(b);
  }

  static fs::path* root_;
  std::unique_ptr<kernels::Backend> backend_;
};
fs::path* ReleaseSuite::root_ = nullptr;

class PackedExpertsTest : public ReleaseSuite {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<model::ModelConfig> config = EncodeConfig();
    ASSERT_THAT(config, IsOk());
    Make("nq-packed-test", *config, 5, {.fixed_per_layer = 3});
  }
};

TEST_F(PackedExpertsTest, LogitsEqualTheDenseDecodeAtEveryPolicy) {
  const std::vector<int32_t> tokens = {1, 50, 7, 300, 22, 9, 411, 5, 64, 128, 3, 77, 12, 200};
  for (ExpertBits bits : {ExpertBits::k2Bit, ExpertBits::k4Bit, ExpertBits::kFixedSet}) {
    absl::StatusOr<std::unique_ptr<model::Model>> packed =
        LoadModelWithRelease(Dir("model"), Dir("release"), bits, *backend_, nullptr, {.max_tokens = 64});
    ASSERT_THAT(packed, IsOk());
    absl::StatusOr<std::vector<float>> got = (*packed)->Forward(tokens);
    ASSERT_THAT(got, IsOk());
    const double error = MaxAbsDiffOverMax(*got, DenseDecodeLogits(Dir("model"), Dir("release"), bits, tokens, *backend_));
    std::printf("[ packed   ] bits policy %d: max |packed - dense decode| / max |logit| = %.3g\n",
                static_cast<int>(bits), error);
    EXPECT_LT(error, 1e-4);
  }
}

TEST_F(PackedExpertsTest, ACheckpointWithoutExpertWeightsServesAndHoldsOnlyPackedCodes) {
  // The same checkpoint with every routed expert tensor removed.
  absl::StatusOr<model::Checkpoint> full = model::Checkpoint::Open(Dir("model"));
  ASSERT_THAT(full, IsOk());
  model::SafetensorsWriter writer;
  int64_t expert_weights = 0;
  for (const std::string& name : full->Names()) {
    absl::StatusOr<model::TensorView> view = full->Find(name);
    ASSERT_THAT(view, IsOk());
    if (absl::StrContains(name, ".mlp.experts.")) {
      expert_weights += static_cast<int64_t>(view->numel());
      continue;
    }
    ASSERT_THAT(writer.Add(name, view->dtype, std::vector<int64_t>(view->shape.begin(), view->shape.end()),
                           std::vector<std::byte>(view->data.begin(), view->data.end())),
                IsOk());
  }
  const std::string stripped = Dir("no_experts");
  ASSERT_THAT(writer.WriteCheckpoint(stripped), IsOk());
  fs::copy_file(Dir("model") + "/config.json", stripped + "/config.json");
  absl::StatusOr<std::unique_ptr<model::Model>> m =
      LoadModelWithRelease(stripped, Dir("release"), ExpertBits::k2Bit, *backend_, nullptr, {.max_tokens = 64});
  ASSERT_THAT(m, IsOk());
  const std::vector<int32_t> tokens = {1, 50, 7, 300};
  absl::StatusOr<std::vector<float>> logits = (*m)->Forward(tokens);
  ASSERT_THAT(logits, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> from_full =
      LoadModelWithRelease(Dir("model"), Dir("release"), ExpertBits::k2Bit, *backend_, nullptr, {.max_tokens = 64});
  ASSERT_THAT(from_full, IsOk());
  EXPECT_EQ(*logits, *(*from_full)->Forward(tokens)) << "the checkpoint's expert weights are never read";
  // 2 bits a weight plus fp32 row/column scales, tables and signs: far from 32 bits a weight.
  const double bits_per_weight = 8.0 * static_cast<double>((*m)->RoutedExpertBytes()) / expert_weights;
  std::printf("[ packed   ] routed experts held at %.2f bits per weight (%lld weights)\n", bits_per_weight,
              static_cast<long long>(expert_weights));
  EXPECT_GT(bits_per_weight, 2.0);
  EXPECT_LT(bits_per_weight, 8.0);
}

// What the model holds for its routed experts is exactly the release's resident planes (codes,
// row and column scales, the two codebooks as one level table of the same size) plus one set of
// rotation signs per layer: nothing dense, nothing decoded.
TEST_F(PackedExpertsTest, RoutedExpertBytesAreTheResidentPlanesAndTheLayersSigns) {
  absl::StatusOr<std::unique_ptr<model::Model>> m =
      LoadModelWithRelease(Dir("model"), Dir("release"), ExpertBits::k2Bit, *backend_, nullptr, {.max_tokens = 16});
  ASSERT_THAT(m, IsOk());
  absl::StatusOr<format::Release> release = format::Release::Open(Dir("release"));
  ASSERT_THAT(release, IsOk());
  int64_t expected = 0;
  for (const format::ManifestLayer& layer : release->manifest().layers) {
    absl::StatusOr<std::string> path = release->ResidentPath(0, layer.layer);
    ASSERT_THAT(path, IsOk());
    absl::StatusOr<model::SafetensorsFile> resident = model::SafetensorsFile::Open(*path);
    ASSERT_THAT(resident, IsOk());
    for (const std::string& name : resident->Names()) {
      if (absl::EndsWith(name, ".rotation")) continue;  // the seeds; the model holds the signs
      absl::StatusOr<model::TensorView> view = resident->Find(name);
      ASSERT_THAT(view, IsOk());
      expected += static_cast<int64_t>(view->data.size());
    }
    // Signs of the four rotations: gate/up columns and down rows (hidden), gate/up rows and
    // down columns (intermediate).
    const model::ModelConfig& c = (*m)->config();
    expected += 4 * (2 * c.hidden_size + 2 * c.moe_intermediate_size);
  }
  EXPECT_EQ((*m)->RoutedExpertBytes(), expected);
}

TEST_F(PackedExpertsTest, AModelWithoutExpertsOrReleaseIsRefusedByName) {
  absl::StatusOr<model::ModelConfig> config = model::LoadModelConfig(Dir("model"));
  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(Dir("model"));
  ASSERT_TRUE(config.ok() && checkpoint.ok());
  absl::StatusOr<model::ModelWeights> weights =
      model::LoadModelWeights(*checkpoint, *config, *backend_, {}, {.routed_experts = false});
  ASSERT_THAT(weights, IsOk());
  EXPECT_THAT(model::Model::Create(*std::move(config), *std::move(weights), *backend_, nullptr, {}),
              nq::testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("none packed")));
}

// A trellis_v1 release through the same packed op. The narrow model of release_encoder_test
// (3 experts of 128 x 16, top 2) keeps the Viterbi encode to seconds.
class PackedTrellisExpertsTest : public ReleaseSuite {
 protected:
  static void SetUpTestSuite() {
    absl::StatusOr<model::ModelConfig> config = EncodeConfig();
    ASSERT_THAT(config, IsOk());
    config->n_routed_experts = 3;
    config->num_experts_per_tok = 2;
    config->moe_intermediate_size = 16;
    Make("nq-packed-trellis-test", *config, 7, {.fixed_per_layer = 1, .codec = "trellis"});
  }
};

TEST_F(PackedTrellisExpertsTest, LogitsEqualTheDenseDecodeAtEveryPolicy) {
  const std::vector<int32_t> tokens = {1, 50, 7, 300, 22, 9, 411, 5, 64, 128, 3, 77, 12, 200};
  std::vector<std::vector<float>> by_policy;
  for (ExpertBits bits : {ExpertBits::k2Bit, ExpertBits::k4Bit, ExpertBits::kFixedSet}) {
    absl::StatusOr<std::unique_ptr<model::Model>> packed =
        LoadModelWithRelease(Dir("model"), Dir("release"), bits, *backend_, nullptr, {.max_tokens = 64});
    ASSERT_THAT(packed, IsOk());
    absl::StatusOr<std::vector<float>> got = (*packed)->Forward(tokens);
    ASSERT_THAT(got, IsOk());
    const double error =
        MaxAbsDiffOverMax(*got, DenseDecodeLogits(Dir("model"), Dir("release"), bits, tokens, *backend_));
    std::printf("[ packed   ] trellis_v1, bits policy %d: max |packed - dense decode| / max |logit| = %.3g\n",
                static_cast<int>(bits), error);
    EXPECT_LT(error, 1e-4);
    by_policy.push_back(*std::move(got));
  }
  // The policies must differ, or the 4-bit residual planes were never read.
  EXPECT_GT(MaxAbsDiffOverMax(by_policy[1], by_policy[0]), 1e-3);
}

// The layer's routed experts are the resident planes: codes, scales and the gains (one base and
// one residual gain per 16-column block, as the codec stored them) plus the rotations' signs.
TEST_F(PackedTrellisExpertsTest, RoutedExpertBytesAreTheResidentPlanesAndGains) {
  absl::StatusOr<std::unique_ptr<model::Model>> m =
      LoadModelWithRelease(Dir("model"), Dir("release"), ExpertBits::k2Bit, *backend_, nullptr, {.max_tokens = 16});
  ASSERT_THAT(m, IsOk());
  absl::StatusOr<format::Release> release = format::Release::Open(Dir("release"));
  ASSERT_THAT(release, IsOk());
  int64_t expected = 0;
  for (const format::ManifestLayer& layer : release->manifest().layers) {
    absl::StatusOr<std::string> path = release->ResidentPath(0, layer.layer);
    ASSERT_THAT(path, IsOk());
    absl::StatusOr<model::SafetensorsFile> resident = model::SafetensorsFile::Open(*path);
    ASSERT_THAT(resident, IsOk());
    for (const std::string& name : resident->Names()) {
      if (absl::EndsWith(name, ".rotation")) continue;
      absl::StatusOr<model::TensorView> view = resident->Find(name);
      ASSERT_THAT(view, IsOk());
      expected += static_cast<int64_t>(view->data.size());
    }
    const model::ModelConfig& c = (*m)->config();
    expected += 4 * (2 * c.hidden_size + 2 * c.moe_intermediate_size);
  }
  EXPECT_EQ((*m)->RoutedExpertBytes(), expected);
}

}  // namespace
}  // namespace nq::release
