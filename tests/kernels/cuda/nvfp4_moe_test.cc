// CUDA Nvfp4Moe vs the CPU backend's (itself checked against a double dense reference in
// cpu_ops_test): 1 to 9 tokens (a chunk is 8) and a longer input, tokens that share experts,
// typical and full-range (signed, subnormal, zero, 448) block scales, the hand-computed layer,
// NaN block scales, out-of-range ids, and the shapes the kernels refuse. Tolerance: 2e-3 of the
// largest output, which covers the fp16 inputs of the GEMV (2^-11 relative each).
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/cuda/nq_moe_prefill.cuh"
#include "kernels/cuda/nvfp4_moe_prefill_dense.cuh"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/nvfp4_moe_fixture.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::Nvfp4ScaleDraw;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;
using ::testing::HasSubstr;

constexpr double kTolerance = 2e-3;

TEST(CudaNvfp4Moe, MatchesCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(5301);
  ErrorSummary summary("Nvfp4Moe", kTolerance);
  // Under compute-sanitizer (NQ_SANITIZE_SMALL=1) the small shapes only.
  const bool small = std::getenv("NQ_SANITIZE_SMALL") != nullptr;
  struct Shape4 {
    std::int64_t hidden, intermediate, experts, top_k;
  };
  // glm5_nano (D 256, I 64, 32 experts, top-4) and its TP-2 slice (I 32); rows ending mid-step
  // (cols 96, 160, 224 of 128-column steps: the last step's fourth lane chunk, or more, empty);
  // a 1024 x 256 layer of top-8; top-16 (128 assignments a chunk, the plan's limit); for the TMA
  // kernel (nvfp4_gemv_tma.cuh: widths a multiple of 256, 4-step stages at multiples of 512 for
  // chunks of at most 16 distinct experts and 32 assignments), 512 x 512 (at most 8 distinct
  // experts: 4-step stages up to 4 tokens, 2-step beyond) and 512 x 256 of top-12 (2 tokens have
  // up to 24 distinct experts: the adaptive kernel's 2-step stages at width 512).
  for (const Shape4 s : {Shape4{256, 64, 32, 4}, Shape4{256, 32, 32, 4}, Shape4{96, 160, 12, 3},
                         Shape4{224, 96, 8, 2}, Shape4{1024, 256, 32, 8}, Shape4{128, 64, 40, 16},
                         Shape4{512, 512, 16, 4}, Shape4{512, 256, 40, 12}}) {
    if (small && s.hidden > 256) continue;
    for (const Nvfp4ScaleDraw draw : {Nvfp4ScaleDraw::kTypical, Nvfp4ScaleDraw::kFullRange}) {
      const testing::Nvfp4MoeHost host = testing::RandomNvfp4Moe(rng, s.hidden, s.intermediate, s.experts, draw);
      for (const std::int64_t tokens : {1, 2, 4, 8, 9, 19}) {
        if (small && tokens > 9) continue;
        const std::vector<float> x = RandomNormal(rng, tokens * s.hidden, 1.0f);
        // Each token draws from the first 2K experts (at most E), so tokens of a chunk share experts.
        const testing::Nvfp4Routing routing =
            testing::RandomNvfp4Routing(rng, tokens, s.top_k, std::min(s.experts, 2 * s.top_k));
        const std::vector<float> want = testing::RunNvfp4Moe(*Backends().cpu, host, x, routing.ids, routing.weights, s.top_k);
        const std::vector<float> got = testing::RunNvfp4Moe(*Backends().cuda, host, x, routing.ids, routing.weights, s.top_k);
        SCOPED_TRACE(absl::StrCat("D ", s.hidden, " I ", s.intermediate, " E ", s.experts, " K ", s.top_k, " T ", tokens,
                                  draw == Nvfp4ScaleDraw::kTypical ? " typical" : " full-range"));
        summary.Add(NormalizedError(got, want));
      }
    }
  }
}

// Prompts with enough rows per expert take the dense prefill (each expert dequantised once to fp16,
// its tokens through cuBLAS: nvfp4_moe_prefill_dense.cuh) and match the CPU as the decode chunks
// do: typical and full-range scales, an expert without tokens, ids outside [0, E), and more
// tokens than one dense chunk.
TEST(CudaNvfp4Moe, LongPromptsTakeTheDensePrefillAndMatchCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng(5305);
  ErrorSummary summary("Nvfp4Moe dense prefill", kTolerance);
  struct Case {
    std::int64_t hidden, intermediate, experts, top_k, tokens;
  };
  for (const Case c : {Case{256, 64, 8, 2, 72}, Case{256, 96, 12, 3, 300}, Case{512, 256, 16, 4, 128},
                       Case{64, 32, 4, 2, 4100}}) {
    if (std::getenv("NQ_SANITIZE_SMALL") != nullptr && c.tokens > 300) continue;
    Nvfp4MoeParams shape;
    shape.tokens = c.tokens;
    shape.top_k = c.top_k;
    shape.hidden = c.hidden;
    shape.intermediate = c.intermediate;
    shape.num_experts = c.experts;
    ASSERT_TRUE(cuda::Nvfp4MoeDensePrefillPays(shape)) << c.tokens << " tokens";
    for (const Nvfp4ScaleDraw draw : {Nvfp4ScaleDraw::kTypical, Nvfp4ScaleDraw::kFullRange}) {
      const testing::Nvfp4MoeHost host = testing::RandomNvfp4Moe(rng, c.hidden, c.intermediate, c.experts, draw);
      const std::vector<float> x = RandomNormal(rng, c.tokens * c.hidden, 1.0f);
      // The first experts only: the last one has no tokens.
      const testing::Nvfp4Routing routing = testing::RandomNvfp4Routing(rng, c.tokens, c.top_k, c.experts - 1);
      std::vector<std::int32_t> ids = routing.ids, ref_ids = routing.ids;
      std::vector<float> ref_weights = routing.weights;
      // Two ids out of range; the CPU's reference routes them to the expert without tokens
      // (distinct from the token's others) with weight 0.
      for (const std::size_t a : {std::size_t{5}, ids.size() - 1}) {
        ids[a] = a == 5 ? -1 : static_cast<std::int32_t>(c.experts);
        ref_ids[a] = static_cast<std::int32_t>(c.experts - 1);
        ref_weights[a] = 0.0f;
      }
      const std::vector<float> want = testing::RunNvfp4Moe(*Backends().cpu, host, x, ref_ids, ref_weights, c.top_k);
      const std::vector<float> got = testing::RunNvfp4Moe(*Backends().cuda, host, x, ids, routing.weights, c.top_k);
      SCOPED_TRACE(absl::StrCat("D ", c.hidden, " I ", c.intermediate, " E ", c.experts, " K ", c.top_k, " T ",
                                c.tokens, draw == Nvfp4ScaleDraw::kTypical ? " typical" : " full-range"));
      summary.Add(NormalizedError(got, want));
    }
  }
}

// The dense prefill's contract, checked on the host before anything is launched (no GPU needed):
// which calls it takes, and a clear refusal for a chunk too long, widths not whole blocks, too many
// experts for the grouping kernel, a workspace too small and missing resources.
TEST(CudaNvfp4MoeDensePrefill, TakesLongPromptsAndRefusesWhatItCannotRun) {
  Nvfp4MoeParams p;
  p.top_k = 8;
  p.hidden = 256;
  p.intermediate = 128;
  p.num_experts = 32;
  p.tokens = 8;  // a decode chunk: never dense
  EXPECT_FALSE(cuda::Nvfp4MoeDensePrefillPays(p));
  p.tokens = 63;  // 504 rows for 32 experts: under 16 an expert
  EXPECT_FALSE(cuda::Nvfp4MoeDensePrefillPays(p));
  p.tokens = 64;
  EXPECT_TRUE(cuda::Nvfp4MoeDensePrefillPays(p));

  const std::size_t need = cuda::Nvfp4MoeDensePrefillWorkspaceBytes(p.tokens, p.top_k, p.hidden, p.intermediate,
                                                                    p.num_experts);
  int host_counts[64] = {};
  const cuda::DensePrefillResources none;
  cuda::DensePrefillResources no_events;
  no_events.host_counts = host_counts;
  no_events.host_capacity = 64;
  const cuda::LaunchContext ctx{};
  const auto refused = [&](const Nvfp4MoeParams& q, std::size_t bytes, const cuda::DensePrefillResources& r) {
    return cuda::LaunchNvfp4MoeDensePrefill(q, nullptr, bytes, r, ctx);
  };
  Nvfp4MoeParams longer = p;
  longer.tokens = cuda::kNvfp4DensePrefillChunk + 1;
  EXPECT_THAT(refused(longer, need, no_events), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceed the chunk")));
  Nvfp4MoeParams ragged = p;
  ragged.hidden = 248;
  EXPECT_THAT(refused(ragged, need, no_events),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("multiples of 16")));
  Nvfp4MoeParams crowded = p;
  crowded.num_experts = cuda::kNqMaxGroupExperts + 1;
  EXPECT_THAT(refused(crowded, need, no_events), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most")));
  EXPECT_THAT(refused(p, need - 1, no_events), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("workspace of")));
  EXPECT_THAT(refused(p, need, none), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("host buffer")));
  EXPECT_THAT(refused(p, need, no_events),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a cuBLAS handle, a side stream and five events")));
}

TEST(CudaNvfp4Moe, HandComputedBlocks) {
  if (Backends().cuda == nullptr) return;
  for (const std::int64_t dim : {32, 256}) {
    const testing::Nvfp4MoeHost host = testing::HandComputedNvfp4Moe(dim);
    const std::vector<float> x(dim, 1.0f);
    const std::vector<float> got = testing::RunNvfp4Moe(*Backends().cuda, host, x, {0}, {0.25f}, 1);
    ASSERT_EQ(got.size(), static_cast<std::size_t>(dim));
    // Every weight and input is exact in fp16; only the fp32 sums and silu round.
    const double want = testing::HandComputedNvfp4Output(dim, 0.25);
    for (const float v : got) EXPECT_NEAR(v, want, 1e-5 * std::abs(want)) << "dim " << dim;
  }
}

// NaN block scales in a gate/up row and a down row: the CUDA outputs are NaN exactly where the
// CPU's are, and agree elsewhere.
TEST(CudaNvfp4Moe, NanBlockScalesPoisonWhatTheCpuPoisons) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(5302);
  constexpr std::int64_t kD = 256, kI = 64, kE = 8, kK = 2, kT = 3;
  testing::Nvfp4MoeHost host = testing::RandomNvfp4Moe(rng, kD, kI, kE, Nvfp4ScaleDraw::kTypical);
  host.down.scales[(3 * kD + 17) * (kI / 16) + 2] = 0x7F;           // expert 3, down row 17
  host.gate_up.scales[(5 * 2 * kI + kI + 9) * (kD / 16) + 7] = 0xFF;  // expert 5, up row 9
  const std::vector<float> x = RandomNormal(rng, kT * kD, 1.0f);
  const std::vector<std::int32_t> ids = {3, 0, 1, 2, 5, 3};
  const std::vector<float> weights = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  const std::vector<float> want = testing::RunNvfp4Moe(*Backends().cpu, host, x, ids, weights, kK);
  const std::vector<float> got = testing::RunNvfp4Moe(*Backends().cuda, host, x, ids, weights, kK);
  ASSERT_EQ(got.size(), want.size());
  std::vector<float> got_finite, want_finite;
  int nans = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::isnan(got[i]), std::isnan(want[i])) << "output " << i;
    if (std::isnan(want[i])) {
      ++nans;
    } else {
      got_finite.push_back(got[i]);
      want_finite.push_back(want[i]);
    }
  }
  // Token 0: row 17; token 2: all of it (up row 9's NaN reaches every down input), and row 17.
  EXPECT_EQ(nans, 1 + kD);
  EXPECT_LT(NormalizedError(got_finite, want_finite), kTolerance);
}

// The CUDA kernels never read ids back to the host: an id outside [0, E) contributes nothing
// (the CPU backend refuses it; its reference here routes that slot to expert 0 with weight 0).
TEST(CudaNvfp4Moe, SkipsExpertIdsOutOfRange) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(5303);
  constexpr std::int64_t kD = 256, kI = 64, kE = 8, kK = 3;
  const testing::Nvfp4MoeHost host = testing::RandomNvfp4Moe(rng, kD, kI, kE, Nvfp4ScaleDraw::kTypical);
  const std::vector<float> x = RandomNormal(rng, 2 * kD, 1.0f);
  const std::vector<float> want = testing::RunNvfp4Moe(*Backends().cpu, host, x, {1, 0, 2, 3, 4, 0},
                                                       {0.5f, 0.0f, 0.25f, 0.5f, 0.75f, 0.0f}, kK);
  const std::vector<float> got = testing::RunNvfp4Moe(*Backends().cuda, host, x, {1, -1, 2, 3, 4, 8},
                                                      {0.5f, 0.3f, 0.25f, 0.5f, 0.75f, 0.3f}, kK);
  EXPECT_LT(NormalizedError(got, want), kTolerance);
}

TEST(CudaNvfp4Moe, RefusesWidthsNotAWholeLaneChunk) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(5304);
  // 48 is a whole number of NVFP4 blocks (the op's rule) but not of a lane's 32 columns.
  const testing::Nvfp4MoeHost host = testing::RandomNvfp4Moe(rng, 48, 32, 2, Nvfp4ScaleDraw::kTypical);
  const Nvfp4MoeWeights w = testing::UploadNvfp4Moe(cuda, host);
  const Tensor x = Upload(cuda, std::vector<float>(48, 1.0f), DType::kF32, Shape{1, 48});
  const Tensor ids = UploadI32(cuda, std::vector<std::int32_t>{0}, Shape{1, 1});
  const Tensor weights = Upload(cuda, std::vector<float>{1.0f}, DType::kF32, Shape{1, 1});
  Tensor out = AllocateOrFail(cuda, DType::kF32, Shape{1, 48});
  EXPECT_THAT(cuda.Nvfp4Moe(x, ids, weights, w, out),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be multiples of 32")));
}

}  // namespace
}  // namespace nq::kernels
