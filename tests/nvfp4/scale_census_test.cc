// `nq census` on checkpoints with planted gate/up weight_scale_2 mismatches: it finds exactly
// those, from headers and scalars.
#include "services/nvfp4/scale_census.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>

#include "services/model/safetensors_writer.h"
#include "tests/common/status_matchers.h"

namespace nq::nvfp4 {
namespace {

namespace fs = std::filesystem;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

struct Planted {
  int layer, expert;
  float up;  // gate is 1e-3 everywhere
};

std::string Expert(int layer, int expert, const char* proj) {
  return "model.layers." + std::to_string(layer) + ".mlp.experts." + std::to_string(expert) + "." + proj + ".weight";
}

// Layers 1..3 with 4 experts each, sharded; the planted pairs get their own up scale.
std::string MakeCheckpoint(const std::string& name, const std::vector<Planted>& planted, bool drop_one_up = false) {
  const fs::path dir = fs::path(::testing::TempDir()) / name;
  fs::remove_all(dir);
  model::SafetensorsWriter writer;
  const float gate[1] = {1e-3f};
  for (int layer = 1; layer <= 3; ++layer) {
    for (int e = 0; e < 4; ++e) {
      float up[1] = {1e-3f};
      for (const Planted& p : planted) {
        if (p.layer == layer && p.expert == e) up[0] = p.up;
      }
      for (const char* proj : {"gate_proj", "up_proj"}) {
        EXPECT_TRUE(writer.Add(Expert(layer, e, proj), model::DType::kU8, {16, 8}, std::vector<std::byte>(128)).ok());
      }
      EXPECT_TRUE(writer.AddFloat32(Expert(layer, e, "gate_proj") + "_scale_2", {}, gate).ok());
      if (!(drop_one_up && layer == 2 && e == 1)) {
        EXPECT_TRUE(writer.AddFloat32(Expert(layer, e, "up_proj") + "_scale_2", {}, up).ok());
      }
    }
  }
  const float shared[1] = {5e-3f};  // not a routed expert: ignored
  EXPECT_TRUE(writer.AddFloat32("model.layers.1.mlp.shared_experts.up_proj.weight_scale_2", {}, shared).ok());
  EXPECT_TRUE(writer.WriteCheckpoint(dir.string(), /*max_shard_bytes=*/2048).ok());
  return dir.string();
}

TEST(RunCensus, FindsExactlyThePlantedMismatches) {
  const float one_ulp_up = std::nextafter(1e-3f, 1.0f);
  const std::string dir = MakeCheckpoint("census_planted", {{1, 2, 1e-2f}, {3, 0, 5e-4f}, {3, 3, one_ulp_up}});
  absl::StatusOr<CensusReport> report = RunCensus(dir);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->experts.size(), 12u);
  ASSERT_EQ(report->mismatched.size(), 3u);
  EXPECT_EQ(report->mismatched[0].layer, 1);
  EXPECT_EQ(report->mismatched[0].expert, 2);
  EXPECT_NEAR(report->mismatched[0].ratio, 10.0, 1e-5);
  EXPECT_EQ(report->mismatched[1].layer, 3);
  EXPECT_EQ(report->mismatched[1].expert, 0);
  EXPECT_NEAR(report->mismatched[1].ratio, 0.5, 1e-6);
  EXPECT_EQ(report->mismatched[2].expert, 3);
  EXPECT_EQ(report->mismatched[2].up_scale_2, one_ulp_up);
  EXPECT_NEAR(report->worst_ratio, 10.0, 1e-5);
  ASSERT_EQ(report->layers.size(), 3u);
  EXPECT_EQ(report->layers[0].mismatched, 1);
  EXPECT_EQ(report->layers[1].mismatched, 0);
  EXPECT_EQ(report->layers[2].mismatched, 2);
  EXPECT_NEAR(report->layers[2].worst_ratio, 0.5, 1e-6);

  const nlohmann::json json = CensusJson(*report);
  EXPECT_EQ(json["mismatched_count"], 3);
  EXPECT_EQ(json["experts"], 12);
  ASSERT_EQ(json["mismatched"].size(), 3u);
  EXPECT_EQ(json["mismatched"][0]["layer"], 1);
  EXPECT_EQ(json["mismatched"][0]["expert"], 2);
  EXPECT_FLOAT_EQ(json["mismatched"][0]["gate_scale_2"].get<float>(), 1e-3f);
  EXPECT_FLOAT_EQ(json["mismatched"][0]["up_scale_2"].get<float>(), 1e-2f);
  EXPECT_THAT(CensusText(*report), HasSubstr("12 experts, 3 with gate/up weight_scale_2 mismatched"));
}

TEST(RunCensus, CleanCheckpointHasNoMismatch) {
  absl::StatusOr<CensusReport> report = RunCensus(MakeCheckpoint("census_clean", {}));
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(report->mismatched.empty());
  EXPECT_EQ(report->worst_ratio, 1.0);
}

TEST(RunCensus, RefusesIncompleteOrNonNvfp4Checkpoints) {
  EXPECT_THAT(RunCensus(MakeCheckpoint("census_missing", {}, /*drop_one_up=*/true)).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("model.layers.2.mlp.experts.1.gate_proj.weight_scale_2 has no up_proj")));
  const fs::path dir = fs::path(::testing::TempDir()) / "census_bf16";
  model::SafetensorsWriter writer;
  const float w[16] = {};
  ASSERT_TRUE(writer.AddFloat32(Expert(1, 0, "up_proj"), {1, 16}, w).ok());
  ASSERT_TRUE(writer.WriteCheckpoint(dir.string()).ok());
  EXPECT_THAT(RunCensus(dir.string()).status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("not an NVFP4")));

  const fs::path bad = fs::path(::testing::TempDir()) / "census_badscale";
  model::SafetensorsWriter bad_writer;
  const float two[2] = {1, 2};
  ASSERT_TRUE(bad_writer.AddFloat32(Expert(1, 0, "up_proj") + "_scale_2", {2}, two).ok());
  ASSERT_TRUE(bad_writer.WriteCheckpoint(bad.string()).ok());
  EXPECT_THAT(RunCensus(bad.string()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be one F32 value")));
}

}  // namespace
}  // namespace nq::nvfp4
