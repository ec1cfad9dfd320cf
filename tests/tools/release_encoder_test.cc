// nq encode end to end: a synthetic GLM-5-shaped checkpoint into a NestQuant release, read
// back expert by expert at 2 and 4 bits.
#include "services/tools/release_encoder.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "services/format/release_reader.h"
#include "services/model/model_config.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_load.h"
#include "services/model/synth_checkpoint.h"
#include "tests/common/status_matchers.h"

namespace nq::tools {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

class ReleaseEncoderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / absl::StrCat("nq-encode-test-", getpid());
    fs::remove_all(root_);
    std::ifstream in(std::string(NQ_SOURCE_DIR) + "/configs/test/glm5_encode.json");
    std::stringstream text;
    text << in.rdbuf();
    absl::StatusOr<model::ModelConfig> config = model::ParseModelConfig(text.str());
    ASSERT_THAT(config, IsOk());
    ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, (root_ / "model").string(), {.seed = 11}), IsOk());
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

TEST_F(ReleaseEncoderTest, EncodesVerifiesAndDecodesNestedExperts) {
  const std::string release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease((root_ / "model").string(), release_dir, {.tp_size = 1, .fixed_per_layer = 2}), IsOk());
  absl::StatusOr<format::Release> release = format::Release::Open(release_dir);
  ASSERT_THAT(release, IsOk());
  EXPECT_TRUE(release->Verify().ok()) << release->Verify().ToString();
  ASSERT_EQ(release->manifest().layers.size(), 2u) << "layer 1 and the MTP layer 2 are MoE layers";
  EXPECT_EQ(release->manifest().layers[0].fixed_4bit, (std::vector<uint32_t>{0, 1}));

  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open((root_ / "model").string());
  ASSERT_THAT(checkpoint, IsOk());
  absl::StatusOr<std::unique_ptr<quant::Codec>> codec = quant::MakeCodec(release->manifest().codec);
  ASSERT_THAT(codec, IsOk());
  for (const char* projection : {"gate_proj", "down_proj"}) {
    absl::StatusOr<model::FloatTensor> original =
        model::LoadFloat32(*checkpoint, absl::StrCat("model.layers.1.mlp.experts.3.", projection, ".weight"));
    ASSERT_THAT(original, IsOk());
    absl::StatusOr<quant::EncodedMatrix> full = LoadReleaseExpert(*release, 0, 1, 3, projection, true);
    absl::StatusOr<quant::EncodedMatrix> base = LoadReleaseExpert(*release, 0, 1, 3, projection, false);
    ASSERT_THAT(full, IsOk());
    ASSERT_THAT(base, IsOk());
    EXPECT_EQ(full->base_codes, base->base_codes) << "the base plane does not depend on the residual";
    std::vector<float> w4(original->values.size()), w2(original->values.size()), w2_full(original->values.size());
    ASSERT_THAT((*codec)->Decode(*full, quant::Precision::k4Bit, w4), IsOk());
    ASSERT_THAT((*codec)->Decode(*base, quant::Precision::k2Bit, w2), IsOk());
    ASSERT_THAT((*codec)->Decode(*full, quant::Precision::k2Bit, w2_full), IsOk());
    EXPECT_EQ(w2, w2_full) << "2-bit decode is the same with or without the record";
    const double e4 = RelativeError(w4, original->values), e2 = RelativeError(w2, original->values);
    EXPECT_LT(e4, 0.15) << projection;
    EXPECT_LT(e2, 0.45) << projection;
    EXPECT_LT(e4, e2 / 2) << projection;
    // A base plane alone cannot be decoded at 4 bits.
    EXPECT_FALSE((*codec)->Decode(*base, quant::Precision::k4Bit, w4).ok());
  }
}

TEST_F(ReleaseEncoderTest, RerunIsANoOpAndBadOptionsAreRefused) {
  const std::string release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease((root_ / "model").string(), release_dir, {}), IsOk());
  const auto written = fs::last_write_time(fs::path(release_dir) / "rank0" / "L1.bin");
  int progress_calls = 0;
  ASSERT_THAT(EncodeRelease((root_ / "model").string(), release_dir,
                            {.progress = [&](int done, int total) { ++progress_calls; }}),
              IsOk());
  EXPECT_EQ(fs::last_write_time(fs::path(release_dir) / "rank0" / "L1.bin"), written) << "resumed layers are skipped";
  EXPECT_EQ(progress_calls, 2);
  EXPECT_THAT(EncodeRelease((root_ / "model").string(), (root_ / "r2").string(), {.tp_size = 2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiples of 128")));
  EXPECT_THAT(EncodeRelease((root_ / "model").string(), (root_ / "r3").string(), {.fixed_per_layer = 99}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--fixed-per-layer 99")));
  EXPECT_THAT(EncodeRelease((root_ / "nowhere").string(), (root_ / "r4").string(), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.json")));
}

}  // namespace
}  // namespace nq::tools
