// The DSA indexer's one-block decode selection (IndexerDecodeSelect::kOneBlock,
// kernels/cuda/indexer_one_block_select.cuh) against the default filter + resolve path on the same
// device scores: both are exact selections of one score row (score descending, the lower key on
// ties, written in key order), so their outputs must be identical, -1 padding included. The
// default path itself is checked against the CPU backend in indexer_topk_test.cc. Covers one to
// four queries, rows held in registers (up to 16384 keys) and read in chunks, ties over every key
// (the threshold bucket larger than shared memory: the digit passes over the row), a crowded top
// digit, NaN scores, and a device position below the bound the launch was sized for.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/indexer_topk.cuh"

namespace nq::kernels::cuda {
namespace {

bool HaveGpu() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

template <typename T>
T* Upload(const std::vector<T>& host) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, sizeof(T) * std::max<std::size_t>(host.size(), 1)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(p, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice), cudaSuccess);
  return p;
}

struct Case {
  int tokens, heads, dim, keys, top_k;
  int position = -1;  // a device position of query 0 below the bound keys - tokens; -1: none
};

std::string Describe(const Case& c) {
  return absl::StrCat("T=", c.tokens, " H=", c.heads, " d=", c.dim, " keys=", c.keys, " top_k=", c.top_k,
                      " position=", c.position);
}

// Both paths' selections for one case, on the same inputs and stream.
void ExpectPathsSelectAlike(const Case& c, const std::vector<float>& q, const std::vector<float>& k,
                            const std::vector<float>& w) {
  SCOPED_TRACE(Describe(c));
  int num_sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int start_pos = c.keys - c.tokens;
  const std::int64_t visible_max = c.keys;
  std::vector<void*> owned;
  auto keep = [&](auto* p) {
    owned.push_back(p);
    return p;
  };
  IndexerTopKParams p;
  p.q = keep(Upload(q));
  p.k = keep(Upload(k));
  p.weights = keep(Upload(w));
  p.tokens = c.tokens;
  p.heads = c.heads;
  p.dim = c.dim;
  p.top_k = c.top_k;
  p.start_pos = start_pos;
  p.score_rows = c.tokens;
  if (c.position >= 0) p.position = keep(Upload(std::vector<std::int32_t>{c.position}));
  float* scores = nullptr;
  ASSERT_EQ(cudaMalloc(&scores, sizeof(float) * c.tokens * visible_max), cudaSuccess);
  p.scores = keep(scores);
  void* scratch = nullptr;
  ASSERT_EQ(cudaMalloc(&scratch, static_cast<std::size_t>(IndexerSelectScratchBytes(c.tokens, visible_max, c.top_k))),
            cudaSuccess);
  p.select_scratch = keep(scratch);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);

  std::vector<std::vector<std::int32_t>> got;
  for (IndexerDecodeSelect path : {IndexerDecodeSelect::kFiltered, IndexerDecodeSelect::kOneBlock}) {
    std::int32_t* selected = nullptr;
    ASSERT_EQ(cudaMalloc(&selected, sizeof(std::int32_t) * c.tokens * c.top_k), cudaSuccess);
    keep(selected);
    // A sentinel no selection writes: every slot must be written, key or -1.
    ASSERT_EQ(cudaMemset(selected, 0x7f, sizeof(std::int32_t) * c.tokens * c.top_k), cudaSuccess);
    p.selected = selected;
    p.decode_select = path;
    const absl::Status launched = LaunchIndexerTopK(p, {.stream = stream, .num_sms = num_sms});
    ASSERT_TRUE(launched.ok()) << launched;
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<std::int32_t> host(static_cast<std::size_t>(c.tokens) * c.top_k);
    ASSERT_EQ(cudaMemcpy(host.data(), selected, sizeof(std::int32_t) * host.size(), cudaMemcpyDeviceToHost),
              cudaSuccess);
    got.push_back(std::move(host));
  }
  EXPECT_TRUE(got[0] == got[1]);
  // Ascending keys below each query's visible count, then -1 (the contract; the default path's
  // output must satisfy it too, so a shared mistake cannot pass unseen).
  const int first = c.position >= 0 ? c.position : start_pos;
  for (int t = 0; t < c.tokens; ++t) {
    const int visible = first + t + 1, take = std::min(c.top_k, visible);
    for (int j = 0; j < c.top_k; ++j) {
      const std::int32_t key = got[1][static_cast<std::size_t>(t) * c.top_k + j];
      if (j >= take) {
        ASSERT_EQ(key, -1) << "t=" << t << " j=" << j;
        continue;
      }
      ASSERT_GE(key, 0) << "t=" << t << " j=" << j;
      ASSERT_LT(key, visible) << "t=" << t << " j=" << j;
      if (j > 0) {
        ASSERT_LT(got[1][static_cast<std::size_t>(t) * c.top_k + j - 1], key) << "t=" << t << " j=" << j;
      }
    }
  }
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  for (void* ptr : owned) EXPECT_EQ(cudaFree(ptr), cudaSuccess);
}

std::vector<float> Normal(std::mt19937_64& rng, std::size_t n, float stddev) {
  std::normal_distribution<float> d(0.0f, stddev);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<float> Uniform(std::mt19937_64& rng, std::size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

void ExpectRandomCase(std::mt19937_64& rng, const Case& c) {
  ExpectPathsSelectAlike(c, Normal(rng, std::size_t{1} * c.tokens * c.heads * c.dim, 1.0f),
                         Normal(rng, std::size_t{1} * c.keys * c.dim, 1.0f),
                         Uniform(rng, std::size_t{1} * c.tokens * c.heads, 0.0f, 0.1f));
}

TEST(CudaIndexerOneBlock, RandomScoresSelectLikeTheDefaultPath) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(4101);
  // GLM-5's indexer (32 heads) and 64 heads; around top_k, the 16384-key chunk and past it.
  for (int keys : {2049, 4000, 16384, 16385, 40000, 131072}) {
    for (int tokens : {1, 4}) ExpectRandomCase(rng, {tokens, 32, 128, keys, 2048});
  }
  ExpectRandomCase(rng, {1, 64, 128, 16384, 2048});
  ExpectRandomCase(rng, {2, 8, 40, 3000, 100});
  ExpectRandomCase(rng, {3, 2, 8, 40, 8});
}

TEST(CudaIndexerOneBlock, ADevicePositionBelowTheBoundSelectsLikeTheDefaultPath) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(4102);
  ExpectRandomCase(rng, {1, 32, 128, 40000, 2048, /*position=*/20000});
  ExpectRandomCase(rng, {4, 32, 128, 16384, 2048, /*position=*/9000});
  ExpectRandomCase(rng, {2, 32, 128, 8000, 2048, /*position=*/1000});  // below top_k: every key
}

TEST(CudaIndexerOneBlock, TiesOverEveryKeySelectTheLowestKeys) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  // Every dot negative, so every score is 0: the threshold bucket holds every key. At 16384 keys
  // it fits shared memory (radix digits into the keys' bits); at 131072 it does not (the digit
  // passes over the row).
  for (const Case& c : {Case{3, 32, 128, 16384, 2048}, Case{1, 32, 128, 131072, 2048}}) {
    ExpectPathsSelectAlike(c, std::vector<float>(std::size_t{1} * c.tokens * c.heads * c.dim, 1.0f),
                           std::vector<float>(std::size_t{1} * c.keys * c.dim, -1.0f),
                           std::vector<float>(std::size_t{1} * c.tokens * c.heads, 1.0f));
  }
}

TEST(CudaIndexerOneBlock, CrowdedTopDigitAndNanScoresSelectLikeTheDefaultPath) {
  if (!HaveGpu()) GTEST_SKIP() << "no GPU";
  std::mt19937_64 rng(4103);
  // Scores 1024..2047 (one head, one dim): four top digits, each past shared memory.
  const Case crowded{2, 1, 1, 131072, 2048};
  std::vector<float> k(crowded.keys);
  std::uniform_int_distribution<int> ints(1024, 2047);
  for (float& x : k) x = static_cast<float>(ints(rng));
  ExpectPathsSelectAlike(crowded, std::vector<float>(crowded.tokens, 1.0f), k, std::vector<float>(crowded.tokens, 1.0f));
  // A NaN head weight: every key with a positive dot for that head scores NaN (ranked last).
  const Case nan{2, 32, 128, 16384, 2048};
  std::vector<float> w = Uniform(rng, std::size_t{1} * nan.tokens * nan.heads, 0.0f, 0.1f);
  w[0] = std::nanf("");
  ExpectPathsSelectAlike(nan, Normal(rng, std::size_t{1} * nan.tokens * nan.heads * nan.dim, 1.0f),
                         Normal(rng, std::size_t{1} * nan.keys * nan.dim, 1.0f), w);
}

}  // namespace
}  // namespace nq::kernels::cuda
