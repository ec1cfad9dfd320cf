// Weight matrices stored as BF16 (ModelOptions::weight_dtype, --weight_dtype; issue #13) on
// glm5_nano, a BF16 checkpoint: the stored values are the checkpoint's exactly, so the logits
// may differ from the F32-stored model's only by how the backend accumulates, and the matrices
// take half the memory.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "services/model/model.h"
#include "services/model/model_weights.h"

namespace nq::model {
namespace {

std::string NanoDir() { return std::string(NQ_SOURCE_DIR) + "/models/glm5_nano"; }

TEST(WeightDType, Bf16MatricesOfABf16CheckpointGiveTheF32Logits) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  const std::vector<int32_t> prompt = {17, 400, 33, 1021, 5, 77, 2048, 9, 311, 64, 12, 4000};
  std::vector<std::vector<float>> logits;
  for (const kernels::DType dtype : {kernels::DType::kF32, kernels::DType::kBF16}) {
    absl::StatusOr<std::unique_ptr<Model>> model =
        Model::Load(NanoDir(), **backend, nullptr, ModelOptions{.max_tokens = 64, .tp = {}, .weight_dtype = dtype});
    ASSERT_TRUE(model.ok()) << model.status();
    absl::StatusOr<std::vector<float>> prefill = (*model)->Forward(prompt);
    ASSERT_TRUE(prefill.ok()) << prefill.status();
    // And one decode step through the cache.
    absl::StatusOr<std::vector<float>> step = (*model)->Forward(std::vector<int32_t>{99});
    ASSERT_TRUE(step.ok()) << step.status();
    prefill->insert(prefill->end(), step->begin(), step->end());
    logits.push_back(*std::move(prefill));
  }
  ASSERT_EQ(logits[0].size(), logits[1].size());
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < logits[0].size(); ++i) {
    max_ref = std::max(max_ref, std::abs(double{logits[0][i]}));
    max_diff = std::max(max_diff, std::abs(double{logits[0][i]} - logits[1][i]));
  }
  // Same weights, another summation order: fp32 rounding only (a rounded weight would move the
  // logits by ~2^-9 of their size, 2e-3).
  EXPECT_LT(max_diff / max_ref, 1e-4) << "max |diff| " << max_diff << " of max |logit| " << max_ref;
}

TEST(WeightDType, OnlyF32AndBf16AreAccepted) {
  EXPECT_EQ(ParseWeightDType("bf16").value(), kernels::DType::kBF16);
  EXPECT_EQ(ParseWeightDType("f32").value(), kernels::DType::kF32);
  EXPECT_EQ(ParseWeightDType("fp8").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  absl::StatusOr<std::unique_ptr<Model>> model =
      Model::Load(NanoDir(), **backend, nullptr, ModelOptions{.max_tokens = 8, .tp = {}, .weight_dtype = kernels::DType::kF16});
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nq::model
