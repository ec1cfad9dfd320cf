// nq synth-release: a release of made-up experts beside a checkpoint without expert weights. It
// must be a release like any other (same files, sizes and layout as nq encode's for the config,
// verified hashes) that the worker's loader serves, with codes that differ per expert and seed.
#include "services/release/release_encoder.h"

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/format/release_reader.h"
#include "services/model/model.h"
#include "services/model/model_config.h"
#include "services/model/safetensors.h"
#include "services/model/synth_checkpoint.h"
#include "services/release/release_experts.h"
#include "tests/common/status_matchers.h"
#include "tests/release/encode_test_config.h"

namespace nq::release {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

class SynthReleaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / absl::StrCat("nq-synth-release-test-", getpid());
    fs::remove_all(root_);
    absl::StatusOr<model::ModelConfig> config = testing::EncodeTestConfig();
    ASSERT_THAT(config, IsOk());
    ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, Dir("full"), {.seed = 3}), IsOk());
    ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, Dir("no_experts"), {.seed = 3, .routed_experts = false}),
                IsOk());
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string Dir(const std::string& name) const { return (root_ / name).string(); }

  // One expert's resident base plane of a release.
  static std::vector<std::byte> BasePlane(const format::Release& release, uint32_t layer, uint32_t expert) {
    absl::StatusOr<std::string> path = release.ResidentPath(0, layer);
    EXPECT_THAT(path, IsOk());
    absl::StatusOr<model::SafetensorsFile> resident = model::SafetensorsFile::Open(*path);
    EXPECT_THAT(resident, IsOk());
    absl::StatusOr<model::TensorView> view = resident->Find(absl::StrCat("experts.", expert, ".gate_proj.base"));
    EXPECT_THAT(view, IsOk());
    return view.ok() ? std::vector<std::byte>(view->data.begin(), view->data.end()) : std::vector<std::byte>();
  }

  fs::path root_;
};

TEST_F(SynthReleaseTest, TheCheckpointWithoutExpertsHoldsEverythingElse) {
  absl::StatusOr<model::Checkpoint> full = model::Checkpoint::Open(Dir("full"));
  absl::StatusOr<model::Checkpoint> stripped = model::Checkpoint::Open(Dir("no_experts"));
  ASSERT_THAT(full, IsOk());
  ASSERT_THAT(stripped, IsOk());
  size_t experts = 0;
  for (const std::string& name : full->Names()) {
    if (absl::StrContains(name, ".mlp.experts.")) {
      ++experts;
      EXPECT_FALSE(stripped->Find(name).ok()) << name;
    } else {
      EXPECT_THAT(stripped->Find(name), IsOk()) << name;
    }
  }
  EXPECT_EQ(experts, 2u * 16u * 3u) << "layer 1 and the MTP layer, 16 experts, 3 projections";
  EXPECT_EQ(stripped->Names().size(), full->Names().size() - experts);
  // nq encode needs the weights it encodes, and says which one is missing.
  EXPECT_THAT(EncodeRelease(Dir("no_experts"), Dir("encoded"), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model.layers.1.mlp.experts.0.gate_proj.weight")));
}

// Values come from per-(tensor, chunk) generators on every core: a seed writes the same bytes
// again, whatever is left out (the checkpoint without experts holds the full one's other tensors
// exactly), and another seed writes others.
TEST_F(SynthReleaseTest, ASeedWritesTheSameValuesWhateverIsLeftOut) {
  absl::StatusOr<model::ModelConfig> config = testing::EncodeTestConfig();
  ASSERT_THAT(config, IsOk());
  ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, Dir("again"), {.seed = 3}), IsOk());
  ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, Dir("other"), {.seed = 4}), IsOk());
  absl::StatusOr<model::Checkpoint> full = model::Checkpoint::Open(Dir("full"));
  absl::StatusOr<model::Checkpoint> stripped = model::Checkpoint::Open(Dir("no_experts"));
  absl::StatusOr<model::Checkpoint> again = model::Checkpoint::Open(Dir("again"));
  absl::StatusOr<model::Checkpoint> other = model::Checkpoint::Open(Dir("other"));
  ASSERT_THAT(full, IsOk());
  ASSERT_THAT(stripped, IsOk());
  ASSERT_THAT(again, IsOk());
  ASSERT_THAT(other, IsOk());
  auto bytes = [](const model::Checkpoint& c, const std::string& name) {
    absl::StatusOr<model::TensorView> view = c.Find(name);
    EXPECT_THAT(view, IsOk()) << name;
    return view.ok() ? std::vector<std::byte>(view->data.begin(), view->data.end()) : std::vector<std::byte>();
  };
  int differing = 0;
  for (const std::string& name : full->Names()) {
    const std::vector<std::byte> mine = bytes(*full, name);
    EXPECT_EQ(bytes(*again, name), mine) << name;
    if (!absl::StrContains(name, ".mlp.experts.")) EXPECT_EQ(bytes(*stripped, name), mine) << name;
    if (bytes(*other, name) != mine) ++differing;
  }
  EXPECT_EQ(differing, static_cast<int>(full->Names().size())) << "every tensor changes with the seed";
}

TEST_F(SynthReleaseTest, HasTheFilesAndSizesOfAnEncodedReleaseAndVerifies) {
  ASSERT_THAT(EncodeRelease(Dir("full"), Dir("encoded"), {.tp_size = 2, .fixed_per_layer = 3}), IsOk());
  ASSERT_THAT(EncodeRelease(Dir("no_experts"), Dir("synthetic"), {.tp_size = 2, .fixed_per_layer = 3, .synthetic_seed = 7}),
              IsOk());
  absl::StatusOr<format::Release> encoded = format::Release::Open(Dir("encoded"));
  absl::StatusOr<format::Release> synthetic = format::Release::Open(Dir("synthetic"));
  ASSERT_THAT(encoded, IsOk());
  ASSERT_THAT(synthetic, IsOk());
  EXPECT_TRUE(synthetic->Verify().ok()) << synthetic->Verify().ToString();
  const format::Manifest& m = synthetic->manifest();
  EXPECT_EQ(m.codec, encoded->manifest().codec);
  EXPECT_EQ(m.config_hash, encoded->manifest().config_hash) << "the same config.json";
  EXPECT_EQ(m.tp_size, 2u);
  ASSERT_EQ(m.layers.size(), encoded->manifest().layers.size());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const format::ManifestLayer& a = m.layers[i];
    const format::ManifestLayer& b = encoded->manifest().layers[i];
    EXPECT_EQ(a.layer, b.layer);
    EXPECT_EQ(a.fixed_4bit, b.fixed_4bit);
    for (uint32_t rank = 0; rank < 2; ++rank) {
      absl::StatusOr<const format::LayerEntry*> sa = synthetic->Layer(rank, a.layer);
      absl::StatusOr<const format::LayerEntry*> sb = encoded->Layer(rank, a.layer);
      ASSERT_THAT(sa, IsOk());
      ASSERT_THAT(sb, IsOk());
      EXPECT_EQ((*sa)->layout.rec_bytes, (*sb)->layout.rec_bytes) << "layer " << a.layer << " rank " << rank;
      absl::StatusOr<std::string> ra = synthetic->ResidentPath(rank, a.layer);
      absl::StatusOr<std::string> rb = encoded->ResidentPath(rank, a.layer);
      ASSERT_THAT(ra, IsOk());
      ASSERT_THAT(rb, IsOk());
      EXPECT_EQ(fs::file_size(*ra), fs::file_size(*rb)) << *ra;
    }
  }
}

TEST_F(SynthReleaseTest, CodesDifferPerExpertAndSeedAndRepeatForASeed) {
  ASSERT_THAT(EncodeRelease(Dir("no_experts"), Dir("a"), {.synthetic_seed = 7}), IsOk());
  ASSERT_THAT(EncodeRelease(Dir("no_experts"), Dir("b"), {.synthetic_seed = 7}), IsOk());
  ASSERT_THAT(EncodeRelease(Dir("no_experts"), Dir("c"), {.synthetic_seed = 8}), IsOk());
  absl::StatusOr<format::Release> a = format::Release::Open(Dir("a"));
  absl::StatusOr<format::Release> b = format::Release::Open(Dir("b"));
  absl::StatusOr<format::Release> c = format::Release::Open(Dir("c"));
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(b, IsOk());
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(BasePlane(*a, 1, 0), BasePlane(*b, 1, 0));
  EXPECT_NE(BasePlane(*a, 1, 0), BasePlane(*c, 1, 0));
  EXPECT_NE(BasePlane(*a, 1, 0), BasePlane(*a, 1, 1));
  EXPECT_NE(BasePlane(*a, 1, 0), BasePlane(*a, 2, 0));
  absl::StatusOr<std::vector<std::byte>> ra = a->ReadRecord(0, 1, 5), rb = a->ReadRecord(0, 1, 6);
  ASSERT_THAT(ra, IsOk());
  ASSERT_THAT(rb, IsOk());
  EXPECT_NE(*ra, *rb) << "residual planes differ per expert too";
  // Every 2-bit code value occurs: the codes are not a constant or a short pattern.
  int seen[4] = {0, 0, 0, 0};
  for (std::byte byte : BasePlane(*a, 1, 3)) {
    for (int k = 0; k < 4; ++k) ++seen[(static_cast<unsigned>(byte) >> (2 * k)) & 3];
  }
  for (int v = 0; v < 4; ++v) EXPECT_GT(seen[v], 128 * 128 / 8) << "code " << v;
}

TEST_F(SynthReleaseTest, TheLoaderServesItAtEveryPolicyWithFiniteLogits) {
  ASSERT_THAT(EncodeRelease(Dir("no_experts"), Dir("synthetic"), {.fixed_per_layer = 4, .synthetic_seed = 1}),
              IsOk());
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  const std::vector<int32_t> tokens = {1, 50, 7, 300, 22, 9};
  std::vector<float> two_bit;
  for (ExpertBits bits : {ExpertBits::k2Bit, ExpertBits::k4Bit, ExpertBits::kFixedSet}) {
    absl::StatusOr<std::unique_ptr<model::Model>> m =
        LoadModelWithRelease(Dir("no_experts"), Dir("synthetic"), bits, **backend, nullptr, {.max_tokens = 32});
    ASSERT_THAT(m, IsOk());
    absl::StatusOr<std::vector<float>> logits = (*m)->Forward(tokens);
    ASSERT_THAT(logits, IsOk());
    for (float v : *logits) ASSERT_TRUE(std::isfinite(v));
    if (bits == ExpertBits::k2Bit) {
      two_bit = *logits;
    } else {
      EXPECT_NE(*logits, two_bit) << "the residual planes change what the experts compute";
    }
  }
}

TEST_F(SynthReleaseTest, TrellisKeepsItsEncodedCodesAndServes) {
  ASSERT_THAT(EncodeRelease(Dir("no_experts"), Dir("trellis"), {.codec = "trellis", .synthetic_seed = 2}), IsOk());
  absl::StatusOr<format::Release> release = format::Release::Open(Dir("trellis"));
  ASSERT_THAT(release, IsOk());
  EXPECT_TRUE(release->Verify().ok()) << release->Verify().ToString();
  EXPECT_EQ(release->manifest().codec, "trellis_v1");
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  absl::StatusOr<std::unique_ptr<model::Model>> m =
      LoadModelWithRelease(Dir("no_experts"), Dir("trellis"), ExpertBits::k4Bit, **backend, nullptr, {.max_tokens = 32});
  ASSERT_THAT(m, IsOk());
  absl::StatusOr<std::vector<float>> logits = (*m)->Forward(std::vector<int32_t>{3, 4, 5});
  ASSERT_THAT(logits, IsOk());
  for (float v : *logits) ASSERT_TRUE(std::isfinite(v));
}

TEST_F(SynthReleaseTest, PaddingBitsPastTheCodesStayZero) {
  std::vector<uint8_t> plane(5, 0xff);
  FillRandomCodes(plane, /*used_bits=*/2 * 15, /*seed=*/9);  // 15 two-bit codes: 3 bytes and 6 bits
  EXPECT_EQ(plane[3] & 0xc0, 0) << "the last code byte's top 2 bits are padding";
  EXPECT_EQ(plane[4], 0) << "bytes past the codes";
}

}  // namespace
}  // namespace nq::release
