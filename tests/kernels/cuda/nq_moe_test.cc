// CUDA NqMoe vs the CPU backend's (itself checked against a dense reference in cpu_ops_test):
// 1, 4 and 512 tokens, every expert at 2 bits, at 4 bits, and a random mix; tokens that share
// experts; a chunk boundary. Tolerance: 2e-3 of the largest output (issue #12), which covers the
// fp16 weights and inputs of the GEMV.
#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/nq_moe_fixture.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;

constexpr double kTolerance = 2e-3;

TEST(CudaNqMoe, MatchesCpuAtTwoFourAndMixedBits) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4301);
  ErrorSummary summary("NqMoe", kTolerance);
  struct Shape3 {
    std::int64_t hidden, intermediate, experts, top_k;
  };
  // Under compute-sanitizer (NQ_SANITIZE_SMALL=1) the small shapes only: the tools slow kernels
  // down a hundredfold. glm5_nano's shape (D 256, I 64, 32 experts, top-4 + shared) is one case.
  const bool small = std::getenv("NQ_SANITIZE_SMALL") != nullptr;
  // The GEMV's three block shapes (rows of 1, 4 to 15, and 16 or more 256-input steps), rows
  // ending mid-step (320, 48), rows of 16-byte pieces or not (cols % 64: 48, 16), and both
  // projections at GLM-5-like whole steps (2048 x 1536: the register-slot GEMV over many tiles).
  // 64 x 32 with 4 experts: 256 tokens take the dense (cuBLAS) prefill, small enough for the
  // sanitizer runs.
  for (const Shape3 s : {Shape3{256, 64, 33, 5}, Shape3{64, 16, 8, 2}, Shape3{256, 128, 16, 4}, Shape3{1024, 256, 32, 8},
                         Shape3{320, 48, 12, 3}, Shape3{4096, 512, 16, 4}, Shape3{64, 32, 4, 2},
                         Shape3{2048, 1536, 8, 4}}) {
    if (small && s.hidden > 320) continue;
    const testing::NqMoeHost host = testing::RandomNqMoe(rng, s.hidden, s.intermediate, s.experts);
    for (const std::int64_t tokens : {1, 4, 7, 256, 512}) {
      if (tokens == 512 && (s.hidden > 320 || small)) continue;  // the CPU oracle's time, not the kernel's limit
      if (tokens == 256 && s.hidden > 64) continue;
      const std::vector<float> x = RandomNormal(rng, tokens * s.hidden, 1.0f);
      // Each token draws from the first 2K experts only, so tokens of a chunk share experts.
      const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, tokens, s.top_k, s.experts, 2 * s.top_k);
      for (int mode = 0; mode < 3; ++mode) {
        const std::vector<std::int32_t> slots = testing::NqMoeSlots(rng, s.experts, mode);
        const std::vector<float> want = testing::RunNqMoe(*Backends().cpu, host, slots, x, routing, s.top_k);
        const std::vector<float> got = testing::RunNqMoe(*Backends().cuda, host, slots, x, routing, s.top_k);
        const double error = NormalizedError(got, want);
        SCOPED_TRACE(absl::StrCat("D ", s.hidden, " I ", s.intermediate, " E ", s.experts, " K ", s.top_k, " T ",
                                  tokens, " mode ", mode));
        summary.Add(error);
      }
    }
  }
}

// Rotation blocks wider than nq encode writes: a 2048-wide output block for the combine and
// 256-wide pieces for the SwiGLU preparation of the down inputs.
TEST(CudaNqMoe, WideRotationBlocksMatchCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4303);
  ErrorSummary summary("NqMoe with wide rotation blocks", kTolerance);
  const std::int64_t hidden = 4096, intermediate = 512, experts = 8, top_k = 2;
  testing::NqMoeHost host = testing::RandomNqMoe(rng, hidden, intermediate, experts);
  host.down_row_block = 2048;
  host.gate_row_block = 256;
  host.down_col_block = 256;
  for (const std::int64_t tokens : {1, 3}) {
    const std::vector<float> x = RandomNormal(rng, tokens * hidden, 1.0f);
    const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, tokens, top_k, experts, 2 * top_k);
    for (int mode = 0; mode < 3; ++mode) {
      const std::vector<std::int32_t> slots = testing::NqMoeSlots(rng, experts, mode);
      const std::vector<float> want = testing::RunNqMoe(*Backends().cpu, host, slots, x, routing, top_k);
      const std::vector<float> got = testing::RunNqMoe(*Backends().cuda, host, slots, x, routing, top_k);
      SCOPED_TRACE(absl::StrCat("T ", tokens, " mode ", mode));
      summary.Add(NormalizedError(got, want));
    }
  }
}

// Slots scattered over memory (NqSlots::slot_records: a layer-major prefill's slots in room the
// free KV cache lends, issue #23) through every CUDA path: both decode GEMVs (whole 256-input
// steps and not), the grouped and the dense prefill, both codecs.
TEST(CudaNqMoe, ScatteredSlotsMatchCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(4304);
  ErrorSummary summary("NqMoe with scattered slots", kTolerance);
  struct Case {
    NqCodec codec;
    std::int64_t hidden, intermediate, experts, top_k, tokens;
  };
  for (const Case c : {Case{NqCodec::kNestedScalar, 2048, 1536, 8, 4, 1}, Case{NqCodec::kNestedScalar, 1024, 256, 16, 4, 4},
                       Case{NqCodec::kNestedScalar, 320, 48, 12, 3, 3}, Case{NqCodec::kNestedScalar, 256, 64, 16, 4, 64},
                       Case{NqCodec::kNestedScalar, 64, 32, 4, 2, 256}, Case{NqCodec::kTrellis, 256, 128, 16, 4, 2},
                       Case{NqCodec::kTrellis, 256, 128, 16, 4, 64}}) {
    const testing::NqMoeHost host = c.codec == NqCodec::kTrellis
                                        ? testing::RandomTrellisNqMoe(rng, c.hidden, c.intermediate, c.experts)
                                        : testing::RandomNqMoe(rng, c.hidden, c.intermediate, c.experts);
    const std::vector<float> x = RandomNormal(rng, c.tokens * c.hidden, 1.0f);
    const testing::NqMoeRouting routing = testing::RandomNqMoeRouting(rng, c.tokens, c.top_k, c.experts, 2 * c.top_k);
    for (int mode = 1; mode < 3; ++mode) {
      const std::vector<std::int32_t> slots = testing::NqMoeSlots(rng, c.experts, mode);
      const std::vector<float> want = testing::RunNqMoe(*Backends().cpu, host, slots, x, routing, c.top_k);
      const std::vector<float> got =
          testing::RunNqMoe(*Backends().cuda, host, slots, x, routing, c.top_k, /*scattered_slots=*/true);
      SCOPED_TRACE(absl::StrCat("codec ", static_cast<int>(c.codec), " D ", c.hidden, " T ", c.tokens, " mode ", mode));
      summary.Add(NormalizedError(got, want));
    }
  }
}

}  // namespace
}  // namespace nq::kernels
