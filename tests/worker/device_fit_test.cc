// The CUDA worker's fit check (services/worker/device_fit.h), computed before loading, against
// what a loaded model really holds: the embedded default served from its release.
#include "services/worker/device_fit.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "kernels/backend.h"
#include "services/model/model.h"
#include "services/model/model_weights.h"
#include "services/release/release_expert_decoder.h"
#include "services/release/release_experts.h"
#include "tests/common/embedded_model.h"

namespace nq::worker {
namespace {

using ::testing::HasSubstr;

class DeviceFitTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_NO_FATAL_FAILURE(nq::testing::PrepareEmbeddedModel(NQ_TOOL_BIN, NQ_SOURCE_DIR, NQ_EMBEDDED_MODEL_DIR));
  }
  static std::string ModelDir() { return NQ_EMBEDDED_MODEL_DIR; }
};

TEST_F(DeviceFitTest, EstimateMatchesWhatTheLoadedModelHolds) {
  absl::StatusOr<model::ModelConfig> config = model::LoadModelConfig(ModelDir());
  ASSERT_TRUE(config.ok()) << config.status();
  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(ModelDir());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  absl::StatusOr<std::unique_ptr<release::ReleaseExpertDecoder>> decoder =
      release::ReleaseExpertDecoder::Open(ModelDir() + "/release", ModelDir(), *config, {});
  ASSERT_TRUE(decoder.ok()) << decoder.status();
  const model::ModelOptions options{.max_tokens = 384, .kv_cache_dtype = kernels::DType::kBF16};

  absl::StatusOr<DeviceBytesEstimate> from_release =
      EstimateDeviceBytes({.checkpoint = &*checkpoint,
                           .config = &*config,
                           .release = &(*decoder)->release(),
                           .max_tokens = options.max_tokens,
                           .kv_cache_dtype = options.kv_cache_dtype,
                           .slot_arena_bytes = 12345});
  ASSERT_TRUE(from_release.ok()) << from_release.status();
  absl::StatusOr<DeviceBytesEstimate> from_checkpoint = EstimateDeviceBytes(
      {.checkpoint = &*checkpoint, .config = &*config, .max_tokens = options.max_tokens,
       .kv_cache_dtype = options.kv_cache_dtype});
  ASSERT_TRUE(from_checkpoint.ok()) << from_checkpoint.status();

  // Load as nq-worker does: non-expert weights from the checkpoint, routed experts from the release.
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  absl::StatusOr<model::ModelWeights> weights =
      model::LoadModelWeights(*checkpoint, *config, **backend, options.tp, {.routed_experts = false});
  ASSERT_TRUE(weights.ok()) << weights.status();
  ASSERT_TRUE(release::ApplyReleaseExperts(**decoder, *config, release::ExpertBits::k2Bit, **backend, *weights).ok());
  absl::StatusOr<std::unique_ptr<model::Model>> loaded =
      model::Model::Create(*config, *std::move(weights), **backend, nullptr, options);
  ASSERT_TRUE(loaded.ok()) << loaded.status();

  // The KV cache is computed by the allocator's own formula, MTP layer included.
  EXPECT_EQ(from_release->kv_cache, static_cast<uint64_t>((*loaded)->kv_cache_bytes()));
  EXPECT_GT(config->num_nextn_predict_layers, 0);
  // The release's resident files: the packed codes the model holds plus each file's safetensors
  // header (tensor names and offsets: tens of KiB, whatever the model's size).
  const auto held = static_cast<uint64_t>((*loaded)->RoutedExpertBytes());
  const uint64_t files = (*decoder)->release().indexes().at(0).layers.size();
  EXPECT_GE(from_release->routed_experts, held);
  EXPECT_LE(from_release->routed_experts, held + files * (64 << 10));
  EXPECT_EQ(from_release->slot_arena, 12345u);
  // Serving from the release drops exactly the decoder layers' routed experts from the dense
  // weights, as F32.
  uint64_t routed_f32 = 0;
  for (const std::string& name : checkpoint->Names()) {
    if (!absl::StrContains(name, ".mlp.experts.")) continue;
    const int64_t layer = std::stoll(name.substr(std::string("model.layers.").size()));
    if (layer < config->num_hidden_layers) routed_f32 += checkpoint->Find(name)->numel() * sizeof(float);
  }
  ASSERT_GT(routed_f32, 0u);
  EXPECT_EQ(from_checkpoint->dense_weights - from_release->dense_weights, routed_f32);
  EXPECT_EQ(from_checkpoint->routed_experts, 0u);
  EXPECT_EQ(from_release->total(), from_release->dense_weights + from_release->routed_experts +
                                       from_release->kv_cache + 12345 + kDeviceWorkspaceBytes);
}

TEST(DeviceFit, RefusalNamesWhatIsNeededAndWhatIsFree) {
  const DeviceBytesEstimate needed{.dense_weights = uint64_t{3} << 30, .kv_cache = uint64_t{1} << 30,
                                   .workspace = kDeviceWorkspaceBytes};
  EXPECT_TRUE(CheckFitsOnDevice(needed, uint64_t{5} << 30, uint64_t{8} << 30, "GPU 0 (test)").ok());
  const absl::Status refused = CheckFitsOnDevice(needed, uint64_t{4} << 30, uint64_t{8} << 30, "GPU 0 (test)");
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(refused.message(), HasSubstr("GPU 0 (test)"));
  EXPECT_THAT(refused.message(), HasSubstr("needs about 5.00 GiB"));
  EXPECT_THAT(refused.message(), HasSubstr("dense weights 3.00 GiB"));
  EXPECT_THAT(refused.message(), HasSubstr("4.00 GiB free of 8.00 GiB"));
}

TEST(DeviceFit, NeedsACheckpointAndConfig) {
  EXPECT_EQ(EstimateDeviceBytes({}).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nq::worker
