// Releases with low-rank corrections (issue #16; services/release/low_rank_io.h): what nq encode
// writes decodes to exactly the in-memory W_hat + U V at both levels, through the dense decoder and
// the CPU backend's packed op; releases without corrections are the bytes they were; damaged factor
// data is refused by name; a backend without the feature refuses such a layer at load.
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/format/manifest.h"
#include "services/format/release_reader.h"
#include "services/model/model.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_load.h"
#include "services/model/safetensors_writer.h"
#include "services/model/synth_checkpoint.h"
#include "services/quant/low_rank_fit.h"
#include "services/release/calibration.h"
#include "services/release/low_rank_io.h"
#include "services/release/packed_experts.h"
#include "services/release/release_encoder.h"
#include "services/release/release_expert_decoder.h"
#include "services/release/release_experts.h"
#include "tests/common/status_matchers.h"
#include "tests/release/encode_test_config.h"

namespace nq::release {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
namespace fs = std::filesystem;

// Low enough that the synthetic model's calibration Hessians have outlier channels (their
// largest diagonal is a few times the median), so most matrices are corrected.
constexpr quant::LowRankOptions kLowRank{.rank = 2, .outlier_threshold = 1.5, .min_gain = 0.0};

std::string ReadBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class LowRankReleaseTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fs::temp_directory_path() / absl::StrCat("nq-lowrank-test-", getpid()));
    fs::remove_all(*root_);
    absl::StatusOr<model::ModelConfig> config = testing::EncodeTestConfig();
    ASSERT_THAT(config, IsOk());
    ASSERT_THAT(model::WriteSyntheticCheckpoint(*config, Dir("model"), {.seed = 11}), IsOk());
    const std::vector<std::vector<int32_t>> tokens = {{1, 50, 7, 300, 22, 9, 411, 5, 64, 128, 3, 77},
                                                      {17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30},
                                                      {2, 4, 6, 8, 10, 12, 14, 16, 200, 201, 202, 203}};
    ASSERT_THAT(Calibrate(Dir("model"), tokens, Dir("calib.safetensors")), IsOk());
    const EncodeReleaseOptions plain{.fixed_per_layer = 2, .calibration_path = Dir("calib.safetensors")};
    ASSERT_THAT(EncodeRelease(Dir("model"), Dir("plain"), plain), IsOk());
    EncodeReleaseOptions lowrank = plain;
    lowrank.lowrank = kLowRank;
    stats_ = new LowRankStats();
    lowrank.lowrank_stats = stats_;
    ASSERT_THAT(EncodeRelease(Dir("model"), Dir("lowrank"), lowrank), IsOk());
    // Asked for, but no matrix passes the outlier test: nothing to store.
    EncodeReleaseOptions none = plain;
    none.lowrank = {.rank = 2, .outlier_threshold = 1e9};
    ASSERT_THAT(EncodeRelease(Dir("model"), Dir("none_kept"), none), IsOk());
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
    delete stats_;
  }
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<kernels::Backend>> b = kernels::CreateBackend("cpu");
    ASSERT_THAT(b, IsOk());
    backend_ = *std::move(b);
    config_ = *model::LoadModelConfig(Dir("model"));
  }
  static std::string Dir(const char* name) { return (*root_ / name).string(); }
  std::unique_ptr<ReleaseExpertDecoder> Open(const char* release) {
    absl::StatusOr<std::unique_ptr<ReleaseExpertDecoder>> d = ReleaseExpertDecoder::Open(Dir(release), Dir("model"), config_, {});
    EXPECT_THAT(d, IsOk());
    return d.ok() ? *std::move(d) : nullptr;
  }

  static fs::path* root_;
  static LowRankStats* stats_;
  std::unique_ptr<kernels::Backend> backend_;
  model::ModelConfig config_;
};
fs::path* LowRankReleaseTest::root_ = nullptr;
LowRankStats* LowRankReleaseTest::stats_ = nullptr;

TEST_F(LowRankReleaseTest, TheEncoderCorrectsMatricesWithOutliersAndSaysSo) {
  EXPECT_GT(stats_->with_outliers, 0);
  EXPECT_GT(stats_->kept, 0);
  EXPECT_LT(stats_->error2_corrected, stats_->error2);
  EXPECT_GT(stats_->resident_bytes, 0);
  EXPECT_GT(stats_->record_bytes, 0);
  absl::StatusOr<format::Release> release = format::Release::Open(Dir("lowrank"));
  ASSERT_THAT(release, IsOk());
  EXPECT_EQ(release->manifest().version, format::kLowRankFormatVersion);
  EXPECT_THAT(ReleaseLowRank(release->manifest()), ::nq::testing::IsOkAndHolds(2));
  EXPECT_TRUE(release->Verify().ok()) << release->Verify().ToString();
}

// encode -> files -> decode equals the encoder's own W_hat + U V: the same codes and factors,
// recomputed here from the checkpoint and the calibration, decoded with quant::DecodeCorrected.
TEST_F(LowRankReleaseTest, DecodedExpertsEqualTheInMemoryCorrectedWeights) {
  std::unique_ptr<ReleaseExpertDecoder> decoder = Open("lowrank");
  ASSERT_NE(decoder, nullptr);
  absl::StatusOr<Calibration> calibration = LoadCalibration(Dir("calib.safetensors"));
  ASSERT_THAT(calibration, IsOk());
  absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(Dir("model"));
  ASSERT_THAT(checkpoint, IsOk());
  absl::StatusOr<std::unique_ptr<quant::Codec>> codec = quant::MakeCodec(decoder->release().manifest().codec);
  ASSERT_THAT(codec, IsOk());
  int corrected = 0;
  for (uint32_t expert = 0; expert < config_.n_routed_experts; ++expert) {
    auto h = calibration->experts.find({1, expert});
    if (h == calibration->experts.end() || h->second.samples == 0) continue;
    absl::StatusOr<DecodedExpert> got2 = decoder->Decode(1, expert, quant::Precision::k2Bit);
    absl::StatusOr<DecodedExpert> got4 = decoder->Decode(1, expert, quant::Precision::k4Bit);
    ASSERT_THAT(got2, IsOk());
    ASSERT_THAT(got4, IsOk());
    for (const char* projection : {"gate_proj", "up_proj", "down_proj"}) {
      const bool down = std::string(projection) == "down_proj";
      absl::StatusOr<model::FloatTensor> w =
          model::LoadFloat32(*checkpoint, absl::StrCat("model.layers.1.mlp.experts.", expert, ".", projection, ".weight"));
      ASSERT_THAT(w, IsOk());
      absl::StatusOr<quant::EncodedMatrix> stored = LoadReleaseExpert(decoder->release(), 0, 1, expert, projection, false);
      ASSERT_THAT(stored, IsOk());
      quant::EncodeOptions encode;
      encode.rotation = stored->params.rotation;
      encode.codebook_refinements = decoder->release().manifest().codec_params.value("codebook_refinements", 0);
      const quant::Hessian& hessian = down ? h->second.down : h->second.gate_up;
      absl::StatusOr<quant::EncodedMatrix> m = (*codec)->Encode(w->values, w->shape[0], w->shape[1], &hessian, encode);
      ASSERT_THAT(m, IsOk());
      ASSERT_EQ(m->base_codes, stored->base_codes) << "the test re-encodes what nq encode encoded";
      absl::StatusOr<quant::CorrectionFit> fit = quant::FitCorrection(**codec, *m, w->values, &hessian, kLowRank);
      ASSERT_THAT(fit, IsOk());
      if (fit->correction.empty()) continue;
      ++corrected;
      for (quant::Precision p : {quant::Precision::k2Bit, quant::Precision::k4Bit}) {
        std::vector<float> want(w->values.size());
        ASSERT_THAT(quant::DecodeCorrected(**codec, *m, fit->correction, p, want), IsOk());
        const DecodedExpert& got = p == quant::Precision::k2Bit ? *got2 : *got4;
        const std::vector<float>& all = down ? got.down : got.gate_up;
        const size_t offset = std::string(projection) == "up_proj" ? want.size() : 0;
        const std::vector<float> slice(all.begin() + offset, all.begin() + offset + want.size());
        EXPECT_EQ(slice, want) << projection << " of expert " << expert << " at "
                               << (p == quant::Precision::k2Bit ? 2 : 4) << " bits";
        std::vector<float> uncorrected(w->values.size());
        ASSERT_THAT((*codec)->Decode(*m, p, uncorrected), IsOk());
        EXPECT_NE(slice, uncorrected) << "the correction is applied";
      }
    }
  }
  EXPECT_GT(corrected, 0);
}

// The same model served from packed codes by the CPU backend (the op nq kld runs) equals the dense
// decode with corrections, at 2 bits, 4 bits and the fixed set.
TEST_F(LowRankReleaseTest, PackedOpAppliesBothLevelsAsTheDenseDecodeDoes) {
  const std::vector<int32_t> tokens = {1, 50, 7, 300, 22, 9, 411, 5, 64, 128, 3, 77, 12, 200};
  for (ExpertBits bits : {ExpertBits::k2Bit, ExpertBits::k4Bit, ExpertBits::kFixedSet}) {
    absl::StatusOr<std::unique_ptr<model::Model>> packed =
        LoadModelWithRelease(Dir("model"), Dir("lowrank"), bits, *backend_, nullptr, {.max_tokens = 64});
    ASSERT_THAT(packed, IsOk());
    absl::StatusOr<std::vector<float>> got = (*packed)->Forward(tokens);
    ASSERT_THAT(got, IsOk());
    // The dense reference: every expert decoded by ReleaseExpertDecoder (corrections included).
    std::unique_ptr<ReleaseExpertDecoder> decoder = Open("lowrank");
    ASSERT_NE(decoder, nullptr);
    absl::StatusOr<model::Checkpoint> checkpoint = model::Checkpoint::Open(Dir("model"));
    ASSERT_THAT(checkpoint, IsOk());
    absl::StatusOr<model::ModelWeights> weights = model::LoadModelWeights(*checkpoint, config_, *backend_, {});
    ASSERT_THAT(weights, IsOk());
    for (uint32_t layer : decoder->moe_layer_ids()) {
      model::LayerWeights& lw = layer < config_.num_hidden_layers ? weights->layers[layer]
                                                                  : weights->mtp[layer - config_.num_hidden_layers].block;
      const std::vector<uint32_t> fixed = decoder->FixedSet(layer);
      for (uint32_t e = 0; e < lw.moe->experts.size(); ++e) {
        const bool four = bits == ExpertBits::k4Bit ||
                          (bits == ExpertBits::kFixedSet && std::find(fixed.begin(), fixed.end(), e) != fixed.end());
        absl::StatusOr<model::MlpWeights> w =
            decoder->Upload(layer, e, four ? quant::Precision::k4Bit : quant::Precision::k2Bit, {}, *backend_);
        ASSERT_THAT(w, IsOk());
        lw.moe->experts[e] = *std::move(w);
      }
    }
    absl::StatusOr<std::unique_ptr<model::Model>> dense =
        model::Model::Create(config_, *std::move(weights), *backend_, nullptr, {.max_tokens = 64});
    ASSERT_THAT(dense, IsOk());
    absl::StatusOr<std::vector<float>> want = (*dense)->Forward(tokens);
    ASSERT_THAT(want, IsOk());
    double diff = 0, max = 0;
    for (size_t i = 0; i < want->size(); ++i) {
      diff = std::max(diff, std::abs(static_cast<double>((*got)[i]) - (*want)[i]));
      max = std::max(max, std::abs(static_cast<double>((*want)[i])));
    }
    std::printf("[ low-rank ] bits policy %d: max |packed - dense| / max |logit| = %.3g\n", static_cast<int>(bits),
                diff / max);
    EXPECT_LT(diff / max, 1e-4);
    // ...and differs from the uncorrected release's packed logits by far more than that.
    absl::StatusOr<std::unique_ptr<model::Model>> plain =
        LoadModelWithRelease(Dir("model"), Dir("plain"), bits, *backend_, nullptr, {.max_tokens = 64});
    ASSERT_THAT(plain, IsOk());
    absl::StatusOr<std::vector<float>> uncorrected = (*plain)->Forward(tokens);
    ASSERT_THAT(uncorrected, IsOk());
    double moved = 0;
    for (size_t i = 0; i < want->size(); ++i) moved = std::max(moved, std::abs(static_cast<double>((*uncorrected)[i]) - (*got)[i]));
    EXPECT_GT(moved / max, 1e-3);
  }
}

// A release without corrections (the default rank 0, or no matrix kept) is version 2 with no
// factor tensors or segments, its resident and record files byte for byte those of rank 0, and it
// decodes as the codec alone decodes.
TEST_F(LowRankReleaseTest, ReleasesWithoutCorrectionsAreUnchanged) {
  absl::StatusOr<format::Release> plain = format::Release::Open(Dir("plain"));
  ASSERT_THAT(plain, IsOk());
  EXPECT_EQ(plain->manifest().version, format::kFormatVersion);
  EXPECT_FALSE(plain->manifest().codec_params.contains(format::kLowRankParam));
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(Dir("plain"))) {
    if (!entry.is_regular_file()) continue;
    const fs::path rel = fs::relative(entry.path(), Dir("plain"));
    if (rel == "manifest.json" || rel == "COMPLETE") continue;  // the none_kept manifest announces rank 2
    EXPECT_EQ(ReadBytes(entry.path()), ReadBytes(fs::path(Dir("none_kept")) / rel)) << rel;
  }
  absl::StatusOr<const format::LayerEntry*> layer = plain->Layer(0, 1);
  ASSERT_THAT(layer, IsOk());
  for (const format::Segment& s : (*layer)->layout.segments) EXPECT_THAT(s.name, ::testing::EndsWith(".residual"));

  std::unique_ptr<ReleaseExpertDecoder> decoder = Open("plain");
  ASSERT_NE(decoder, nullptr);
  absl::StatusOr<std::unique_ptr<quant::Codec>> codec = quant::MakeCodec(plain->manifest().codec);
  ASSERT_THAT(codec, IsOk());
  absl::StatusOr<DecodedExpert> got = decoder->Decode(1, 3, quant::Precision::k4Bit);
  ASSERT_THAT(got, IsOk());
  absl::StatusOr<quant::EncodedMatrix> m = LoadReleaseExpert(*plain, 0, 1, 3, "down_proj", true);
  ASSERT_THAT(m, IsOk());
  std::vector<float> want(got->down.size());
  ASSERT_THAT((*codec)->Decode(*m, quant::Precision::k4Bit, want), IsOk());
  EXPECT_EQ(got->down, want);
}

TEST_F(LowRankReleaseTest, DamagedOrMisplacedFactorsAreRefusedByName) {
  std::unique_ptr<ReleaseExpertDecoder> decoder = Open("lowrank");
  ASSERT_NE(decoder, nullptr);
  absl::StatusOr<const format::LayerEntry*> layer = decoder->Layer(1);
  ASSERT_THAT(layer, IsOk());
  absl::StatusOr<format::Segment> segment = (*layer)->layout.Find(LowRankSegment("gate_proj"));
  ASSERT_THAT(segment, IsOk()) << "some expert's gate_proj is corrected";
  absl::StatusOr<const model::SafetensorsFile*> resident = decoder->Resident(1);
  ASSERT_THAT(resident, IsOk());
  uint32_t expert = 0;
  while (!(*resident)->Find(absl::StrCat("experts.", expert, ".gate_proj.lowrank_u")).ok()) ++expert;
  absl::StatusOr<std::vector<std::byte>> record = decoder->ReadRecord(1, expert);
  ASSERT_THAT(record, IsOk());
  // A NaN in the residual level's U (fp16 0x7e00, little-endian), as a slot would hand it over.
  std::vector<std::byte> nan = *record;
  nan[segment->offset] = std::byte{0x00};
  nan[segment->offset + 1] = std::byte{0x7e};
  EXPECT_THAT(decoder->Decode(1, expert, quant::Precision::k4Bit, nan),
              StatusIs(absl::StatusCode::kDataLoss, AllOf(HasSubstr("gate_proj.lowrank"), HasSubstr("non-finite"))));
  EXPECT_THAT(decoder->Decode(1, expert, quant::Precision::k4Bit, *record), IsOk()) << "the undamaged record";

  // Resident factors: one half missing, too high a rank, or present where the manifest has none.
  const int64_t rows = config_.moe_intermediate_size, cols = config_.hidden_size;
  const std::vector<float> u(static_cast<size_t>(rows * 3), 0.5f);
  model::SafetensorsWriter half;
  ASSERT_THAT(half.AddFloat32("experts.0.gate_proj.lowrank_u", {rows, 3}, u, model::DType::kF16), IsOk());
  ASSERT_THAT(half.Write(Dir("half.safetensors")), IsOk());
  absl::StatusOr<model::SafetensorsFile> half_file = model::SafetensorsFile::Open(Dir("half.safetensors"));
  ASSERT_THAT(half_file, IsOk());
  EXPECT_THAT(LoadResidentFactors(*half_file, 0, "gate_proj", rows, cols, 4),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("only one of lowrank_u and lowrank_v")));
  model::SafetensorsWriter high;
  ASSERT_THAT(high.AddFloat32("experts.0.gate_proj.lowrank_u", {rows, 3}, u, model::DType::kF16), IsOk());
  ASSERT_THAT(high.AddFloat32("experts.0.gate_proj.lowrank_v", {3, cols}, std::vector<float>(3 * cols, 0.5f),
                              model::DType::kF16),
              IsOk());
  ASSERT_THAT(high.Write(Dir("high.safetensors")), IsOk());
  absl::StatusOr<model::SafetensorsFile> high_file = model::SafetensorsFile::Open(Dir("high.safetensors"));
  ASSERT_THAT(high_file, IsOk());
  EXPECT_THAT(LoadResidentFactors(*high_file, 0, "gate_proj", rows, cols, 2),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("1 <= r <= 2")));
  EXPECT_THAT(LoadResidentFactors(*high_file, 0, "gate_proj", rows, cols, 0),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("does not announce")));
  EXPECT_THAT(LoadResidentFactors(*high_file, 0, "gate_proj", rows, cols, 4), IsOk());
}

TEST_F(LowRankReleaseTest, EncoderRefusesARankOutOfRangeOrWithoutCalibration) {
  EncodeReleaseOptions options{.calibration_path = Dir("calib.safetensors")};
  options.lowrank.rank = 5;
  EXPECT_THAT(EncodeRelease(Dir("model"), Dir("refused"), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--lowrank_rank 5 is outside [0, 4]")));
  options = {};
  options.lowrank.rank = 2;
  EXPECT_THAT(EncodeRelease(Dir("model"), Dir("refused"), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("needs a calibration")));
  options.synthetic_seed = 1;
  options.calibration_path = Dir("calib.safetensors");
  EXPECT_THAT(EncodeRelease(Dir("model"), Dir("refused"), options),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("synthetic release")));
  EXPECT_FALSE(fs::exists(Dir("refused"))) << "refused before anything is written";
}

TEST_F(LowRankReleaseTest, ManifestVersionAndLowRankParameterGoTogether) {
  absl::StatusOr<format::Release> release = format::Release::Open(Dir("lowrank"));
  ASSERT_THAT(release, IsOk());
  format::Manifest m = release->manifest();
  m.version = format::kFormatVersion;
  EXPECT_THAT(format::ParseManifest(format::SerializeManifest(m)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has codec.params.lowrank")));
  m.version = 4;
  EXPECT_THAT(format::ParseManifest(format::SerializeManifest(m)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("format version 4 is not supported")));
  m = release->manifest();
  m.codec_params[format::kLowRankParam]["max_rank"] = 9;
  absl::StatusOr<format::Manifest> parsed = format::ParseManifest(format::SerializeManifest(m));
  ASSERT_THAT(parsed, IsOk());
  EXPECT_THAT(ReleaseLowRank(*parsed), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("max_rank 9")));
}

// Host memory and copies only, and no low-rank support: what a backend whose kernels do not apply
// the factors (Backend::AppliesNqLowRank) is to these releases.
class HostStorage final : public kernels::Storage {
 public:
  explicit HostStorage(std::size_t bytes) : Storage(std::calloc(bytes == 0 ? 1 : bytes, 1), bytes) {}
  ~HostStorage() override { std::free(data()); }
};
class NoLowRankBackend final : public kernels::Backend {
 public:
  std::string_view name() const override { return "nolowrank"; }
  std::string DeviceDescription() const override { return "host memory, no low-rank NqMoe"; }
  absl::Status Synchronize() override { return absl::OkStatus(); }

 protected:
  absl::StatusOr<std::unique_ptr<kernels::Storage>> AllocateStorage(std::size_t bytes) override {
    return std::make_unique<HostStorage>(bytes);
  }
  absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) override {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status DoMatMul(const kernels::Tensor&, const kernels::Tensor&, kernels::Tensor&,
                        const kernels::MatMulDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoMatMulBlockScaled(const kernels::Tensor&, const kernels::Tensor&, const kernels::Tensor&,
                                   kernels::Tensor&, const kernels::MatMulDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoRmsNorm(const kernels::Tensor&, const kernels::Tensor&, float, kernels::Tensor&,
                         const kernels::RowDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoSiluAndMul(const kernels::Tensor&, kernels::Tensor&, const kernels::RowDims&) override {
    return absl::InternalError("unused");
  }
  absl::Status DoSoftmax(const kernels::Tensor&, float, kernels::Tensor&, const kernels::RowDims&) override {
    return absl::InternalError("unused");
  }
};

TEST_F(LowRankReleaseTest, ABackendWithoutTheFeatureRefusesACorrectedLayerAtLoad) {
  std::unique_ptr<ReleaseExpertDecoder> decoder = Open("lowrank");
  ASSERT_NE(decoder, nullptr);
  NoLowRankBackend backend;
  EXPECT_THAT(LoadPackedExperts(*decoder, 1, backend),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       AllOf(HasSubstr("low-rank corrections"), HasSubstr("nolowrank"), HasSubstr("--lowrank_rank"))));
  std::unique_ptr<ReleaseExpertDecoder> plain = Open("plain");
  ASSERT_NE(plain, nullptr);
  EXPECT_THAT(LoadPackedExperts(*plain, 1, backend), IsOk()) << "a release without corrections loads as before";
}

}  // namespace
}  // namespace nq::release
