// The tile search interface (services/quant/trellis_search.h) on the CPU: threads give the one
// thread's symbols, bad sizes are refused, and TrellisCodec hands over what it can search
// together (the whole matrix without LDLQ, one 16-column block with it) and writes the same
// bytes whichever search it is given.
#include "services/quant/trellis_search.h"

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "services/quant/codec.h"
#include "services/quant/ldlq.h"
#include "services/quant/trellis_codec.h"
#include "services/quant/trellis_decode.h"

namespace nq::quant {
namespace {

using ::testing::ElementsAreArray;
using ::testing::HasSubstr;
using trellis::kTileWeights;

std::vector<float> Gaussian(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

// A calibration Hessian from activations whose features are AR(1)-correlated (rho about 0.9).
absl::StatusOr<Hessian> Ar1Hessian(int64_t samples, int64_t cols, uint32_t seed) {
  std::vector<float> x = Gaussian(samples * cols, seed);
  for (int64_t s = 0; s < samples; ++s) {
    for (int64_t c = 1; c < cols; ++c) x[s * cols + c] = 0.9f * x[s * cols + c - 1] + 0.44f * x[s * cols + c];
  }
  return HessianFromActivations(x, samples, cols);
}

TEST(CpuTrellisTileSearch, ThreadsGiveTheOneThreadsSymbols) {
  const std::vector<float> x = Gaussian(7 * kTileWeights, 1);
  std::vector<uint8_t> one(x.size()), three(x.size());
  ASSERT_TRUE(MakeCpuTrellisTileSearch(1)->Search(x, one).ok());
  std::unique_ptr<TrellisTileSearch> search = MakeCpuTrellisTileSearch(3);
  EXPECT_EQ(search->where(), "cpu, 3 threads");
  ASSERT_TRUE(search->Search(x, three).ok());
  EXPECT_EQ(three, one);
  for (uint8_t s : one) ASSERT_LE(s, 3);
}

// A search that is the CPU's except on one tile kind: its symbols of tiles whose first target is
// `odd_first` come out shifted by one. The agreement check must name such a search.
class SearchWrongOn final : public TrellisTileSearch {
 public:
  explicit SearchWrongOn(float odd_first) : odd_first_(odd_first) {}
  std::string where() const override { return "a search wrong on one tile"; }
  absl::Status Search(std::span<const float> targets, std::span<uint8_t> symbols) override {
    if (absl::Status s = cpu_->Search(targets, symbols); !s.ok()) return s;
    for (size_t t = 0; t < targets.size() / kTileWeights; ++t) {
      if (targets[t * kTileWeights] == odd_first_) symbols[t * kTileWeights + 5] ^= 1;
    }
    return absl::OkStatus();
  }

 private:
  float odd_first_;
  std::unique_ptr<TrellisTileSearch> cpu_ = MakeCpuTrellisTileSearch(2);
};

TEST(CheckAgreesWithCpuSearch, PassesTheCpuSearchAndNamesOneThatDiffers) {
  std::unique_ptr<TrellisTileSearch> cpu = MakeCpuTrellisTileSearch(2);
  EXPECT_TRUE(CheckAgreesWithCpuSearch(*cpu).ok());
  SearchWrongOn wrong_on_zeros(0.0f);  // the check's all-zero tile
  const absl::Status status = CheckAgreesWithCpuSearch(wrong_on_zeros);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(status.message(), HasSubstr("a search wrong on one tile"));
  EXPECT_THAT(status.message(), HasSubstr("--device cpu"));
}

TEST(CpuTrellisTileSearch, RefusesWhatIsNotWholeTiles) {
  std::unique_ptr<TrellisTileSearch> search = MakeCpuTrellisTileSearch(2);
  std::vector<float> x(kTileWeights + 1, 0.25f);
  std::vector<uint8_t> s(x.size());
  absl::Status partial = search->Search(x, s);
  EXPECT_EQ(partial.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(partial.message(), HasSubstr("not whole 256-weight tiles"));
  x.resize(kTileWeights);
  absl::Status short_output = search->Search(x, std::span<uint8_t>(s).first(10));
  EXPECT_EQ(short_output.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_output.message(), HasSubstr("10 symbol bytes for 256 targets"));
  EXPECT_TRUE(search->Search({}, {}).ok());
}

// Counts the tiles of each search it is handed, then searches on the CPU.
class RecordingSearch final : public TrellisTileSearch {
 public:
  std::string where() const override { return "recording"; }
  absl::Status Search(std::span<const float> targets, std::span<uint8_t> symbols) override {
    batches.push_back(static_cast<int64_t>(targets.size()) / kTileWeights);
    return cpu_->Search(targets, symbols);
  }
  std::vector<int64_t> batches;

 private:
  std::unique_ptr<TrellisTileSearch> cpu_ = MakeCpuTrellisTileSearch(2);
};

TEST(TrellisCodecSearch, HandsOverTheWholeMatrixWithoutLdlqAndOneBlockWithIt) {
  constexpr int64_t kRows = 32, kCols = 64, kSamples = 256;
  const std::vector<float> w = Gaussian(kRows * kCols, 2);
  absl::StatusOr<Hessian> hessian = Ar1Hessian(kSamples, kCols, 3);
  ASSERT_TRUE(hessian.ok()) << hessian.status();
  const TrellisCodec codec;
  for (const Hessian* h : {static_cast<const Hessian*>(nullptr), static_cast<const Hessian*>(&*hessian)}) {
    SCOPED_TRACE(h == nullptr ? "identity" : "LDLQ");
    RecordingSearch recording;
    EncodeOptions options;
    options.rotation = {.row_block = kRows, .col_block = kCols};
    const EncodeOptions plain_options = options;
    options.trellis_search = &recording;
    absl::StatusOr<EncodedMatrix> handed = codec.Encode(w, kRows, kCols, h, options);
    absl::StatusOr<EncodedMatrix> plain = codec.Encode(w, kRows, kCols, h, plain_options);
    ASSERT_TRUE(handed.ok()) << handed.status();
    ASSERT_TRUE(plain.ok()) << plain.status();
    // Base then residual: 2 searches of all 8 tiles, or 2 per block of 2 tiles (4 blocks).
    const std::vector<int64_t> want = h == nullptr ? std::vector<int64_t>{8, 8} : std::vector<int64_t>(8, 2);
    EXPECT_THAT(recording.batches, ElementsAreArray(want));
    EXPECT_EQ(handed->base_codes, plain->base_codes);
    EXPECT_EQ(handed->residual_codes, plain->residual_codes);
    EXPECT_EQ(handed->params.base_codebook, plain->params.base_codebook);
    EXPECT_EQ(handed->params.residual_codebook, plain->params.residual_codebook);
  }
}

// LDLQ's feedback split over threads by rows: the same bytes as one thread.
TEST(TrellisCodecSearch, FeedbackThreadsGiveTheOneThreadsBytes) {
  constexpr int64_t kRows = 64, kCols = 256, kSamples = 512;
  const std::vector<float> w = Gaussian(kRows * kCols, 5);
  absl::StatusOr<Hessian> hessian = Ar1Hessian(kSamples, kCols, 6);
  ASSERT_TRUE(hessian.ok()) << hessian.status();
  std::unique_ptr<TrellisTileSearch> search = MakeCpuTrellisTileSearch(2);
  EncodeOptions options;
  options.rotation = {.row_block = kRows, .col_block = kCols};
  options.trellis_search = search.get();
  absl::StatusOr<EncodedMatrix> one = TrellisCodec().Encode(w, kRows, kCols, &*hessian, options);
  options.host_threads = 3;
  absl::StatusOr<EncodedMatrix> three = TrellisCodec().Encode(w, kRows, kCols, &*hessian, options);
  ASSERT_TRUE(one.ok()) << one.status();
  ASSERT_TRUE(three.ok()) << three.status();
  EXPECT_EQ(three->base_codes, one->base_codes);
  EXPECT_EQ(three->residual_codes, one->residual_codes);
  EXPECT_EQ(three->params.base_codebook, one->params.base_codebook);
  EXPECT_EQ(three->params.residual_codebook, one->params.residual_codebook);
}

// A search that fails: the encode fails with its status, not with made-up codes.
class FailingSearch final : public TrellisTileSearch {
 public:
  std::string where() const override { return "failing"; }
  absl::Status Search(std::span<const float>, std::span<uint8_t>) override {
    return absl::UnavailableError("the GPU fell off the bus");
  }
};

TEST(TrellisCodecSearch, ASearchThatFailsFailsTheEncode) {
  FailingSearch failing;
  EncodeOptions options;
  options.rotation = {.row_block = 32, .col_block = 32};
  options.trellis_search = &failing;
  absl::StatusOr<EncodedMatrix> m = TrellisCodec().Encode(Gaussian(32 * 32, 4), 32, 32, nullptr, options);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(m.status().message(), HasSubstr("fell off the bus"));
}

}  // namespace
}  // namespace nq::quant
