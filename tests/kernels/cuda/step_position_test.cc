// CUDA ops at a position read from device memory (kernels/step_position.h) against the CPU at the
// same host position: MLA decode attention (dense and DSA), the indexer's decode selection, RoPE,
// KV writes into F32 and BF16 caches, and the device-ids embedding. The bound is well past the
// position, as in a step graph at the start of its bucket, so the launches are sized for keys the
// queries must not see. Then a captured graph replayed at two positions, and the ops a capture
// refuses.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/model_ref.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::MlaInputs;
using ::nq::kernels::testing::MlaShape;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomMlaInputs;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::RunIndexerTopK;
using ::nq::kernels::testing::RunMlaAttention;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;
using ::testing::HasSubstr;

Tensor Position(Backend& backend, std::int32_t value) {
  return UploadI32(backend, std::span<const std::int32_t>(&value, 1), {1});
}

TEST(CudaStepPosition, MlaDecodeAtADevicePositionMatchesTheCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(8201);
  ErrorSummary summary("MlaAttention at a device position", 2e-3);
  for (std::int64_t tokens : {1, 4}) {
    for (std::int64_t start : {3, 700, 2040}) {
      for (bool dsa : {false, true}) {
        const MlaShape shape{.tokens = tokens, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128,
                             .keys = 2048, .start_pos = start};
        SCOPED_TRACE(::testing::Message() << "T=" << tokens << " start=" << start << " dsa=" << dsa);
        const MlaInputs in = RandomMlaInputs(rng, shape, DType::kBF16, DType::kBF16);
        // Per query, 240 distinct keys spread over the whole cache (those past its position must
        // not count), then 16 empty entries.
        std::vector<std::int32_t> selected;
        const std::int64_t top_k = 256;
        std::vector<std::int32_t> all_keys(static_cast<std::size_t>(shape.keys));
        std::iota(all_keys.begin(), all_keys.end(), 0);
        for (std::int64_t t = 0; t < tokens; ++t) {
          std::shuffle(all_keys.begin(), all_keys.end(), rng);
          selected.insert(selected.end(), all_keys.begin(), all_keys.begin() + 240);
          selected.insert(selected.end(), 16, -1);
        }
        const std::span<const std::int32_t> sel = dsa ? std::span<const std::int32_t>(selected) : std::span<const std::int32_t>();
        const std::vector<float> want =
            RunMlaAttention(*Backends().cpu, shape, in, DType::kBF16, DType::kBF16, sel, top_k, 0.07f, DType::kBF16);
        const std::vector<float> got = RunMlaAttention(*Backends().cuda, shape, in, DType::kBF16, DType::kBF16, sel,
                                                       top_k, 0.07f, DType::kBF16, shape.keys - tokens);
        ASSERT_EQ(got.size(), want.size());
        summary.Add(NormalizedError(got, want));
      }
    }
  }
}

TEST(CudaStepPosition, IndexerDecodeAtADevicePositionSelectsLikeTheCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(8202);
  // Small integers: every score is exact, so the selections must be identical.
  auto ints = [&](std::size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = static_cast<float>(RandomInt(rng, -1, 1));
    return v;
  };
  const std::int64_t heads = 64, dim = 128, keys = 16384;
  for (std::int64_t tokens : {1, 4}) {
    for (std::int64_t start : {std::int64_t{10}, std::int64_t{3000}, keys - tokens}) {
      for (std::int64_t top_k : {2048, 7}) {
        SCOPED_TRACE(::testing::Message() << "T=" << tokens << " start=" << start << " top_k=" << top_k);
        const std::vector<float> q = ints(tokens * heads * dim), k = ints(keys * dim);
        std::vector<float> w(tokens * heads);
        for (float& x : w) x = static_cast<float>(RandomInt(rng, 1, 2));
        const std::vector<std::int32_t> want =
            RunIndexerTopK(*Backends().cpu, q, k, w, tokens, heads, dim, keys, start, top_k);
        const std::vector<std::int32_t> got =
            RunIndexerTopK(*Backends().cuda, q, k, w, tokens, heads, dim, keys, start, top_k, keys - tokens);
        EXPECT_TRUE(got == want);
      }
    }
  }
}

// RoPE, the KV writes and the embedding of one step, enqueued with device inputs.
struct StepOps {
  Tensor x, cache_f32, cache_bf16, src, table, ids, embedded, position;
};

StepOps MakeStepOps(Backend& backend, std::mt19937_64& rng) {
  StepOps s;
  s.x = Upload(backend, RandomNormal(rng, 2 * 3 * 16, 1.0f), DType::kF32, {2, 3, 16});
  const std::vector<float> zeros(64 * 8, 0.0f);
  s.cache_f32 = Upload(backend, zeros, DType::kF32, {64, 8});
  s.cache_bf16 = Upload(backend, zeros, DType::kBF16, {64, 8});
  s.src = Upload(backend, RandomNormal(rng, 2 * 8, 1.0f), DType::kF32, {2, 8});
  s.table = Upload(backend, RandomNormal(rng, 50 * 8, 1.0f), DType::kBF16, {50, 8});
  s.ids = UploadI32(backend, std::vector<std::int32_t>{49, 3}, {2});
  s.embedded = AllocateOrFail(backend, DType::kF32, {2, 8});
  s.position = Position(backend, 0);
  return s;
}

const std::vector<float> kInvFreq = {1.0f, 0.3f, 0.05f, 0.01f, 0.002f};

absl::Status EnqueueStepOps(Backend& backend, StepOps& s, std::int64_t bound) {
  const StepPosition start = StepPosition::OnDevice(s.position, bound);
  if (absl::Status st = backend.Rope(s.x, start, kInvFreq, 1.25f, false); !st.ok()) return st;
  if (absl::Status st = backend.WriteRows(s.src, s.cache_f32, start); !st.ok()) return st;
  if (absl::Status st = backend.WriteRows(s.src, s.cache_bf16, start); !st.ok()) return st;
  return backend.Embedding(s.ids, s.table, s.embedded);
}

void ExpectSameStep(Backend& cpu, StepOps& want, Backend& cuda, StepOps& got) {
  EXPECT_LT(NormalizedError(Download(cuda, got.x), Download(cpu, want.x)), 1e-5) << "rope";
  EXPECT_EQ(Download(cuda, got.cache_f32), Download(cpu, want.cache_f32));
  EXPECT_EQ(Download(cuda, got.cache_bf16), Download(cpu, want.cache_bf16));
  EXPECT_EQ(Download(cuda, got.embedded), Download(cpu, want.embedded));
}

TEST(CudaStepPosition, RopeWritesAndEmbeddingAtADevicePositionMatchTheCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng_cpu = MakeRng(8203), rng_cuda = MakeRng(8203);
  StepOps want = MakeStepOps(*Backends().cpu, rng_cpu);
  StepOps got = MakeStepOps(*Backends().cuda, rng_cuda);
  for (std::int32_t position : {5, 61}) {
    want.position = Position(*Backends().cpu, position);
    got.position = Position(*Backends().cuda, position);
    ASSERT_TRUE(EnqueueStepOps(*Backends().cpu, want, 62).ok());
    ASSERT_TRUE(EnqueueStepOps(*Backends().cuda, got, 62).ok());
    ExpectSameStep(*Backends().cpu, want, *Backends().cuda, got);
  }
}

// Captured once with the position at 0, run at 7 and at 40: each run reads the position and the
// ids as they are then, so the results equal the CPU's op-by-op runs at those positions.
TEST(CudaStepPosition, ACapturedGraphReplaysAtTheDevicePositionOfEachRun) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  Backend& cpu = *Backends().cpu;
  ASSERT_TRUE(cuda.CanCapture());
  std::mt19937_64 rng_cpu = MakeRng(8204), rng_cuda = MakeRng(8204);
  StepOps want = MakeStepOps(cpu, rng_cpu);
  StepOps got = MakeStepOps(cuda, rng_cuda);
  ASSERT_TRUE(cuda.BeginCapture().ok());
  const absl::Status enqueued = EnqueueStepOps(cuda, got, 62);
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = cuda.EndCapture();
  ASSERT_TRUE(enqueued.ok()) << enqueued;
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (std::int32_t position : {7, 40}) {
    const std::vector<std::int32_t> ids = {position % 50, 49 - position % 50};
    ASSERT_TRUE(cuda.CopyFromHost(std::as_bytes(std::span<const std::int32_t>(&position, 1)), got.position).ok());
    ASSERT_TRUE(cuda.CopyFromHost(std::as_bytes(std::span<const std::int32_t>(ids)), got.ids).ok());
    want.position = Position(cpu, position);
    want.ids = UploadI32(cpu, ids, {2});
    ASSERT_TRUE((*graph)->Run().ok());
    ASSERT_TRUE(EnqueueStepOps(cpu, want, 62).ok());
    ExpectSameStep(cpu, want, cuda, got);
  }
}

TEST(CudaStepPosition, ACaptureRefusesHostInputsAndStillEnds) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  // Allocated before the capture: memory allocated inside one belongs to the graph and must be
  // freed inside it (Backend::BeginCapture).
  Tensor t = AllocateOrFail(cuda, DType::kF32, {4});
  Tensor table = AllocateOrFail(cuda, DType::kF32, {4, 4});
  Tensor out = AllocateOrFail(cuda, DType::kF32, {1, 4});
  const std::vector<float> host = {1, 2, 3, 4};
  ASSERT_TRUE(cuda.BeginCapture().ok());
  EXPECT_THAT(cuda.BeginCapture(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already open")));
  EXPECT_THAT(cuda.CopyFromHost(std::as_bytes(std::span<const float>(host)), t),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cannot be captured")));
  const std::vector<std::int32_t> ids = {1};
  EXPECT_THAT(cuda.Embedding(ids, table, out), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("host inputs")));
  EXPECT_THAT(cuda.Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("cannot be captured")));
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = cuda.EndCapture();
  EXPECT_TRUE(graph.ok()) << graph.status();  // the refused ops were never enqueued
  // The stream works as before.
  ASSERT_TRUE(cuda.CopyFromHost(std::as_bytes(std::span<const float>(host)), t).ok());
  EXPECT_EQ(Download(cuda, t), host);
  EXPECT_THAT(cuda.EndCapture().status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no capture")));
}

}  // namespace
}  // namespace nq::kernels
