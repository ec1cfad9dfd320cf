// CPU Rope against hand-rotated values and the HF-style double reference (both pair layouts, yarn
// scaling, decode calls at start_pos > 0), and its argument errors.
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/tensor_io.h"
#include "tests/kernels/model_ref.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RandomUniform;
using ::nq::kernels::testing::RefRope;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

// One fp32 rounding of a double rotation.
constexpr double kTolerance = 1e-6;

// The rotated x on `backend`.
std::vector<float> Rotate(Backend& backend, const std::vector<float>& x, const Shape& shape,
                          std::int64_t start_pos, const std::vector<float>& inv_freq, float scaling,
                          bool interleaved) {
  Tensor tx = Upload(backend, x, DType::kF32, shape);
  const absl::Status status = backend.Rope(tx, start_pos, inv_freq, scaling, interleaved);
  EXPECT_TRUE(status.ok()) << status;
  return Download(backend, tx);
}

// HF's default inv_freq = 1 / base^(2i / d).
std::vector<float> InvFreq(std::int64_t dim, double base) {
  std::vector<float> inv_freq(dim / 2);
  for (std::int64_t i = 0; i < dim / 2; ++i) {
    inv_freq[i] = static_cast<float>(1.0 / std::pow(base, 2.0 * i / dim));
  }
  return inv_freq;
}

TEST(CpuRope, RotatesHandComputedPairsInBothLayouts) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // Angles 2 * 1 and 2 * 0.25 are exact in fp32; attention_scaling 1.5 scales both cos and sin.
  const std::vector<float> x = {1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<float> inv_freq = {1.0f, 0.25f};
  const double c0 = 1.5 * std::cos(2.0), s0 = 1.5 * std::sin(2.0);
  const double c1 = 1.5 * std::cos(0.5), s1 = 1.5 * std::sin(0.5);
  // Interleaved: (x0, x1) by frequency 0, (x2, x3) by frequency 1.
  const std::vector<double> interleaved = {1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1,
                                           3 * s1 + 4 * c1};
  // rotate_half: (x0, x2) by frequency 0, (x1, x3) by frequency 1.
  const std::vector<double> halves = {1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 3 * c0 + 1 * s0,
                                      4 * c1 + 2 * s1};
  EXPECT_LT(NormalizedError(Rotate(*backend, x, {1, 1, 4}, 2, inv_freq, 1.5f, true), interleaved),
            kTolerance);
  EXPECT_LT(NormalizedError(Rotate(*backend, x, {1, 1, 4}, 2, inv_freq, 1.5f, false), halves),
            kTolerance);
  // Position 0 with scaling 1 is the identity.
  EXPECT_EQ(Rotate(*backend, x, {1, 1, 4}, 0, inv_freq, 1.0f, true), x);
}

TEST(CpuRope, MatchesReferenceOnRandomShapes) {
  std::mt19937_64 rng = MakeRng(2301);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  struct Case {
    std::int64_t tokens, heads, dim, start_pos;
  };
  // 64: DeepSeek's qk_rope_head_dim; 128 heads x 64 crosses the threading threshold.
  std::vector<Case> cases = {{1, 1, 2, 0}, {5, 3, 8, 0}, {7, 16, 64, 100}, {40, 128, 64, 3}};
  for (int i = 0; i < 3; ++i) {
    cases.push_back({RandomInt(rng, 1, 9), RandomInt(rng, 1, 9), 2 * RandomInt(rng, 1, 40),
                     RandomInt(rng, 0, 5000)});
  }
  for (bool interleaved : {true, false}) {
    for (float scaling : {1.0f, 1.3678f}) {
      for (const Case& c : cases) {
        SCOPED_TRACE(absl::StrCat("interleaved=", interleaved, " scaling=", scaling, " T=",
                                  c.tokens, " n=", c.heads, " d=", c.dim, " start=", c.start_pos));
        const Shape shape{c.tokens, c.heads, c.dim};
        const std::vector<float> x = RandomNormal(rng, shape.NumElements(), 1.0f);
        const std::vector<float> inv_freq = InvFreq(c.dim, 10000.0);
        EXPECT_LT(
            NormalizedError(
                Rotate(*backend, x, shape, c.start_pos, inv_freq, scaling, interleaved),
                RefRope(x, c.tokens, c.heads, c.dim, c.start_pos, inv_freq, scaling, interleaved)),
            kTolerance);
      }
    }
  }
}

TEST(CpuRope, DecodeCallsMatchTheRowsOfAPrefillCall) {
  std::mt19937_64 rng = MakeRng(2302);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  constexpr std::int64_t kTokens = 9, kHeads = 3, kDim = 16;
  const std::vector<float> x = RandomNormal(rng, kTokens * kHeads * kDim, 1.0f);
  const std::vector<float> inv_freq = RandomUniform(rng, kDim / 2, 0.001f, 1.0f);
  for (bool interleaved : {true, false}) {
    const std::vector<float> prefill =
        Rotate(*backend, x, {kTokens, kHeads, kDim}, 0, inv_freq, 1.1f, interleaved);
    for (std::int64_t t = 0; t < kTokens; ++t) {
      const std::vector<float> row(x.begin() + t * kHeads * kDim,
                                   x.begin() + (t + 1) * kHeads * kDim);
      const std::vector<float> decode =
          Rotate(*backend, row, {1, kHeads, kDim}, t, inv_freq, 1.1f, interleaved);
      EXPECT_TRUE(std::equal(decode.begin(), decode.end(), prefill.begin() + t * kHeads * kDim))
          << "t=" << t << " interleaved=" << interleaved;
    }
  }
}

TEST(CpuRope, AnglesAreFloat32ProductsAsInHf) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  // At position 50000 the fp32 product inv_freq * position differs from the exact one by up to
  // half an ulp of 5000 (2.4e-4 rad): HF's rounding is what the model references contain.
  const std::vector<float> x = {1.0f, 0.0f, 0.5f, -2.0f};
  const std::vector<float> inv_freq = {0.1f, 0.0123f};
  const std::vector<float> got = Rotate(*backend, x, {1, 1, 4}, 50000, inv_freq, 1.0f, true);
  EXPECT_LT(NormalizedError(got, RefRope(x, 1, 1, 4, 50000, inv_freq, 1.0f, true)), kTolerance);
  EXPECT_GT(NormalizedError(got, RefRope(x, 1, 1, 4, 50000, inv_freq, 1.0f, true,
                                         /*float_angle=*/false)),
            1e-5);
}

// Several tensors in one op: each rotates exactly as it would alone, in its own pair layout and
// width (the MLA query's rope part and the indexer's queries, whose heads are wider than the slice).
TEST(CpuRope, SeveralTargetsRotateAsEachWouldAlone) {
  std::mt19937_64 rng = MakeRng(2303);
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  const std::vector<float> inv_freq = RandomUniform(rng, 8, 0.001f, 1.0f);
  const Shape a_shape{3, 4, 16}, b_shape{3, 2, 24};
  const std::vector<float> a = RandomNormal(rng, a_shape.NumElements(), 1.0f);
  const std::vector<float> b = RandomNormal(rng, b_shape.NumElements(), 1.0f);
  for (bool a_interleaved : {true, false}) {
    Tensor ta = Upload(*backend, a, DType::kF32, a_shape);
    Tensor tb = Upload(*backend, b, DType::kF32, b_shape);
    const std::array<Backend::RopeTarget, 2> targets{{{.x = &ta, .interleaved = a_interleaved},
                                                      {.x = &tb, .interleaved = !a_interleaved}}};
    NQ_ASSERT_OK(backend->Rope(targets, 41, inv_freq, 1.25f));
    EXPECT_EQ(Download(*backend, ta), Rotate(*backend, a, a_shape, 41, inv_freq, 1.25f, a_interleaved));
    EXPECT_EQ(Download(*backend, tb), Rotate(*backend, b, b_shape, 41, inv_freq, 1.25f, !a_interleaved));
  }
}

class CpuRopeErrors : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  Tensor x_ = AllocateOrFail(*backend_, DType::kF32, {2, 3, 8});
  std::vector<float> inv_freq_ = std::vector<float>(4, 0.5f);
};

TEST_F(CpuRopeErrors, RejectsOddHeadDim) {
  Tensor x = AllocateOrFail(*backend_, DType::kF32, {2, 3, 7});
  EXPECT_THAT(backend_->Rope(x, 0, std::vector<float>(3, 0.5f), 1.0f, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: the last dim of x F32[2, 3, 7] must be even")));
}

TEST_F(CpuRopeErrors, RejectsInvFreqOfWrongLengthOrNotFinite) {
  EXPECT_THAT(backend_->Rope(x_, 0, std::vector<float>(8, 0.5f), 1.0f, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: inv_freq has 8 entries; want 1 to 4")));
  EXPECT_THAT(backend_->Rope(x_, 0, std::vector<float>(), 1.0f, true),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Rope: inv_freq has 0 entries")));
  inv_freq_[2] = std::numeric_limits<float>::infinity();
  EXPECT_THAT(backend_->Rope(x_, 0, inv_freq_, 1.0f, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: inv_freq[2] = inf is not finite")));
}

TEST_F(CpuRopeErrors, RejectsBadScalingAndStartPos) {
  EXPECT_THAT(backend_->Rope(x_, 0, inv_freq_, std::numeric_limits<float>::quiet_NaN(), false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: attention_scaling must be finite, got nan")));
  EXPECT_THAT(backend_->Rope(x_, -1, inv_freq_, 1.0f, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: start_pos must be >= 0 and leave room for 2 positions, "
                                 "got -1")));
  EXPECT_THAT(
      backend_->Rope(x_, std::numeric_limits<std::int64_t>::max() - 1, inv_freq_, 1.0f, false),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leave room")));
}

TEST_F(CpuRopeErrors, RejectsTargetListsItCannotRotateInOnePass) {
  EXPECT_THAT(backend_->Rope(std::span<const Backend::RopeTarget>(), 0, inv_freq_, 1.0f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Rope: 0 tensors to rotate; want 1 to 4")));
  std::vector<Tensor> many;
  for (int i = 0; i < Backend::kMaxRopeTargets + 1; ++i) many.push_back(AllocateOrFail(*backend_, DType::kF32, {2, 1, 8}));
  std::vector<Backend::RopeTarget> targets;
  for (Tensor& t : many) targets.push_back({.x = &t});
  EXPECT_THAT(backend_->Rope(targets, 0, inv_freq_, 1.0f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Rope: 5 tensors to rotate")));
  // Different token counts, a null tensor, one tensor twice (one launch would rotate it twice).
  Tensor three_tokens = AllocateOrFail(*backend_, DType::kF32, {3, 1, 8});
  const std::array<Backend::RopeTarget, 2> tokens{{{.x = &x_}, {.x = &three_tokens}}};
  EXPECT_THAT(backend_->Rope(tokens, 0, inv_freq_, 1.0f),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: targets[1].x F32[3, 1, 8] has 3 tokens; targets[0].x has 2")));
  const std::array<Backend::RopeTarget, 2> null{{{.x = &x_}, {.x = nullptr}}};
  EXPECT_THAT(backend_->Rope(null, 0, inv_freq_, 1.0f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Rope: targets[1].x is null")));
  const std::array<Backend::RopeTarget, 2> twice{{{.x = &x_}, {.x = &x_, .interleaved = true}}};
  EXPECT_THAT(backend_->Rope(twice, 0, inv_freq_, 1.0f),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: targets[1].x shares its memory with targets[0].x")));
  // A target's own faults name it.
  Tensor odd = AllocateOrFail(*backend_, DType::kF32, {2, 1, 7});
  const std::array<Backend::RopeTarget, 2> odd_dim{{{.x = &x_}, {.x = &odd}}};
  EXPECT_THAT(backend_->Rope(odd_dim, 0, inv_freq_, 1.0f),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the last dim of targets[1].x")));
}

TEST_F(CpuRopeErrors, RejectsWrongRankAndDType) {
  Tensor flat = AllocateOrFail(*backend_, DType::kF32, {6, 8});
  EXPECT_THAT(backend_->Rope(flat, 0, inv_freq_, 1.0f, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: x must have rank 3, got F32[6, 8]")));
  Tensor half = AllocateOrFail(*backend_, DType::kBF16, {2, 3, 8});
  EXPECT_THAT(backend_->Rope(half, 0, inv_freq_, 1.0f, true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Rope: x must be F32, got BF16[2, 3, 8]")));
}

}  // namespace
}  // namespace nq::kernels

namespace nq::kernels {
namespace {

// The DSA indexer rotates only the leading rope slice of each head: the rest must not move,
// and the slice must rotate exactly as a head of that width would.
TEST(CpuRopePartial, RotatesOnlyTheLeadingSlice) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend("cpu");
  ASSERT_TRUE(backend.ok());
  const std::vector<float> inv_freq = {1.0f, 0.25f};  // rotary slice of 4 in heads of 6
  std::vector<float> values(2 * 3 * 6), slice_values(2 * 3 * 4);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.1f * static_cast<float>(i) - 1.0f;
  for (int t = 0; t < 2; ++t)
    for (int h = 0; h < 3; ++h)
      for (int d = 0; d < 4; ++d) slice_values[(t * 3 + h) * 4 + d] = values[(t * 3 + h) * 6 + d];
  for (bool interleaved : {true, false}) {
    absl::StatusOr<Tensor> x = UploadFloats(**backend, values, DType::kF32, Shape{2, 3, 6});
    absl::StatusOr<Tensor> slice = UploadFloats(**backend, slice_values, DType::kF32, Shape{2, 3, 4});
    ASSERT_TRUE(x.ok() && slice.ok());
    ASSERT_TRUE((*backend)->Rope(*x, 5, inv_freq, 1.0f, interleaved).ok());
    ASSERT_TRUE((*backend)->Rope(*slice, 5, inv_freq, 1.0f, interleaved).ok());
    absl::StatusOr<std::vector<float>> got = DownloadFloats(**backend, *x);
    absl::StatusOr<std::vector<float>> want = DownloadFloats(**backend, *slice);
    ASSERT_TRUE(got.ok() && want.ok());
    for (int t = 0; t < 2; ++t) {
      for (int h = 0; h < 3; ++h) {
        for (int d = 0; d < 6; ++d) {
          const float g = (*got)[(t * 3 + h) * 6 + d];
          const float w = d < 4 ? (*want)[(t * 3 + h) * 4 + d] : values[(t * 3 + h) * 6 + d];
          EXPECT_EQ(g, w) << "t " << t << " h " << h << " d " << d << " interleaved " << interleaved;
        }
      }
    }
  }
}

}  // namespace
}  // namespace nq::kernels
