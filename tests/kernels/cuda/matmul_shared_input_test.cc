// CUDA MatMulSharedInput (one GEMV launch over several matrices' rows, matmul_gemv.cuh) against
// the CPU's MatMul of each matrix: GLM-5's and DeepSeek-V3's projections of one hidden state,
// ragged row counts, mixed weight dtypes (one launch per dtype), the tiled path, and batch
// invariance (a token's outputs do not depend on how many tokens share the launch).
#include <cstdint>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/fp8_block_quantize.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::DecodeGemvBackends;
using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;

constexpr double kTolerance = 1e-4;

struct Group {
  const char* name;
  std::int64_t k;
  std::vector<std::int64_t> rows;
  std::vector<DType> dtypes;  // one per matrix
};

struct Outputs {
  std::vector<std::vector<float>> ys;
};

Outputs RunShared(Backend& backend, const std::vector<float>& x, std::int64_t m, const Group& g,
                  const std::vector<std::vector<float>>& weights) {
  Tensor tx = Upload(backend, x, DType::kF32, {m, g.k});
  std::vector<Tensor> ws, ys, scales;
  for (std::size_t i = 0; i < g.rows.size(); ++i) {
    if (g.dtypes[i] == DType::kF8E4M3) {  // the weights as an FP8 checkpoint would hold them
      absl::StatusOr<BlockScaledFp8> q = QuantizeBlockScaledFp8(weights[i], g.rows[i], g.k);
      EXPECT_TRUE(q.ok()) << q.status();
      ws.push_back(AllocateOrFail(backend, DType::kF8E4M3, {g.rows[i], g.k}));
      EXPECT_TRUE(backend.CopyFromHost(std::as_bytes(std::span(q->values)), ws.back()).ok());
      scales.push_back(Upload(backend, q->scale_inv, DType::kF32, {q->scale_rows, q->scale_cols}));
    } else {
      ws.push_back(Upload(backend, weights[i], g.dtypes[i], {g.rows[i], g.k}));
      scales.emplace_back();
    }
    ys.push_back(Upload(backend, std::vector<float>(m * g.rows[i], 7.0f), DType::kF32, {m, g.rows[i]}));
  }
  std::vector<Backend::WeightRef> w_ptrs;
  std::vector<Tensor*> y_ptrs;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    w_ptrs.push_back({&ws[i], scales[i].valid() ? &scales[i] : nullptr});
    y_ptrs.push_back(&ys[i]);
  }
  const absl::Status status = backend.MatMulSharedInput(tx, w_ptrs, y_ptrs);
  EXPECT_TRUE(status.ok()) << backend.name() << ": " << status;
  Outputs out;
  for (const Tensor& y : ys) out.ys.push_back(Download(backend, y));
  return out;
}

std::vector<Group> Groups() {
  const DType b = DType::kBF16;
  return {
      // GLM-5: q_a, kv_a, k_pe, the indexer's wk and weights_proj from x; then q_nope, q_pe and
      // the indexer's wq_b from the query latent.
      {"glm5 x", 6144, {2048, 512, 64, 128, 32}, {b, b, b, b, b}},
      {"glm5 q", 2048, {12288, 4096, 4096}, {b, b, b}},
      // DeepSeek-V3 (one tensor-parallel rank of 16 heads): q_a, kv_a, k_pe.
      {"dsv3 x", 7168, {1536, 512, 64}, {b, b, b}},
      // Ragged rows (blocks ending mid-block in every matrix), k not a multiple of the vector.
      {"ragged", 1001, {33, 1, 70, 5, 31}, {b, b, b, b, b}},
      // Mixed dtypes: one launch per dtype, each with its own matrices.
      {"mixed", 4096, {100, 8, 576, 40}, {b, DType::kF32, b, DType::kF16}},
      // FP8 weights with their block scales (DeepSeek-V3's checkpoint as stored), beside BF16 ones.
      {"fp8", 7168, {1536, 576, 64}, {DType::kF8E4M3, DType::kF8E4M3, b}},
      // The most matrices a call takes.
      {"eight", 512, {1, 2, 3, 4, 5, 6, 7, 300}, {b, b, b, b, b, b, b, b}},
  };
}

TEST(CudaMatMulSharedInput, EachOutputMatchesTheCpuMatMulOfItsMatrix) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(2202);
  ErrorSummary summary("MatMulSharedInput", kTolerance);
  for (const Group& g : Groups()) {
    for (std::int64_t m : {1, 2, 4, 8, 20}) {  // 20: the tiled path, matrix by matrix
      SCOPED_TRACE(absl::StrCat(g.name, " m=", m));
      const std::vector<float> x = RandomNormal(rng, m * g.k, 1.0f);
      std::vector<std::vector<float>> weights;
      for (std::int64_t n : g.rows) weights.push_back(RandomNormal(rng, n * g.k, 0.05f));
      const Outputs cpu = RunShared(*Backends().cpu, x, m, g, weights);
      // Each decode GEMV kernel (automatic, tensor cores, fp32 FMAs) over the whole group.
      for (Backend* backend : DecodeGemvBackends()) {
        const Outputs cuda = RunShared(*backend, x, m, g, weights);
        for (std::size_t i = 0; i < g.rows.size(); ++i) {
          SCOPED_TRACE(absl::StrCat("matrix ", i, " of ", g.rows[i], " rows"));
          summary.Add(NormalizedError(cuda.ys[i], cpu.ys[i]));
        }
      }
    }
  }
}

TEST(CudaMatMulSharedInput, RowsAreBitIdenticalWhateverTheTokenCount) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(2203);
  for (const Group& g : {Groups()[0], Groups()[3]}) {
    SCOPED_TRACE(g.name);
    std::vector<std::vector<float>> weights;
    for (std::int64_t n : g.rows) weights.push_back(RandomNormal(rng, n * g.k, 0.05f));
    const std::vector<float> x = RandomNormal(rng, 8 * g.k, 1.0f);
    for (Backend* backend : DecodeGemvBackends()) {
      const Outputs all = RunShared(*backend, x, 8, g, weights);
      for (std::int64_t m : {1, 3}) {
        const Outputs fewer = RunShared(*backend, std::vector<float>(x.begin(), x.begin() + m * g.k), m, g, weights);
        for (std::size_t i = 0; i < g.rows.size(); ++i) {
          EXPECT_EQ(fewer.ys[i], std::vector<float>(all.ys[i].begin(), all.ys[i].begin() + m * g.rows[i]))
              << "matrix " << i << ": " << m << " tokens differ from the same tokens among 8";
        }
      }
    }
  }
}

}  // namespace
}  // namespace nq::kernels
