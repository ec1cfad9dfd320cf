// nq encode end to end: a synthetic GLM-5-shaped checkpoint into a NestQuant release, read
// back expert by expert at 2 and 4 bits.
#include "services/release/release_encoder.h"
#include "services/release/calibration.h"
#include "services/release/release_experts.h"

#include "services/eval/kl_divergence.h"
#include "services/eval/release_kl.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include <gmock/gmock.h>
#include <nlohmann/json.hpp>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/format/manifest.h"
#include "services/format/release_reader.h"
#include "services/model/model.h"
#include "services/model/model_config.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_load.h"
#include "services/model/synth_checkpoint.h"
#include "services/quant/nested_scalar_codec.h"
#include "services/release/release_expert_decoder.h"
#include "tests/common/status_matchers.h"
#include "tests/release/encode_test_config.h"

namespace nq::release {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
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
    absl::StatusOr<model::ModelConfig> config = testing::EncodeTestConfig();
    ASSERT_THAT(config, IsOk());
    ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, (root_ / "model").string(), {.seed = 11}), IsOk());
  }
  void TearDown() override { fs::remove_all(root_); }
  // Two short token sequences (26 tokens) for Calibrate, in calib.txt; returns its path.
  std::string WriteCalibrationTokens() const {
    const std::string path = (root_ / "calib.txt").string();
    std::ofstream tokens(path);
    tokens << "1, 50, 7, 300, 22, 9, 411, 5, 64, 128, 3, 77\n\n17 18 19 20 21 22 23 24 25 26 27 28 29 30\n";
    return path;
  }
  fs::path root_;
};

// Flips the bits `mask` of the byte at `at` in `file` (in place: the file keeps its size).
void FlipBits(const std::string& file, std::streamoff at, char mask) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(at);
  char c = 0;
  f.get(c);
  f.seekp(at);
  f.put(static_cast<char>(c ^ mask));
}

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

// nq encode writes even base grids by default (the GPU's fast 2-bit decode), free Lloyd levels or
// uniform nested levels (the fast 4-bit decode too) on request; the manifest says which, and every
// one decodes.
TEST_F(ReleaseEncoderTest, BaseLevelsAreAnEvenGridUnlessAnotherGridIsAskedFor) {
  for (const quant::BaseGrid grid : {quant::BaseGrid::kUniform, quant::BaseGrid::kLloyd, quant::BaseGrid::kUniformNested}) {
    const std::string name(quant::BaseGridName(grid));
    const std::string release_dir = (root_ / name).string();
    ASSERT_THAT(EncodeRelease((root_ / "model").string(), release_dir, {.tp_size = 1, .base_grid = grid}), IsOk());
    absl::StatusOr<format::Release> release = format::Release::Open(release_dir);
    ASSERT_THAT(release, IsOk());
    EXPECT_EQ(release->manifest().codec_params.value("base_grid", ""), name);
    for (uint32_t expert : {0u, 3u}) {
      for (const char* projection : {"gate_proj", "up_proj", "down_proj"}) {
        absl::StatusOr<quant::EncodedMatrix> m = LoadReleaseExpert(*release, 0, 1, expert, projection, false);
        ASSERT_THAT(m, IsOk());
        const std::vector<float>& base = m->params.base_codebook;
        const std::vector<float>& residual = m->params.residual_codebook;
        ASSERT_EQ(base.size(), 4u);
        ASSERT_EQ(residual.size(), 16u);
        const float step = base[3] - base[2];
        const bool even = base[0] == -1.5f * step && base[1] == -0.5f * step && base[2] == 0.5f * step &&
                          base[3] == 1.5f * step;
        EXPECT_EQ(even, grid != quant::BaseGrid::kLloyd)
            << projection << " of expert " << expert << ": " << base[0] << " " << base[1] << " " << base[2] << " "
            << base[3];
        // The 4-bit levels base + residual on the grid s / 4 * (k - 7.5), exactly, as the GPU's
        // UniformNestedStep checks them.
        bool nested = even;
        for (int k = 0; k < 16 && nested; ++k) {
          nested = base[k / 4] + residual[k] == 0.25f * (step * (static_cast<float>(k) - 7.5f));
        }
        EXPECT_EQ(nested, grid == quant::BaseGrid::kUniformNested) << projection << " of expert " << expert;
      }
    }
  }
}

// nq encode refits each scalar matrix's codebook to its own targets once when it has calibration
// Hessians (one more quantisation pass), and not without them unless asked: the levels then differ
// from the N(0,1) design and from matrix to matrix, the base levels stay on an even grid (the GPU's
// fast 2-bit decode), and the manifest records the count (so a resumed encode under another count
// is refused rather than mixed). 0 keeps the design.
TEST_F(ReleaseEncoderTest, CodebooksAreRefitPerMatrixWithACalibrationOrWhenAsked) {
  const std::string model_dir = (root_ / "model").string();
  const std::string tokens_path = WriteCalibrationTokens();
  absl::StatusOr<std::vector<std::vector<int32_t>>> sequences = ReadTokenFile(tokens_path);
  ASSERT_THAT(sequences, IsOk());
  const std::string calib_path = (root_ / "calib.safetensors").string();
  ASSERT_THAT(Calibrate(model_dir, *sequences, calib_path), IsOk());
  absl::StatusOr<quant::CodecParams> design =
      quant::NestedScalarCodec::DefaultParams(quant::EncodeOptions{}.lambda, quant::BaseGrid::kUniform, {});
  ASSERT_THAT(design, IsOk());
  struct Case {
    std::string name;
    EncodeReleaseOptions options;
    int refits;  // what the manifest must say
  };
  const std::vector<Case> cases = {
      {"calibrated", {.calibration_path = calib_path}, 1},
      {"calibrated-0", {.codebook_refinements = 0, .calibration_path = calib_path}, 0},
      {"calibrated-2", {.codebook_refinements = 2, .calibration_path = calib_path}, 2},
      {"identity", {}, 0},
      {"identity-1", {.codebook_refinements = 1}, 1},
  };
  for (const Case& c : cases) {
    const std::string release_dir = (root_ / c.name).string();
    ASSERT_THAT(EncodeRelease(model_dir, release_dir, c.options), IsOk()) << c.name;
    absl::StatusOr<format::Release> release = format::Release::Open(release_dir);
    ASSERT_THAT(release, IsOk());
    EXPECT_EQ(release->manifest().codec_params.value("codebook_refinements", -1), c.refits) << c.name;
    std::set<std::vector<float>> tables;
    int designed = 0, matrices = 0;
    for (uint32_t expert = 0; expert < 4; ++expert) {
      for (const char* projection : {"gate_proj", "up_proj", "down_proj"}) {
        absl::StatusOr<quant::EncodedMatrix> m = LoadReleaseExpert(*release, 0, 1, expert, projection, true);
        ASSERT_THAT(m, IsOk());
        const std::vector<float>& base = m->params.base_codebook;
        const float step = base[3] - base[2];
        EXPECT_TRUE(base[0] == -1.5f * step && base[1] == -0.5f * step && base[2] == 0.5f * step &&
                    base[3] == 1.5f * step)
            << c.name << ": " << projection << " of expert " << expert << " left the even grid";
        std::vector<float> table = base;
        table.insert(table.end(), m->params.residual_codebook.begin(), m->params.residual_codebook.end());
        tables.insert(table);
        designed += base == design->base_codebook && m->params.residual_codebook == design->residual_codebook;
        ++matrices;
      }
    }
    if (c.refits == 0) {
      EXPECT_EQ(designed, matrices) << c.name << ": without refits every matrix keeps the design";
    } else {
      EXPECT_EQ(designed, 0) << c.name;
      EXPECT_GT(tables.size(), static_cast<size_t>(matrices / 2)) << c.name << ": the levels are each matrix's own";
    }
  }
  // An interrupted encode resumed under another count would mix two kinds of codebooks.
  EXPECT_THAT(EncodeRelease(model_dir, (root_ / "calibrated").string(),
                            {.codebook_refinements = 0, .calibration_path = calib_path}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("another manifest")));
  EXPECT_THAT(EncodeRelease(model_dir, (root_ / "bad").string(), {.codebook_refinements = -2}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--codebook_refinements -2 must be >= 0")));
  EXPECT_THAT(EncodeRelease(model_dir, (root_ / "bad").string(), {.codec = "trellis", .codebook_refinements = 1}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("trellis_v1's codebook is computed")));
}

TEST_F(ReleaseEncoderTest, RerunIsANoOpAndBadOptionsAreRefused) {
  const std::string release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease((root_ / "model").string(), release_dir, {}), IsOk());
  const auto written = fs::last_write_time(fs::path(release_dir) / "rank0" / "L1.bin");
  int progress_calls = 0;
  ASSERT_THAT(EncodeRelease((root_ / "model").string(), release_dir,
                            {.progress = [&](const ProgressState& p) {
                              ++progress_calls;
                              EXPECT_EQ(p.skipped, p.done) << "every layer is on disk: nothing is encoded";
                              EXPECT_EQ(p.work, 0);
                            }}),
              IsOk());
  EXPECT_EQ(fs::last_write_time(fs::path(release_dir) / "rank0" / "L1.bin"), written) << "resumed layers are skipped";
  EXPECT_EQ(progress_calls, 2);
  EXPECT_THAT(EncodeRelease((root_ / "model").string(), (root_ / "r2").string(), {.tp_size = 3}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("does not split over --tp 3")));
  EXPECT_THAT(EncodeRelease((root_ / "model").string(), (root_ / "r3").string(), {.fixed_per_layer = 99}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--fixed-per-layer 99")));
  EXPECT_THAT(EncodeRelease((root_ / "nowhere").string(), (root_ / "r4").string(), {}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("config.json")));
}

}  // namespace
}  // namespace nq::release

namespace nq::release {
namespace {

// Mean KL(p || q) over the rows of two [rows, vocab] logit arrays, through the eval library.
double MeanKl(const std::vector<float>& p_logits, const std::vector<float>& q_logits, int64_t vocab) {
  absl::StatusOr<std::vector<eval::TokenKl>> rows = eval::KlDivergenceRows(p_logits, q_logits, vocab);
  EXPECT_THAT(rows, IsOk());
  return rows.ok() ? eval::SummarizeKl(*rows).mean : -1.0;
}

TEST_F(ReleaseEncoderTest, ModelServesFromTheReleaseAtTwoAndFourBits) {
  const std::string model_dir = (root_ / "model").string(), release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease(model_dir, release_dir, {.fixed_per_layer = 4}), IsOk());
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  const std::vector<int32_t> tokens = {1, 50, 7, 300, 22, 9, 411, 5, 64, 128, 3, 77};
  auto logits_of = [&](std::optional<ExpertBits> bits) -> std::vector<float> {
    absl::StatusOr<std::unique_ptr<model::Model>> m =
        bits.has_value() ? LoadModelWithRelease(model_dir, release_dir, *bits, **backend, nullptr, {.max_tokens = 32})
                         : model::Model::Load(model_dir, **backend, nullptr, {.max_tokens = 32});
    EXPECT_THAT(m, IsOk());
    if (!m.ok()) return {};
    absl::StatusOr<std::vector<float>> l = (*m)->Forward(tokens);
    EXPECT_THAT(l, IsOk());
    return l.ok() ? *std::move(l) : std::vector<float>();
  };
  const std::vector<float> full = logits_of(std::nullopt);
  const double kl4 = MeanKl(full, logits_of(ExpertBits::k4Bit), 512);
  const double kl_fixed = MeanKl(full, logits_of(ExpertBits::kFixedSet), 512);
  const double kl2 = MeanKl(full, logits_of(ExpertBits::k2Bit), 512);
  std::printf("[ release  ] KL to full precision: 4-bit %.3g, fixed set (4 of 16) %.3g, 2-bit %.3g\n", kl4, kl_fixed, kl2);
  EXPECT_GT(kl4, 0);
  EXPECT_LT(kl4, kl_fixed);
  EXPECT_LT(kl_fixed, kl2);
}

TEST_F(ReleaseEncoderTest, IncompleteOrForeignReleasesAreRefused) {
  const std::string model_dir = (root_ / "model").string(), release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease(model_dir, release_dir, {}), IsOk());
  absl::StatusOr<std::unique_ptr<kernels::Backend>> backend = kernels::CreateBackend("cpu");
  ASSERT_THAT(backend, IsOk());
  // Another model's release: the config hash differs.
  const std::string other = (root_ / "other").string();
  std::ifstream in(std::string(NQ_SOURCE_DIR) + "/configs/test/glm5_encode.json");
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<model::ModelConfig> config = model::ParseModelConfig(text.str());
  ASSERT_THAT(config, IsOk());
  config->rms_norm_eps = 1e-6;
  ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, other, {.seed = 12}), IsOk());
  EXPECT_THAT(LoadModelWithRelease(other, release_dir, ExpertBits::k4Bit, **backend, nullptr, {.max_tokens = 8}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("config")));
  fs::remove(fs::path(release_dir) / "COMPLETE");
  EXPECT_THAT(LoadModelWithRelease(model_dir, release_dir, ExpertBits::k4Bit, **backend, nullptr, {.max_tokens = 8}),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("COMPLETE")));
  EXPECT_THAT(ParseExpertBits("3"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("want 2, 4 or fixed")));
}

// trellis_v1 through the whole release path, on a narrower model (2 experts of 128 x 16) so
// the Viterbi encode stays within a few seconds.
// Every file of a directory, by path relative to it, with its bytes.
std::map<std::string, std::string> DirectoryBytes(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    std::ifstream in(entry.path(), std::ios::binary);
    files[fs::relative(entry.path(), dir).string()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return files;
}

// Experts encoded by several workers: the same files, byte for byte, as by one (LDLQ included).
TEST_F(ReleaseEncoderTest, WorkersWriteTheOneWorkersBytes) {
  const std::string model_dir = (root_ / "model").string();
  const std::string calib_path = (root_ / "calib.safetensors").string();
  ASSERT_THAT(Calibrate(model_dir, {{1, 5, 9, 13, 17, 21, 25, 29}, {2, 4, 6, 8, 10, 12}}, calib_path), IsOk());
  ASSERT_THAT(EncodeRelease(model_dir, (root_ / "one").string(), {.fixed_per_layer = 2, .calibration_path = calib_path}),
              IsOk());
  EncodeReleaseOptions options{.fixed_per_layer = 2, .calibration_path = calib_path};
  options.workers = 3;
  ASSERT_THAT(EncodeRelease(model_dir, (root_ / "three").string(), options), IsOk());
  const std::map<std::string, std::string> one = DirectoryBytes(root_ / "one"), three = DirectoryBytes(root_ / "three");
  ASSERT_GT(one.size(), 3u);
  ASSERT_EQ(one.size(), three.size());
  for (const auto& [path, bytes] : one) {
    ASSERT_TRUE(three.contains(path)) << path;
    EXPECT_TRUE(three.at(path) == bytes) << path << " differs";
  }
}

// A failing expert fails the encode by name with several workers, as with one.
TEST_F(ReleaseEncoderTest, WorkersReportAFailingExpertByName) {
  absl::StatusOr<model::ModelConfig> config = testing::EncodeTestConfig();
  ASSERT_THAT(config, IsOk());
  const std::string model_dir = (root_ / "no_experts").string();
  ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, model_dir, {.seed = 11, .routed_experts = false}), IsOk());
  EncodeReleaseOptions options;
  options.workers = 4;
  EXPECT_THAT(EncodeRelease(model_dir, (root_ / "r").string(), options),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("mlp.experts.0.gate_proj.weight")));
}

TEST_F(ReleaseEncoderTest, TrellisReleaseNamesItsCodecAndServesBothLevels) {
  std::ifstream in(std::string(NQ_SOURCE_DIR) + "/configs/test/glm5_encode.json");
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<model::ModelConfig> config = model::ParseModelConfig(text.str());
  ASSERT_THAT(config, IsOk());
  config->n_routed_experts = 2;
  config->num_experts_per_tok = 2;
  config->moe_intermediate_size = 16;
  const std::string model_dir = (root_ / "narrow").string(), release_dir = (root_ / "trellis").string();
  ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, model_dir, {.seed = 13}), IsOk());
  std::vector<ProgressState> progress;
  ASSERT_THAT(EncodeRelease(model_dir, release_dir,
                            {.codec = "trellis", .progress = [&](const ProgressState& p) { progress.push_back(p); }}),
              IsOk());
  // One call per expert: 2 MoE layers x 2 experts, each 3 matrices of hidden x 16 weights.
  ASSERT_EQ(progress.size(), 4u);
  EXPECT_EQ(progress.front().done, 1);
  EXPECT_EQ(progress.front().total, 4);
  EXPECT_EQ(progress.back().done, 4);
  EXPECT_EQ(progress.back().skipped, 0);
  EXPECT_EQ(progress.back().work, 4.0 * 3 * config->hidden_size * 16);
  EXPECT_THAT(progress.front().stage, HasSubstr("layer "));
  absl::StatusOr<format::Release> release = format::Release::Open(release_dir);
  ASSERT_THAT(release, IsOk());
  EXPECT_EQ(release->manifest().codec, "trellis_v1");
  EXPECT_EQ(release->manifest().codec_params.value("state_bits", 0), 16);

  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(model_dir);
  ASSERT_THAT(checkpoint, IsOk());
  absl::StatusOr<model::FloatTensor> original = model::LoadFloat32(*checkpoint, "model.layers.1.mlp.experts.1.up_proj.weight");
  ASSERT_THAT(original, IsOk());
  absl::StatusOr<std::unique_ptr<ReleaseExpertDecoder>> decoder =
      ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {});
  ASSERT_THAT(decoder, IsOk());
  absl::StatusOr<DecodedExpert> two = (*decoder)->Decode(1, 1, quant::Precision::k2Bit, {});
  absl::StatusOr<DecodedExpert> four = (*decoder)->Decode(1, 1, quant::Precision::k4Bit, {});
  ASSERT_THAT(two, IsOk());
  ASSERT_THAT(four, IsOk());
  // gate_up holds gate's rows then up's.
  const size_t n = original->values.size();
  const std::vector<float> up2(two->gate_up.begin() + n, two->gate_up.end());
  const std::vector<float> up4(four->gate_up.begin() + n, four->gate_up.end());
  const double e2 = RelativeError(up2, original->values), e4 = RelativeError(up4, original->values);
  std::printf("[ release  ] trellis_v1 up_proj relative error: 2-bit %.4f, 4-bit %.4f\n", e2, e4);
  // sqrt of the N(0,1) MSEs (0.069 / 0.0047) is 0.26 / 0.069; small matrices fold scales less well.
  EXPECT_LT(e2, 0.30);
  EXPECT_LT(e4, 0.085);
}

// Serving checks what it loads: one flipped byte in a resident file, or in the manifest, and
// the decoder (the worker's and nq kld's way in) refuses the release, naming the file.
TEST_F(ReleaseEncoderTest, DecoderRefusesAReleaseWhoseBytesDifferFromItsChecksums) {
  const std::string model_dir = (root_ / "model").string(), release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease(model_dir, release_dir, {}), IsOk());
  std::ifstream config_in(model_dir + "/config.json");
  std::stringstream text;
  text << config_in.rdbuf();
  absl::StatusOr<model::ModelConfig> config = model::ParseModelConfig(text.str());
  ASSERT_THAT(config, IsOk());
  ASSERT_THAT(ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {}), IsOk());

  absl::StatusOr<format::Release> release = format::Release::Open(release_dir);
  ASSERT_THAT(release, IsOk());
  const format::FileRange& resident = release->indexes()[0].layers.back().resident;
  const std::string path = release_dir + "/" + resident.file;
  auto flip = [](const std::string& file, std::streamoff at) { FlipBits(file, at, 0x10); };
  flip(path, static_cast<std::streamoff>(resident.bytes / 2));
  EXPECT_THAT(ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {}),
              StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr(resident.file), HasSubstr("sha256 differs"))));
  EXPECT_THAT(ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {}, /*verify=*/false), IsOk());
  flip(path, static_cast<std::streamoff>(resident.bytes / 2));  // back as it was
  ASSERT_THAT(ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {}), IsOk());
  // A manifest edited by hand (still valid JSON, its sha256 no longer the one COMPLETE lists).
  const std::string manifest_path = release_dir + "/" + format::kManifestFile;
  std::ifstream manifest_in(manifest_path);
  nlohmann::json manifest = nlohmann::json::parse(manifest_in);
  manifest_in.close();
  manifest["source_model"] = "someone/else";
  std::ofstream(manifest_path) << manifest.dump(2);
  EXPECT_THAT(ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {}),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr(format::kManifestFile)));
}

// Record files are not hashed at load (the streamer and the worker check each record as they read
// it): a record damaged on disk is refused by the decoder's reads, by name and checksum, and
// the layer's other records still read. What a layer-major prefill or a static fixed set loads
// at 4 bits comes through these reads.
TEST_F(ReleaseEncoderTest, DecoderReadsOfADamagedRecordAreRefused) {
  const std::string model_dir = (root_ / "model").string(), release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease(model_dir, release_dir, {}), IsOk());
  absl::StatusOr<model::ModelConfig> config = model::LoadModelConfig(model_dir);
  ASSERT_THAT(config, IsOk());
  absl::StatusOr<std::unique_ptr<ReleaseExpertDecoder>> decoder =
      ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {});
  ASSERT_THAT(decoder, IsOk());
  const uint32_t layer = (*decoder)->moe_layer_ids().front();
  absl::StatusOr<const format::LayerEntry*> entry = (*decoder)->release().Layer(0, layer);
  ASSERT_THAT(entry, IsOk());
  ASSERT_FALSE((*entry)->record_xxh3.empty()) << "a release this build writes carries XXH3 record checksums";
  const std::string path = release_dir + "/" + (*entry)->records.file;
  const std::streamoff at =
      static_cast<std::streamoff>((*entry)->records.offset + 1 * (*entry)->layout.rec_bytes + 3);  // expert 1
  FlipBits(path, at, 0x01);
  EXPECT_THAT((*decoder)->ReadRecord(layer, 1),
              StatusIs(absl::StatusCode::kDataLoss,
                       AllOf(HasSubstr(absl::StrCat("layer ", layer, " expert 1")), HasSubstr((*entry)->records.file),
                             HasSubstr("does not match its xxh3"))));
  EXPECT_THAT((*decoder)->Decode(layer, 1, quant::Precision::k4Bit, {}).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("expert 1")));
  EXPECT_THAT((*decoder)->ReadRecord(layer, 0), IsOk());
  EXPECT_THAT((*decoder)->ReadRecord(layer, 2), IsOk());
  EXPECT_THAT((*decoder)->Decode(layer, 1, quant::Precision::k2Bit, {}), IsOk()) << "2 bits read no record";
}

TEST_F(ReleaseEncoderTest, DecoderRefusesACodecThisBuildLacks) {
  const std::string model_dir = (root_ / "model").string(), release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease(model_dir, release_dir, {}), IsOk());
  // A release from a newer build: only the manifest's codec name differs.
  const std::string manifest_path = release_dir + "/" + format::kManifestFile;
  std::ifstream in(manifest_path);
  nlohmann::json manifest = nlohmann::json::parse(in);
  in.close();
  manifest["codec"]["name"] = "trellis_v9";
  std::ofstream(manifest_path) << manifest.dump(2);
  std::ifstream config_in(model_dir + "/config.json");
  std::stringstream text;
  text << config_in.rdbuf();
  absl::StatusOr<model::ModelConfig> config = model::ParseModelConfig(text.str());
  ASSERT_THAT(config, IsOk());
  // verify off: a newer build's release would carry a COMPLETE that matches its manifest; here
  // only the codec refusal is under test.
  EXPECT_THAT(ReleaseExpertDecoder::Open(release_dir, model_dir, *config, {}, /*verify=*/false),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("coded with 'trellis_v9'"), HasSubstr("cannot decode"),
                             HasSubstr("known: nested_scalar_v1, trellis_v1"))));
  EXPECT_THAT(EncodeRelease(model_dir, (root_ / "r5").string(), {.codec = "trellis_v9"}),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("unknown codec 'trellis_v9'")));
}

}  // namespace
}  // namespace nq::release

namespace nq::release {
namespace {

TEST_F(ReleaseEncoderTest, CalibrationRanksExpertsAndFeedsLdlq) {
  const std::string model_dir = (root_ / "model").string();
  const std::string tokens_path = WriteCalibrationTokens();
  absl::StatusOr<std::vector<std::vector<int32_t>>> sequences = ReadTokenFile(tokens_path);
  ASSERT_THAT(sequences, IsOk());
  ASSERT_EQ(sequences->size(), 2u);
  const std::string calib_path = (root_ / "calib.safetensors").string();
  absl::StatusOr<Calibration> calibration = Calibrate(model_dir, *sequences, calib_path);
  ASSERT_THAT(calibration, IsOk());
  // 26 tokens, top-4 routing, per MoE layer (layer 1; the MTP layer does not run here).
  const std::vector<double>& counts = calibration->routing_counts.at(1);
  double total = 0;
  for (double c : counts) total += c;
  EXPECT_EQ(total, 26 * 4);

  absl::StatusOr<Calibration> loaded = LoadCalibration(calib_path);
  ASSERT_THAT(loaded, IsOk());
  EXPECT_EQ(loaded->experts.size(), calibration->experts.size());
  EXPECT_EQ(loaded->routing_counts.at(1), counts);

  const std::string release_dir = (root_ / "release").string();
  ASSERT_THAT(EncodeRelease(model_dir, release_dir, {.fixed_per_layer = 3, .calibration_path = calib_path}), IsOk());
  absl::StatusOr<format::Release> release = format::Release::Open(release_dir);
  ASSERT_THAT(release, IsOk());
  const format::ManifestLayer* layer = release->manifest().FindLayer(1);
  ASSERT_NE(layer, nullptr);
  for (size_t i = 1; i < layer->ranking.size(); ++i) {
    EXPECT_GE(counts[layer->ranking[i - 1]], counts[layer->ranking[i]]) << "ranked by routing counts";
  }
  EXPECT_EQ(layer->fixed_4bit, std::vector<uint32_t>(layer->ranking.begin(), layer->ranking.begin() + 3));
  EXPECT_THAT(LoadCalibration((root_ / "missing.safetensors").string()), StatusIs(absl::StatusCode::kNotFound, HasSubstr("missing")));
  {
    std::ofstream bad(root_ / "bad.txt");
    bad << "1, 2, x\n";
  }
  EXPECT_THAT(ReadTokenFile((root_ / "bad.txt").string()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad.txt:1: 'x' is not a token id")));
}

}  // namespace
}  // namespace nq::release

namespace nq::release {
namespace {

// The HF fixtures (GLM-5 and DeepSeek-V3, their expert matrices 64 x 16) through nq encode:
// what 2-bit and 4-bit experts cost in KL against full precision.
TEST_F(ReleaseEncoderTest, FixtureModelsLoseLittleAtFourBitsAndMoreAtTwo) {
  for (const char* name : {"glm5_tiny", "dsv3_tiny_fp8"}) {
    const std::string model_dir = std::string(NQ_SOURCE_DIR) + "/tests/fixtures/models/" + name;
    std::ifstream in(model_dir + "/tokens.json");
    nlohmann::json json = nlohmann::json::parse(in);
    const std::vector<int32_t> tokens = json["input_ids"].get<std::vector<int32_t>>();
    const std::string release = (root_ / name).string();
    absl::StatusOr<eval::KlReport> two = eval::MeasureReleaseKl(model_dir, release, tokens, ExpertBits::k2Bit);
    absl::StatusOr<eval::KlReport> four = eval::MeasureReleaseKl(model_dir, release, tokens, ExpertBits::k4Bit);
    ASSERT_THAT(two, IsOk());
    ASSERT_THAT(four, IsOk());
    std::printf("[ release  ] %s: KL 2-bit %.5f (top-1 %.3f), 4-bit %.5f (top-1 %.3f)\n", name, two->mean_kl,
                two->top1_agreement, four->mean_kl, four->top1_agreement);
    EXPECT_GT(four->mean_kl, 0);
    EXPECT_LT(four->mean_kl, 0.005) << name;
    EXPECT_LT(four->mean_kl * 4, two->mean_kl) << name;
    EXPECT_GE(four->top1_agreement, two->top1_agreement) << name;
  }
}

}  // namespace
}  // namespace nq::release
