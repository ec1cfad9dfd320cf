// A config that names an MTP layer whose tensors the checkpoint lacks (transformers'
// save_pretrained drops them; many fine-tunes ship without) loads without MTP; an MTP layer
// with only some of its tensors is a broken file and still fails.
#include <filesystem>
#include <memory>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "kernels/backend.h"
#include "services/model/model.h"
#include "tests/common/checkpoint_copy.h"
#include "tests/common/status_matchers.h"
#include "tests/model_graph/fixture_util.h"

namespace nq::model {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

class MissingMtpTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
    ASSERT_THAT(backend, IsOk());
    backend_ = *std::move(backend);
    dir_ = std::filesystem::temp_directory_path() /
           ("nq_missing_mtp_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  absl::StatusOr<std::unique_ptr<Model>> Load(const std::string& dir) {
    return Model::Load(dir, *backend_, nullptr, ModelOptions{.max_tokens = 64, .tp = {}});
  }

  std::unique_ptr<kernels::Backend> backend_;
  std::filesystem::path dir_;
};

TEST_F(MissingMtpTest, ACheckpointWithoutItsMtpTensorsLoadsWithoutMtp) {
  const std::string fixture = testing::FixtureDir("glm5_tiny");
  // glm5_tiny has 2 decoder layers; its MTP layer is model.layers.2.
  ASSERT_THAT(nq::testing::CopyCheckpointWithout(
                  fixture, dir_, [](const std::string& name) { return absl::StartsWith(name, "model.layers.2."); }),
              IsOk());
  absl::StatusOr<std::unique_ptr<Model>> full = Load(fixture);
  absl::StatusOr<std::unique_ptr<Model>> without = Load(dir_);
  ASSERT_THAT(full, IsOk());
  ASSERT_THAT(without, IsOk());
  EXPECT_TRUE((*full)->has_mtp());
  EXPECT_FALSE((*without)->has_mtp());
  EXPECT_THAT((*without)->mtp_missing(), HasSubstr("no model.layers.2.* tensor"));
  EXPECT_EQ((*without)->config().num_nextn_predict_layers, 1) << "the config is read as written";

  // The main model is untouched.
  const std::vector<int32_t> tokens = testing::ReadTokens(fixture);
  absl::StatusOr<std::vector<float>> a = (*full)->Forward(tokens);
  absl::StatusOr<std::vector<float>> b = (*without)->Forward(tokens);
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(*a, *b);
  const std::vector<float> hidden((*without)->last_hidden().begin(),
                                  (*without)->last_hidden().begin() + (*without)->config().hidden_size);
  EXPECT_THAT((*without)->ForwardMtp(std::span<const int32_t>(tokens).subspan(1, 1), hidden),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no model.layers.2.* tensor")));
}

TEST_F(MissingMtpTest, AnMtpLayerMissingSomeTensorsIsStillRefused) {
  ASSERT_THAT(nq::testing::CopyCheckpointWithout(testing::FixtureDir("glm5_tiny"), dir_,
                                                 [](const std::string& name) {
                                                   return name == "model.layers.2.enorm.weight";
                                                 }),
              IsOk());
  EXPECT_THAT(Load(dir_), StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.layers.2.enorm.weight")));
}

}  // namespace
}  // namespace nq::model
