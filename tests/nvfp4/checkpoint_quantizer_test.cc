// `nq nvfp4 quantize` as a library: routed experts only by default, the ModelOpt tensor trio
// and configs, every other tensor byte for byte, and an output our own loader reads back.
#include "services/nvfp4/checkpoint_quantizer.h"

#include "services/nvfp4/checkpoint_dequantizer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "services/model/dtype_convert.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"
#include "services/nvfp4/modelopt_config.h"
#include "services/nvfp4/nvfp4_format.h"
#include "tests/common/status_matchers.h"

namespace nq::nvfp4 {
namespace {

namespace fs = std::filesystem;
using ::nq::testing::StatusIs;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kHidden = 64;
constexpr int64_t kExpertDim = 32;

std::vector<float> Random(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

void WriteFile(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

std::string ReadFile(const fs::path& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Two MoE layers of three experts (bf16), attention, norms and lm_head, in 3 shards.
std::string MakeSource(const std::string& name, bool with_quant_config = false) {
  const fs::path dir = fs::path(::testing::TempDir()) / name;
  fs::remove_all(dir);
  model::SafetensorsWriter writer;
  uint32_t seed = 1;
  for (int layer = 1; layer <= 2; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    for (int e = 0; e < 3; ++e) {
      const std::string ep = p + "mlp.experts." + std::to_string(e) + ".";
      EXPECT_TRUE(writer.AddFloat32(ep + "gate_proj.weight", {kExpertDim, kHidden}, Random(kExpertDim * kHidden, seed++), model::DType::kBF16).ok());
      EXPECT_TRUE(writer.AddFloat32(ep + "up_proj.weight", {kExpertDim, kHidden}, Random(kExpertDim * kHidden, seed++), model::DType::kBF16).ok());
      EXPECT_TRUE(writer.AddFloat32(ep + "down_proj.weight", {kHidden, kExpertDim}, Random(kHidden * kExpertDim, seed++), model::DType::kBF16).ok());
    }
    EXPECT_TRUE(writer.AddFloat32(p + "mlp.shared_experts.up_proj.weight", {kExpertDim, kHidden}, Random(kExpertDim * kHidden, seed++), model::DType::kBF16).ok());
    EXPECT_TRUE(writer.AddFloat32(p + "self_attn.o_proj.weight", {kHidden, kHidden}, Random(kHidden * kHidden, seed++), model::DType::kBF16).ok());
    EXPECT_TRUE(writer.AddFloat32(p + "input_layernorm.weight", {kHidden}, Random(kHidden, seed++), model::DType::kBF16).ok());
  }
  EXPECT_TRUE(writer.AddFloat32("lm_head.weight", {48, kHidden}, Random(48 * kHidden, seed++), model::DType::kBF16).ok());
  EXPECT_TRUE(writer.WriteCheckpoint(dir.string(), /*max_shard_bytes=*/40'000).ok());
  nlohmann::json config = {{"model_type", "glm_moe_dsa"}, {"hidden_size", kHidden}};
  if (with_quant_config) config["quantization_config"] = {{"quant_method", "fp8"}};
  WriteFile(dir / "config.json", config.dump());
  WriteFile(dir / "tokenizer.json", "{\"tok\": 1}");
  fs::create_directories(dir / "eval");
  WriteFile(dir / "eval" / "a.txt", "not copied");
  return dir.string();
}

TEST(QuantizeCheckpoint, RoutedExpertsOnlyAndReadableByOurLoader) {
  const std::string source_dir = MakeSource("nvfp4_src");
  const std::string out_dir = ::testing::TempDir() + "/nvfp4_out";
  fs::remove_all(out_dir);
  QuantizeCheckpointOptions options;
  options.model_dir = source_dir;
  options.out_dir = out_dir;
  options.tap_path = ::testing::TempDir() + "/nvfp4_tap.jsonl";
  int64_t last_done = 0, last_total = 0;
  options.progress = [&](int64_t done, int64_t total) { last_done = done, last_total = total; };
  absl::StatusOr<QuantizeCheckpointSummary> summary = QuantizeCheckpoint(options);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->quantized_tensors, 18);
  EXPECT_EQ(summary->clipped_blocks, 0);
  EXPECT_EQ(last_done, 18);
  EXPECT_EQ(last_total, 18);

  absl::StatusOr<model::Checkpoint> source = model::Checkpoint::Open(source_dir);
  absl::StatusOr<model::Checkpoint> out = model::Checkpoint::Open(out_dir);
  ASSERT_TRUE(source.ok() && out.ok()) << out.status();
  EXPECT_TRUE(out->sharded());
  EXPECT_EQ(out->shards().size(), source->shards().size());
  for (const std::string& name : source->Names()) {
    absl::StatusOr<model::TensorView> src = source->Find(name);
    ASSERT_TRUE(src.ok());
    if (name.find(".mlp.experts.") != std::string::npos) {
      absl::StatusOr<Nvfp4View> view = ReadNvfp4(*out, name);
      ASSERT_TRUE(view.ok()) << name << ": " << view.status();
      // Exactly what the quantizer makes of the source values.
      absl::StatusOr<std::vector<float>> values = model::ConvertToFloat32(src->dtype, src->data);
      absl::StatusOr<QuantizeResult> direct = QuantizeNvfp4(*values, src->shape[0], src->shape[1]);
      ASSERT_TRUE(direct.ok());
      EXPECT_TRUE(std::equal(view->packed.begin(), view->packed.end(), direct->tensor.packed.begin())) << name;
      EXPECT_TRUE(std::equal(view->scales.begin(), view->scales.end(), direct->tensor.scales.begin())) << name;
      EXPECT_EQ(view->scale_2, direct->tensor.scale_2);
    } else {
      absl::StatusOr<model::TensorView> copied = out->Find(name);
      ASSERT_TRUE(copied.ok()) << name;
      EXPECT_EQ(copied->dtype, src->dtype);
      EXPECT_TRUE(std::equal(src->data.begin(), src->data.end(), copied->data.begin(), copied->data.end())) << name;
      EXPECT_FALSE(out->Contains(ScaleName(name))) << name;
    }
  }

  const nlohmann::json config = nlohmann::json::parse(ReadFile(fs::path(out_dir) / "config.json"));
  EXPECT_EQ(config["hidden_size"], kHidden);
  EXPECT_EQ(config["quantization_config"]["quant_method"], "modelopt");
  EXPECT_EQ(config["quantization_config"]["quant_algo"], "NVFP4");
  absl::StatusOr<ModeloptInfo> info = ReadHfQuantConfig(out_dir);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->quant_algo, "NVFP4");
  EXPECT_EQ(info->group_size, 16);
  EXPECT_THAT(info->exclude_modules, Contains("lm_head"));
  EXPECT_THAT(info->exclude_modules, Contains("model.layers.*.self_attn.o_proj"));
  EXPECT_THAT(info->exclude_modules, Contains("model.layers.*.mlp.shared_experts.up_proj"));
  for (const std::string& pattern : info->exclude_modules) {
    EXPECT_FALSE(GlobMatch(pattern, "model.layers.1.mlp.experts.0.up_proj")) << pattern;
  }
  EXPECT_EQ(ReadFile(fs::path(out_dir) / "tokenizer.json"), "{\"tok\": 1}");
  EXPECT_FALSE(fs::exists(fs::path(out_dir) / "eval"));

  std::ifstream tap(options.tap_path);
  std::string line;
  int lines = 0;
  while (std::getline(tap, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    EXPECT_THAT(j["tensor"].get<std::string>(), HasSubstr(".mlp.experts."));
    EXPECT_EQ(j["clipped_blocks"], 0);
    ++lines;
  }
  EXPECT_EQ(lines, 18);
}

TEST(QuantizeCheckpoint, PatternsOverrideTheSelection) {
  const std::string source_dir = MakeSource("nvfp4_src_patterns");
  QuantizeCheckpointOptions options;
  options.model_dir = source_dir;
  options.out_dir = ::testing::TempDir() + "/nvfp4_out_patterns";
  options.include = {std::string(kRoutedExpertPattern), "*.self_attn.o_proj.weight"};
  options.exclude = {"model.layers.2.*", "*.down_proj.weight"};
  options.search = ScaleSearch::kOff;
  absl::StatusOr<QuantizeCheckpointSummary> summary = QuantizeCheckpoint(options);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->quantized_tensors, 7);  // layer 1: 3 x (gate, up) + o_proj
  absl::StatusOr<model::Checkpoint> out = model::Checkpoint::Open(options.out_dir);
  ASSERT_TRUE(out.ok());
  EXPECT_TRUE(out->Contains("model.layers.1.self_attn.o_proj.weight_scale_2"));
  EXPECT_FALSE(out->Contains("model.layers.2.mlp.experts.0.up_proj.weight_scale"));
  EXPECT_FALSE(out->Contains("model.layers.1.mlp.experts.0.down_proj.weight_scale"));
}

TEST(QuantizeCheckpoint, RefusesWhatItCannotDo) {
  QuantizeCheckpointOptions options;
  options.model_dir = MakeSource("nvfp4_src_fp8", /*with_quant_config=*/true);
  options.out_dir = ::testing::TempDir() + "/nvfp4_out_fp8";
  EXPECT_THAT(QuantizeCheckpoint(options).status(),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("already quantized")));

  options.model_dir = MakeSource("nvfp4_src_bad");
  options.out_dir = options.model_dir;
  EXPECT_THAT(QuantizeCheckpoint(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--out must differ")));

  options.out_dir = ::testing::TempDir() + "/nvfp4_out_bad";
  options.include = {"lm_head.weight", "nothing.*"};
  options.exclude = {"lm_head.*"};
  EXPECT_THAT(QuantizeCheckpoint(options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("select no linear weight")));
}

TEST(DequantizeCheckpoint, ExpandsNvfp4WeightsToTheirExactValues) {
  QuantizeCheckpointOptions options;
  options.model_dir = MakeSource("nvfp4_src_deq");
  options.out_dir = ::testing::TempDir() + "/nvfp4_out_deq";
  ASSERT_TRUE(QuantizeCheckpoint(options).ok());
  const std::string plain_dir = ::testing::TempDir() + "/nvfp4_plain";
  absl::StatusOr<DequantizeCheckpointSummary> summary = DequantizeCheckpoint(options.out_dir, plain_dir);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->dequantized_tensors, 18);
  absl::StatusOr<model::Checkpoint> quantized = model::Checkpoint::Open(options.out_dir);
  absl::StatusOr<model::Checkpoint> plain = model::Checkpoint::Open(plain_dir);
  absl::StatusOr<model::Checkpoint> source = model::Checkpoint::Open(options.model_dir);
  ASSERT_TRUE(quantized.ok() && plain.ok() && source.ok());
  EXPECT_EQ(plain->Names(), source->Names());  // no scale tensor left behind
  const std::string name = "model.layers.2.mlp.experts.1.up_proj.weight";
  absl::StatusOr<Nvfp4View> view = ReadNvfp4(*quantized, name);
  absl::StatusOr<model::TensorView> expanded = plain->Find(name);
  ASSERT_TRUE(view.ok() && expanded.ok());
  EXPECT_EQ(expanded->dtype, model::DType::kF32);
  absl::StatusOr<std::vector<float>> want = Dequantize(*view);
  absl::StatusOr<std::vector<float>> got = model::ConvertToFloat32(expanded->dtype, expanded->data);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(*got, *want);
  const nlohmann::json config = nlohmann::json::parse(ReadFile(fs::path(plain_dir) / "config.json"));
  EXPECT_FALSE(config.contains("quantization_config"));
  EXPECT_FALSE(fs::exists(fs::path(plain_dir) / std::string(kHfQuantConfigName)));
}

TEST(GlobMatch, MatchesWholeNames) {
  EXPECT_TRUE(GlobMatch(kRoutedExpertPattern, "model.layers.78.mlp.experts.255.down_proj.weight"));
  EXPECT_FALSE(GlobMatch(kRoutedExpertPattern, "model.layers.3.mlp.shared_experts.down_proj.weight"));
  EXPECT_FALSE(GlobMatch(kRoutedExpertPattern, "model.layers.3.mlp.experts.1.down_proj.weight_scale"));
  EXPECT_TRUE(GlobMatch("a?c*", "abcdef"));
  EXPECT_FALSE(GlobMatch("a?c", "abcd"));
}

}  // namespace
}  // namespace nq::nvfp4
