// Weight matrices stored as BF16 or FP8 (ModelOptions::weight_dtype, --weight_dtype; issue #13).
// BF16 on glm5_nano, a BF16 checkpoint: the stored values are the checkpoint's exactly, so the
// logits may differ from the F32-stored model's only by how the backend accumulates, and the
// matrices take half the memory. FP8 on the FP8 fixtures: the stored bytes come back.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <span>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "kernels/backend.h"
#include "kernels/tensor_io.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"
#include "services/model/model_config.h"
#include "services/model/model_weights.h"
#include "services/model/safetensors.h"

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

// Prefill logits of `prompt` and one decode step, concatenated.
std::vector<float> PromptAndStepLogits(const std::string& dir, kernels::Backend& backend, kernels::DType dtype,
                                       const std::vector<int32_t>& prompt) {
  absl::StatusOr<std::unique_ptr<Model>> model =
      Model::Load(dir, backend, nullptr, ModelOptions{.max_tokens = 64, .tp = {}, .weight_dtype = dtype});
  EXPECT_TRUE(model.ok()) << model.status();
  if (!model.ok()) return {};
  absl::StatusOr<std::vector<float>> prefill = (*model)->Forward(prompt);
  EXPECT_TRUE(prefill.ok()) << prefill.status();
  absl::StatusOr<std::vector<float>> step = (*model)->Forward(std::vector<int32_t>{99});
  EXPECT_TRUE(step.ok()) << step.status();
  if (!prefill.ok() || !step.ok()) return {};
  prefill->insert(prefill->end(), step->begin(), step->end());
  return *std::move(prefill);
}

double MaxRelativeDiff(const std::vector<float>& ref, const std::vector<float>& got) {
  EXPECT_EQ(ref.size(), got.size());
  double max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < std::min(ref.size(), got.size()); ++i) {
    max_ref = std::max(max_ref, std::abs(double{ref[i]}));
    max_diff = std::max(max_diff, std::abs(double{ref[i]} - got[i]));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

// --weight_dtype fp8 on the FP8 fixtures (tiny GLM-5 and DeepSeek-V3 checkpoints stored as
// DeepSeek stores them: E4M3 with 128 x 128 block scales): the matrices whose rows the loader
// keeps in whole 128-row blocks come back to the stored bytes (next test); a matrix cut or
// stacked mid-block is quantized again in its new blocks (one more E4M3 rounding, up to 1/16 of
// a weight), and the MLA absorption matrices are BF16. At GLM-5's and DeepSeek-V3's sizes only
// q_b_proj is cut mid-block (each head's nope and rope rows); at these tiny sizes nearly every
// attention matrix is (kv_lora 32 or 48 beside 16 rope rows, heads of 40 or 48 rows), and
// DeepSeek-V3's dense MLP too (gate and up of 160 rows stacked). The logits moved by 0.026 (GLM-5)
// and 0.12 (DeepSeek-V3) of the largest when measured (2026-12-02); the bounds are about twice
// that: a block given the wrong scale, or rows in the wrong order, moves them by far more.
TEST(WeightDType, Fp8MatricesOfAnFp8CheckpointStayNearItsLogits) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  const std::vector<int32_t> prompt = {17, 40, 33, 102, 5, 77, 20, 9, 31, 64, 12, 40};
  struct Fixture {
    const char* name;
    double bound;
  };
  for (const Fixture& fixture : {Fixture{"glm5_tiny_fp8", 0.05}, Fixture{"dsv3_tiny_fp8", 0.25}}) {
    const char* name = fixture.name;
    SCOPED_TRACE(name);
    const std::string dir = std::string(NQ_FIXTURE_DIR) + "/" + name;
    const std::vector<float> f32 = PromptAndStepLogits(dir, **backend, kernels::DType::kF32, prompt);
    const std::vector<float> fp8 = PromptAndStepLogits(dir, **backend, kernels::DType::kF8E4M3, prompt);
    const double diff = MaxRelativeDiff(f32, fp8);
    std::printf("%s: fp8 matrices move the logits by %.3g of the largest\n", name, diff);
    EXPECT_LT(diff, fixture.bound);
    EXPECT_GT(diff, 0.0) << "the absorbed matrices are BF16: the logits cannot be the F32 ones exactly";
  }
}

// A fixture's checkpoint and the weights the loader makes of it with matrices at `matrix_dtype`.
struct LoadedFixture {
  Checkpoint checkpoint;
  ModelWeights weights;
};
absl::StatusOr<LoadedFixture> LoadFixture(const std::string& name, kernels::Backend& backend,
                                          kernels::DType matrix_dtype) {
  const std::string dir = std::string(NQ_FIXTURE_DIR) + "/" + name;
  ASSIGN_OR_RETURN(Checkpoint checkpoint, Checkpoint::Open(dir));
  ASSIGN_OR_RETURN(ModelConfig config, LoadModelConfig(dir));
  ASSIGN_OR_RETURN(ModelWeights weights,
                   LoadModelWeights(checkpoint, config, backend, {}, {.matrix_dtype = matrix_dtype}));
  return LoadedFixture{std::move(checkpoint), std::move(weights)};
}

// The loader's FP8 matrices against the checkpoint's own bytes: o_proj (whole on one rank) and
// the MLP's down projection keep every stored byte and scale.
TEST(WeightDType, Fp8MatricesKeepTheCheckpointsStoredBytes) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  absl::StatusOr<LoadedFixture> loaded = LoadFixture("glm5_tiny_fp8", **backend, kernels::DType::kF8E4M3);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const Checkpoint* checkpoint = &loaded->checkpoint;
  const ModelWeights* weights = &loaded->weights;
  struct Stored {
    const char* name;
    const Matrix* loaded;
  };
  const LayerWeights& layer0 = weights->layers[0];
  ASSERT_TRUE(layer0.dense.has_value());
  for (const Stored& s : {Stored{"model.layers.0.self_attn.o_proj.weight", &layer0.attention.o_proj},
                          Stored{"model.layers.0.mlp.down_proj.weight", &layer0.dense->down}}) {
    SCOPED_TRACE(s.name);
    absl::StatusOr<TensorView> view = checkpoint->Find(s.name);
    ASSERT_TRUE(view.ok()) << view.status();
    ASSERT_EQ(view->dtype, DType::kF8E4M3) << "the fixture stores it as FP8";
    ASSERT_EQ(s.loaded->dtype(), kernels::DType::kF8E4M3);
    std::vector<std::byte> bytes(s.loaded->w.nbytes());
    ASSERT_TRUE((*backend)->CopyToHost(s.loaded->w, bytes).ok());
    int differing = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
      const auto a = std::to_integer<uint8_t>(bytes[i]), b = std::to_integer<uint8_t>(view->data[i]);
      if (a != b && ((a | b) & 0x7f) != 0) ++differing;  // +0 and -0 decode alike
    }
    EXPECT_EQ(differing, 0) << "of " << bytes.size() << " bytes";
    absl::StatusOr<TensorView> scales = checkpoint->Find(std::string(s.name) + "_scale_inv");
    ASSERT_TRUE(scales.ok()) << scales.status();
    std::vector<float> loaded_scales(s.loaded->scale_inv.NumElements());
    ASSERT_TRUE((*backend)->CopyToHost(s.loaded->scale_inv, std::as_writable_bytes(std::span(loaded_scales))).ok());
    ASSERT_EQ(scales->data.size(), loaded_scales.size() * sizeof(float));
    for (size_t i = 0; i < loaded_scales.size(); ++i) {
      float stored;
      std::memcpy(&stored, scales->data.data() + i * sizeof(float), sizeof(float));
      EXPECT_FLOAT_EQ(loaded_scales[i], stored) << "block " << i;
    }
  }
  // The vocabulary head stays BF16, the absorption matrices BF16.
  EXPECT_EQ(weights->lm_head.dtype(), kernels::DType::kBF16);
  EXPECT_EQ(layer0.attention.w_uk.dtype(), kernels::DType::kBF16);
}

// The router keeps the checkpoint's values in the fewest bytes that hold them whatever the
// matrices' dtype: BF16 where the checkpoint stores it so (the FP8 fixture, as real GLM-5 and
// DeepSeek-V3 checkpoints), F32 where its values need it (the F32 fixture), the same values
// either way.
TEST(WeightDType, TheRouterKeepsItsCheckpointValuesInTheirOwnWidth) {
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  struct Case {
    const char* fixture;
    DType stored;
    kernels::DType loaded;
  };
  for (const Case& c : {Case{"glm5_tiny_fp8", DType::kBF16, kernels::DType::kBF16},
                        Case{"glm5_tiny", DType::kF32, kernels::DType::kF32}}) {
    SCOPED_TRACE(c.fixture);
    absl::StatusOr<LoadedFixture> loaded = LoadFixture(c.fixture, **backend, kernels::DType::kF32);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    const Checkpoint* checkpoint = &loaded->checkpoint;
    const ModelWeights* weights = &loaded->weights;
    int moe_layers = 0;
    for (size_t l = 0; l < weights->layers.size(); ++l) {
      if (!weights->layers[l].moe.has_value()) continue;
      ++moe_layers;
      const std::string name = "model.layers." + std::to_string(l) + ".mlp.gate.weight";
      absl::StatusOr<TensorView> view = checkpoint->Find(name);
      ASSERT_TRUE(view.ok()) << view.status();
      ASSERT_EQ(view->dtype, c.stored) << name << ": the fixture's dtype";
      const MoeWeights& moe = *weights->layers[l].moe;
      ASSERT_EQ(moe.router_device.dtype(), c.loaded) << name;
      absl::StatusOr<std::vector<float>> values = kernels::DownloadFloats(**backend, moe.router_device);
      ASSERT_TRUE(values.ok()) << values.status();
      EXPECT_EQ(*values, moe.router) << name << ": the stored values are the checkpoint's";
    }
    EXPECT_GT(moe_layers, 0);
  }
}

TEST(WeightDType, OnlyF32Bf16AndFp8AreAccepted) {
  EXPECT_EQ(ParseWeightDType("bf16").value(), kernels::DType::kBF16);
  EXPECT_EQ(ParseWeightDType("f32").value(), kernels::DType::kF32);
  EXPECT_EQ(ParseWeightDType("fp8").value(), kernels::DType::kF8E4M3);
  EXPECT_EQ(ParseWeightDType("fp4").status().code(), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  absl::StatusOr<std::unique_ptr<Model>> model =
      Model::Load(NanoDir(), **backend, nullptr, ModelOptions{.max_tokens = 8, .tp = {}, .weight_dtype = kernels::DType::kF16});
  EXPECT_EQ(model.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace nq::model
