// Side work on the CUDA backend (Backend::BeginSideWork): ops issued on the side stream give the
// results they give in order, eagerly and inside a captured graph; memory a side op still writes
// is not handed to the main stream before the join, even when its tensor dies on the main stream;
// and what would share state with the main stream is refused on the side.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::Upload;
using ::testing::HasSubstr;

// An MoE layer's shape in small: x feeds a shared expert (gate/up GEMV, SiluAndMul, down GEMV)
// and, independently, a normalised projection; the two sum into out.
struct Layer {
  Tensor x, gate_up, down, proj, norm_weight;
  Tensor out;
};

Layer MakeLayer(Backend& backend, std::mt19937_64& rng, std::int64_t tokens) {
  constexpr std::int64_t kHidden = 2048, kInter = 1536;
  Layer l;
  l.x = Upload(backend, RandomNormal(rng, tokens * kHidden, 1.0f), DType::kF32, {tokens, kHidden});
  l.gate_up = Upload(backend, RandomNormal(rng, 2 * kInter * kHidden, 0.02f), DType::kBF16, {2 * kInter, kHidden});
  l.down = Upload(backend, RandomNormal(rng, kHidden * kInter, 0.02f), DType::kBF16, {kHidden, kInter});
  l.proj = Upload(backend, RandomNormal(rng, kHidden * kHidden, 0.02f), DType::kBF16, {kHidden, kHidden});
  l.norm_weight = Upload(backend, RandomNormal(rng, kHidden, 1.0f), DType::kF32, {kHidden});
  l.out = AllocateOrFail(backend, DType::kF32, {tokens, kHidden});
  return l;
}

// The shared expert on the side (when `side`), the projection on the main stream, then the sum.
absl::Status RunLayer(Backend& backend, Layer& l, bool side) {
  const std::int64_t tokens = l.x.shape().dim(0);
  const std::int64_t inter = l.down.shape().dim(1), hidden = l.x.shape().dim(1);
  SideWorkGuard guard(backend);
  if (side) RETURN_IF_ERROR(backend.BeginSideWork());
  ASSIGN_OR_RETURN(Tensor shared, backend.Allocate(DType::kF32, {tokens, hidden}));
  {
    ASSIGN_OR_RETURN(Tensor gate_up, backend.Allocate(DType::kF32, {tokens, 2 * inter}));
    ASSIGN_OR_RETURN(Tensor act, backend.Allocate(DType::kF32, {tokens, inter}));
    RETURN_IF_ERROR(backend.MatMul(l.x, l.gate_up, gate_up));
    RETURN_IF_ERROR(backend.SiluAndMul(gate_up, act));
    RETURN_IF_ERROR(backend.MatMul(act, l.down, shared));
  }  // gate_up and act die on the side stream
  if (side) RETURN_IF_ERROR(backend.EndSideWork());
  ASSIGN_OR_RETURN(Tensor projected, backend.Allocate(DType::kF32, {tokens, hidden}));
  RETURN_IF_ERROR(backend.MatMul(l.x, l.proj, projected));
  RETURN_IF_ERROR(backend.RmsNorm(projected, l.norm_weight, 1e-6f, projected));
  if (side) RETURN_IF_ERROR(backend.JoinSideWork());
  return backend.Add(projected, shared, l.out);
}

TEST(CudaSideWork, OpsOnTheSideStreamGiveWhatTheyGiveInOrder) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  for (std::int64_t tokens : {1, 4, 37}) {
    SCOPED_TRACE(::testing::Message() << "tokens=" << tokens);
    std::mt19937_64 rng = MakeRng(9301 + tokens);
    Layer l = MakeLayer(cuda, rng, tokens);
    ASSERT_TRUE(RunLayer(cuda, l, /*side=*/false).ok());
    const std::vector<float> in_order = Download(cuda, l.out);
    ASSERT_TRUE(RunLayer(cuda, l, /*side=*/true).ok());
    // The same kernels on the same inputs: equal bit for bit, whatever ran beside them.
    EXPECT_EQ(Download(cuda, l.out), in_order);
    EXPECT_FALSE(cuda.SideWorkOpen());
  }
}

TEST(CudaSideWork, ACapturedGraphForksAndJoinsAndReplaysWithNewInputs) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(9310);
  Layer l = MakeLayer(cuda, rng, 2);
  ASSERT_TRUE(cuda.BeginCapture().ok());
  const absl::Status enqueued = RunLayer(cuda, l, /*side=*/true);
  absl::StatusOr<std::unique_ptr<Backend::Graph>> graph = cuda.EndCapture();
  ASSERT_TRUE(enqueued.ok()) << enqueued;
  ASSERT_TRUE(graph.ok()) << graph.status();
  for (int run = 0; run < 3; ++run) {
    const std::vector<float> x = RandomNormal(rng, static_cast<std::size_t>(l.x.NumElements()), 1.0f);
    ASSERT_TRUE(cuda.CopyFromHost(std::as_bytes(std::span<const float>(x)), l.x).ok());
    ASSERT_TRUE((*graph)->Run().ok());
    const std::vector<float> replayed = Download(cuda, l.out);
    ASSERT_TRUE(RunLayer(cuda, l, /*side=*/false).ok());
    EXPECT_EQ(replayed, Download(cuda, l.out)) << "run " << run;
  }
}

// A tensor the side stream writes, destroyed on the main stream before the join: the main
// stream's next allocation of that size must not get its memory while the side still writes it.
// The side's writes take milliseconds; the main stream's fill lands at once, so without the
// pool's hold the side's last write would overwrite it.
TEST(CudaSideWork, MemoryTheSideStillWritesIsNotReusedBeforeTheJoin) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  std::mt19937_64 rng = MakeRng(9320);
  constexpr std::int64_t kRows = 64, kHidden = 4096, kOut = 8192;
  const Tensor x = Upload(cuda, RandomNormal(rng, kRows * kHidden, 1.0f), DType::kF32, {kRows, kHidden});
  const Tensor w = Upload(cuda, RandomNormal(rng, kOut * kHidden, 0.02f), DType::kBF16, {kOut, kHidden});
  const std::vector<float> pattern(static_cast<std::size_t>(kRows * kOut), 7.0f);
  for (int round = 0; round < 3; ++round) {
    std::optional<Tensor> written = AllocateOrFail(cuda, DType::kF32, {kRows, kOut});
    ASSERT_TRUE(cuda.BeginSideWork().ok());
    for (int i = 0; i < 20; ++i) ASSERT_TRUE(cuda.MatMul(x, w, *written).ok());
    ASSERT_TRUE(cuda.EndSideWork().ok());
    written.reset();  // dies on the main stream while the side still writes it
    Tensor fresh = AllocateOrFail(cuda, DType::kF32, {kRows, kOut});
    ASSERT_TRUE(cuda.Copy(Upload(cuda, pattern, DType::kF32, {kRows, kOut}), fresh).ok());
    ASSERT_TRUE(cuda.JoinSideWork().ok());
    EXPECT_EQ(Download(cuda, fresh), pattern) << "round " << round;
  }
}

// A 4 x 4096 x 4096 fp32 GEMV, y = x wᵀ: some tens of microseconds a launch, so a few in a row
// keep a stream busy long enough for a missing wait between streams to show.
struct BusyGemv {
  static constexpr std::int64_t kRows = 4, kIn = 4096, kOut = 4096;
  Tensor x, w;
};
BusyGemv MakeBusyGemv(Backend& cuda, std::uint64_t seed) {
  std::mt19937_64 rng = MakeRng(seed);
  return {Upload(cuda, RandomNormal(rng, BusyGemv::kRows * BusyGemv::kIn, 1.0f), DType::kF32,
                 {BusyGemv::kRows, BusyGemv::kIn}),
          Upload(cuda, RandomNormal(rng, BusyGemv::kOut * BusyGemv::kIn, 0.01f), DType::kF32,
                 {BusyGemv::kOut, BusyGemv::kIn})};
}

// Side work begun again after EndSideWork (before the join) starts after the main stream's ops
// issued so far: a copy to page-locked host memory issued there (the model's routing log) lands
// the main stream's last value of a tensor, not one from before those ops ran.
TEST(CudaSideWork, WorkBegunAgainFollowsTheMainStreamAndCopiesToTheHost) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  const BusyGemv g = MakeBusyGemv(cuda, 4406);
  constexpr std::int64_t kRows = BusyGemv::kRows, kOut = BusyGemv::kOut;
  Tensor y = Upload(cuda, std::vector<float>(kRows * kOut, 0.0f), DType::kF32, {kRows, kOut});
  absl::StatusOr<std::unique_ptr<Storage>> staging = cuda.AllocateHostStaging(y.nbytes());
  NQ_ASSERT_OK(staging.status());
  std::span<std::byte> host(static_cast<std::byte*>((*staging)->data()), y.nbytes());
  for (int round = 0; round < 3; ++round) {
    std::fill(host.begin(), host.end(), std::byte{0});
    ASSERT_TRUE(cuda.BeginSideWork().ok());
    ASSERT_TRUE(cuda.EndSideWork().ok());
    // About a millisecond of main-stream work before y holds its last value.
    for (int i = 0; i < 16; ++i) ASSERT_TRUE(cuda.MatMul(g.x, g.w, y).ok());
    ASSERT_TRUE(cuda.Add(y, y, y).ok());
    ASSERT_TRUE(cuda.BeginSideWork().ok());
    ASSERT_TRUE(cuda.CopyToHostAsync(y, host).ok());
    ASSERT_TRUE(cuda.EndSideWork().ok());
    ASSERT_TRUE(cuda.JoinSideWork().ok());
    NQ_ASSERT_OK(cuda.Synchronize());
    std::vector<float> landed(static_cast<size_t>(kRows * kOut));
    std::memcpy(landed.data(), host.data(), host.size());
    EXPECT_EQ(landed, Download(cuda, y)) << "round " << round;
    ASSERT_TRUE(cuda.Copy(Upload(cuda, std::vector<float>(kRows * kOut, 0.0f), DType::kF32, {kRows, kOut}), y).ok());
  }
}

// Side work continued after EndSideWork runs after the side's earlier ops (a chain of dependent
// ops split across the two segments gives the chain's result), and a main-stream op issued
// between the segments is joined like the rest.
TEST(CudaSideWork, ContinuedSideWorkFollowsTheSidesEarlierOps) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  const BusyGemv g = MakeBusyGemv(cuda, 4407);
  constexpr std::int64_t kRows = BusyGemv::kRows, kOut = BusyGemv::kOut;
  const std::vector<float> ones(kRows * kOut, 1.0f);
  Tensor one = Upload(cuda, ones, DType::kF32, {kRows, kOut});
  for (int round = 0; round < 3; ++round) {
    Tensor side = AllocateOrFail(cuda, DType::kF32, {kRows, kOut});
    Tensor main = AllocateOrFail(cuda, DType::kF32, {kRows, kOut});
    ASSERT_TRUE(cuda.BeginSideWork().ok());
    for (int i = 0; i < 8; ++i) ASSERT_TRUE(cuda.MatMul(g.x, g.w, side).ok());
    ASSERT_TRUE(cuda.EndSideWork().ok());
    ASSERT_TRUE(cuda.MatMul(g.x, g.w, main).ok());
    ASSERT_TRUE(cuda.ContinueSideWork().ok());
    ASSERT_TRUE(cuda.Add(side, one, side).ok());  // after the side's MatMuls
    ASSERT_TRUE(cuda.EndSideWork().ok());
    ASSERT_TRUE(cuda.JoinSideWork().ok());
    ASSERT_TRUE(cuda.Add(main, one, main).ok());
    EXPECT_EQ(Download(cuda, side), Download(cuda, main)) << "round " << round;
  }
  EXPECT_THAT(cuda.ContinueSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no ended side work")));
}

TEST(CudaSideWork, WhatSharesStateWithTheMainStreamIsRefused) {
  if (Backends().cuda == nullptr) return;
  Backend& cuda = *Backends().cuda;
  const std::vector<float> host = {1, 2, 3, 4};
  Tensor t = Upload(cuda, host, DType::kF32, {1, 4});
  Tensor table = Upload(cuda, host, DType::kF32, {1, 4});
  Tensor out = AllocateOrFail(cuda, DType::kF32, {1, 4});
  std::vector<std::byte> bytes(16);

  EXPECT_THAT(cuda.EndSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("not going to the side")));
  EXPECT_THAT(cuda.JoinSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no side work")));
  ASSERT_TRUE(cuda.BeginSideWork().ok());
  EXPECT_THAT(cuda.BeginSideWork(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("already open")));
  const std::vector<std::int32_t> ids = {0};
  EXPECT_THAT(cuda.Embedding(ids, table, out), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side stream")));
  EXPECT_THAT(cuda.CopyFromHost(std::as_bytes(std::span<const float>(host)), t),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side stream")));
  EXPECT_THAT(cuda.Synchronize(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work is open")));
  ASSERT_TRUE(cuda.Add(t, t, out).ok());  // an op that may run there
  ASSERT_TRUE(cuda.EndSideWork().ok());
  EXPECT_THAT(cuda.CopyToHost(t, bytes), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work is open")));
  EXPECT_THAT(cuda.BeginCapture(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work is open")));
  ASSERT_TRUE(cuda.JoinSideWork().ok());
  EXPECT_EQ(Download(cuda, out), (std::vector<float>{2, 4, 6, 8}));

  // A capture that ends with side work open joins it, fails, and leaves the backend usable.
  ASSERT_TRUE(cuda.BeginCapture().ok());
  ASSERT_TRUE(cuda.BeginSideWork().ok());
  ASSERT_TRUE(cuda.Add(t, t, out).ok());
  EXPECT_THAT(cuda.EndCapture().status(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("side work")));
  EXPECT_FALSE(cuda.SideWorkOpen());
  ASSERT_TRUE(cuda.Add(t, out, out).ok());
  EXPECT_EQ(Download(cuda, out), (std::vector<float>{3, 6, 9, 12}));

  // The guard joins side work a failed caller left open.
  {
    SideWorkGuard guard(cuda);
    ASSERT_TRUE(cuda.BeginSideWork().ok());
  }
  EXPECT_FALSE(cuda.SideWorkOpen());
}

}  // namespace
}  // namespace nq::kernels
