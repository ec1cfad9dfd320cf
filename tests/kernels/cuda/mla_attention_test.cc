// CUDA MlaAttention vs the CPU backend on fresh random inputs: DeepSeek-V3 head dims, dense
// causal prefill and decode, DSA selections with -1 padding and invisible entries, F32 / BF16
// weights.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "tests/kernels/cuda/backend_pair.h"
#include "tests/kernels/model_ref.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::Backends;
using ::nq::kernels::testing::ErrorSummary;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::MlaInputs;
using ::nq::kernels::testing::MlaShape;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomMlaInputs;
using ::nq::kernels::testing::RunMlaAttention;

// fp32 dot products over c = 512 and an fp32 online softmax against the CPU's double.
constexpr double kTolerance = 1e-4;

float Scale(const MlaShape& m) { return 1.0f / std::sqrt(static_cast<float>(m.dn + m.dr)); }

// A DSA selection: per query up to top_k distinct visible keys, the rest -1, plus (when
// `invisible`) one key past the query's position that must be ignored.
std::vector<std::int32_t> RandomSelection(std::mt19937_64& rng, const MlaShape& m,
                                          std::int64_t top_k, bool invisible) {
  std::vector<std::int32_t> selected;
  for (std::int64_t t = 0; t < m.tokens; ++t) {
    const std::int64_t pos = m.start_pos + t;
    std::vector<std::int32_t> keys(pos + 1);
    std::iota(keys.begin(), keys.end(), 0);
    std::shuffle(keys.begin(), keys.end(), rng);
    const std::int64_t used = RandomInt(rng, 0, std::min<std::int64_t>(top_k, pos + 1));
    for (std::int64_t k = 0; k < top_k; ++k) selected.push_back(k < used ? keys[k] : -1);
    if (invisible && pos + 1 < m.keys) {
      selected[t * top_k + RandomInt(rng, 0, top_k - 1)] = static_cast<std::int32_t>(pos + 1);
    }
  }
  return selected;
}

TEST(CudaMlaAttention, DenseMatchesCpuOnFreshRandomInputs) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3601);
  // DeepSeek-V3 per-rank heads: dn 128, dr 64, c 512, dv 128.
  std::vector<MlaShape> cases = {
      {.tokens = 1, .heads = 1, .dn = 1, .dr = 2, .c = 1, .dv = 1, .keys = 1},
      {.tokens = 5, .heads = 3, .dn = 8, .dr = 4, .c = 16, .dv = 8, .keys = 9, .start_pos = 4},
      {.tokens = 64, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 64},
      {.tokens = 1,
       .heads = 16,
       .dn = 128,
       .dr = 64,
       .c = 512,
       .dv = 128,
       .keys = 1500,
       .start_pos = 1499},
      {.tokens = 33,
       .heads = 4,
       .dn = 128,
       .dr = 64,
       .c = 512,
       .dv = 128,
       .keys = 400,
       .start_pos = 300}};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t tokens = RandomInt(rng, 1, 40);
    const std::int64_t start = RandomInt(rng, 0, 200);
    cases.push_back({.tokens = tokens,
                     .heads = RandomInt(rng, 1, 8),
                     .dn = RandomInt(rng, 1, 130),
                     .dr = RandomInt(rng, 0, 70),
                     .c = RandomInt(rng, 1, 600),
                     .dv = RandomInt(rng, 1, 130),
                     .keys = start + tokens,
                     .start_pos = start});
  }
  for (DType w_dtype : {DType::kF32, DType::kBF16}) {
    ErrorSummary summary(absl::StrCat("MlaAttention dense w=", DTypeName(w_dtype)), kTolerance);
    for (const MlaShape& m : cases) {
      SCOPED_TRACE(absl::StrCat("w ", DTypeName(w_dtype), " T=", m.tokens, " H=", m.heads,
                                " dn=", m.dn, " dr=", m.dr, " c=", m.c, " dv=", m.dv, " S=", m.keys,
                                " start=", m.start_pos));
      const MlaInputs in = RandomMlaInputs(rng, m, w_dtype, w_dtype, 0.05f);
      const std::vector<float> cpu =
          RunMlaAttention(*Backends().cpu, m, in, w_dtype, w_dtype, {}, 0, Scale(m));
      const std::vector<float> cuda =
          RunMlaAttention(*Backends().cuda, m, in, w_dtype, w_dtype, {}, 0, Scale(m));
      summary.Add(NormalizedError(cuda, cpu));
    }
  }
}

TEST(CudaMlaAttention, SelectedKeysMatchCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3602);
  struct Case {
    MlaShape shape;
    std::int64_t top_k;
  };
  const std::vector<Case> cases = {
      {{.tokens = 6, .heads = 3, .dn = 8, .dr = 4, .c = 16, .dv = 8, .keys = 20, .start_pos = 10},
       5},
      // DSA decode: 2048 of 3000 keys.
      {{.tokens = 1,
        .heads = 16,
        .dn = 128,
        .dr = 64,
        .c = 512,
        .dv = 128,
        .keys = 3001,
        .start_pos = 2999},
       2048},
      {{.tokens = 48, .heads = 8, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 100}, 64}};
  ErrorSummary summary("MlaAttention selected (DSA)", kTolerance);
  for (const Case& c : cases) {
    const MlaShape& m = c.shape;
    for (DType uk : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(absl::StrCat("w_uk ", DTypeName(uk), " T=", m.tokens, " H=", m.heads,
                                " S=", m.keys, " top_k=", c.top_k));
      const MlaInputs in = RandomMlaInputs(rng, m, uk, DType::kBF16, 0.05f);
      const std::vector<std::int32_t> selected = RandomSelection(rng, m, c.top_k, true);
      const std::vector<float> cpu =
          RunMlaAttention(*Backends().cpu, m, in, uk, DType::kBF16, selected, c.top_k, Scale(m));
      const std::vector<float> cuda =
          RunMlaAttention(*Backends().cuda, m, in, uk, DType::kBF16, selected, c.top_k, Scale(m));
      summary.Add(NormalizedError(cuda, cpu));
      // Queries whose selection had nothing visible are exactly zero on both.
      const std::int64_t width = m.heads * m.dv;
      for (std::int64_t t = 0; t < m.tokens; ++t) {
        if (cpu.size() != cuda.size()) break;
        const bool cpu_zero = std::all_of(cpu.begin() + t * width, cpu.begin() + (t + 1) * width,
                                          [](float v) { return v == 0.0f; });
        if (cpu_zero) {
          EXPECT_TRUE(std::all_of(cuda.begin() + t * width, cuda.begin() + (t + 1) * width,
                                  [](float v) { return v == 0.0f; }))
              << "t=" << t;
        }
      }
    }
  }
}

// The split kernels (kernels/cuda/mla_decode.cuh) take up to 64 queries with c and dr multiples
// of 16: DeepSeek-V3 dims over many key tiles and splits, head counts that leave the last
// 16-head group partly empty, query rows at the causal edge, and small dims that leave most warps
// of a block without PV columns.
TEST(CudaMlaAttention, DecodeSplitMatchesCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3604);
  auto dsv3 = [](std::int64_t tokens, std::int64_t heads, std::int64_t keys) {
    return MlaShape{.tokens = tokens, .heads = heads, .dn = 128, .dr = 64, .c = 512, .dv = 128,
                    .keys = keys, .start_pos = keys - tokens};
  };
  std::vector<MlaShape> cases = {
      dsv3(1, 16, 1),    dsv3(1, 16, 31),  dsv3(1, 16, 32),   dsv3(1, 16, 33),  dsv3(1, 16, 4097),
      dsv3(2, 20, 1000), dsv3(4, 16, 9000), dsv3(3, 128, 300), dsv3(64, 2, 100),
      {.tokens = 1, .heads = 5, .dn = 8, .dr = 16, .c = 16, .dv = 8, .keys = 200, .start_pos = 199},
      {.tokens = 2, .heads = 3, .dn = 24, .dr = 16, .c = 48, .dv = 40, .keys = 77, .start_pos = 70},
      // Keys past the last query stay unread (start_pos + tokens < keys).
      {.tokens = 2, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 600, .start_pos = 100}};
  // GLM-5's heads (64 of dn 192, dv 256) at every token count the absorb and output kernels are
  // instantiated for (1, 2, 4, 8 tokens per pass) and between them.
  for (std::int64_t tokens : {1, 2, 3, 4, 5, 8, 9}) {
    cases.push_back({.tokens = tokens, .heads = 64, .dn = 192, .dr = 64, .c = 512, .dv = 256, .keys = 700,
                     .start_pos = 700 - tokens});
  }
  // Under compute-sanitizer (NQ_SANITIZE_SMALL=1) the short caches only.
  const bool small = std::getenv("NQ_SANITIZE_SMALL") != nullptr;
  for (DType w_dtype : {DType::kBF16, DType::kF32}) {
    ErrorSummary summary(absl::StrCat("MlaAttention split dense w=", DTypeName(w_dtype)), kTolerance);
    for (const MlaShape& m : cases) {
      if (small && m.keys * m.heads > 4000) continue;
      SCOPED_TRACE(absl::StrCat("w ", DTypeName(w_dtype), " T=", m.tokens, " H=", m.heads, " c=", m.c,
                                " dr=", m.dr, " S=", m.keys, " start=", m.start_pos));
      const MlaInputs in = RandomMlaInputs(rng, m, w_dtype, w_dtype, 0.05f);
      summary.Add(NormalizedError(
          RunMlaAttention(*Backends().cuda, m, in, w_dtype, w_dtype, {}, 0, Scale(m)),
          RunMlaAttention(*Backends().cpu, m, in, w_dtype, w_dtype, {}, 0, Scale(m))));
    }
  }
}

TEST(CudaMlaAttention, DecodeSplitSelectedMatchesCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3605);
  struct Case {
    MlaShape shape;
    std::int64_t top_k;
  };
  const std::vector<Case> cases = {
      {{.tokens = 2, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 5000, .start_pos = 4998},
       2048},
      // top_k past the visible keys: most entries -1.
      {{.tokens = 1, .heads = 17, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 100, .start_pos = 99}, 2048},
      {{.tokens = 4, .heads = 4, .dn = 16, .dr = 16, .c = 32, .dv = 24, .keys = 300, .start_pos = 296}, 70},
      // GLM-5's heads selecting 2048 of 4100 keys, one query and an MTP verification's four.
      {{.tokens = 1, .heads = 64, .dn = 192, .dr = 64, .c = 512, .dv = 256, .keys = 4100, .start_pos = 4099}, 2048},
      {{.tokens = 4, .heads = 64, .dn = 192, .dr = 64, .c = 512, .dv = 256, .keys = 4100, .start_pos = 4096}, 2048}};
  const bool small = std::getenv("NQ_SANITIZE_SMALL") != nullptr;
  ErrorSummary summary("MlaAttention split selected (DSA)", kTolerance);
  for (const Case& c : cases) {
    const MlaShape& m = c.shape;
    if (small && m.keys * m.heads > 4000) continue;
    SCOPED_TRACE(absl::StrCat("T=", m.tokens, " H=", m.heads, " S=", m.keys, " top_k=", c.top_k));
    const MlaInputs in = RandomMlaInputs(rng, m, DType::kBF16, DType::kBF16, 0.05f);
    const std::vector<std::int32_t> selected = RandomSelection(rng, m, c.top_k, true);
    summary.Add(NormalizedError(
        RunMlaAttention(*Backends().cuda, m, in, DType::kBF16, DType::kBF16, selected, c.top_k, Scale(m)),
        RunMlaAttention(*Backends().cpu, m, in, DType::kBF16, DType::kBF16, selected, c.top_k, Scale(m))));
  }
  // A query whose selection names no visible key gets zeros (not NaN), beside one that does.
  const MlaShape m{.tokens = 2, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 50, .start_pos = 10};
  const MlaInputs in = RandomMlaInputs(rng, m, DType::kBF16, DType::kBF16, 0.05f);
  constexpr std::int64_t kTopK = 40;
  std::vector<std::int32_t> selected(2 * kTopK, -1);
  selected[0] = 30;  // query 0 (position 10): only a key past its position
  selected[kTopK] = 3;
  selected[kTopK + 1] = 11;
  const std::vector<float> cuda =
      RunMlaAttention(*Backends().cuda, m, in, DType::kBF16, DType::kBF16, selected, kTopK, Scale(m));
  const std::vector<float> cpu =
      RunMlaAttention(*Backends().cpu, m, in, DType::kBF16, DType::kBF16, selected, kTopK, Scale(m));
  ASSERT_EQ(cuda.size(), static_cast<std::size_t>(2 * m.heads * m.dv));
  const std::int64_t width = m.heads * m.dv;
  EXPECT_TRUE(std::all_of(cuda.begin(), cuda.begin() + width, [](float v) { return v == 0.0f; }));
  EXPECT_TRUE(std::any_of(cuda.begin() + width, cuda.end(), [](float v) { return v != 0.0f; }));
  summary.Add(NormalizedError(cuda, cpu));
}

struct CacheCase {
  MlaShape shape;
  std::int64_t top_k;  // 0: dense
};

// The same inputs through both backends with a cache of `kv_dtype` (BF16 or FP8 rows).
void ExpectRoundedCacheMatchesCpu(DType kv_dtype, std::uint64_t seed, const std::vector<CacheCase>& cases,
                                  const char* label) {
  std::mt19937_64 rng = MakeRng(seed);
  const bool small = std::getenv("NQ_SANITIZE_SMALL") != nullptr;
  ErrorSummary summary(label, kTolerance);
  for (const CacheCase& c : cases) {
    const MlaShape& m = c.shape;
    if (small && m.keys * m.heads > 4000) continue;
    SCOPED_TRACE(absl::StrCat("T=", m.tokens, " H=", m.heads, " c=", m.c, " S=", m.keys, " top_k=", c.top_k));
    const MlaInputs in = RandomMlaInputs(rng, m, DType::kBF16, DType::kBF16, 0.05f);
    const std::vector<std::int32_t> selected =
        c.top_k > 0 ? RandomSelection(rng, m, c.top_k, true) : std::vector<std::int32_t>{};
    summary.Add(NormalizedError(RunMlaAttention(*Backends().cuda, m, in, DType::kBF16, DType::kBF16, selected,
                                                c.top_k, Scale(m), kv_dtype),
                                RunMlaAttention(*Backends().cpu, m, in, DType::kBF16, DType::kBF16, selected,
                                                c.top_k, Scale(m), kv_dtype)));
  }
}

// A BF16 cache on both backends (the CPU widens it exactly): the split kernels' two-MMA path and
// the per-(query, head) kernel's BF16 loads.
TEST(CudaMlaAttention, Bf16CacheMatchesCpu) {
  if (Backends().cuda == nullptr) return;
  ExpectRoundedCacheMatchesCpu(
      DType::kBF16, 3606,
      {{{.tokens = 1, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 4097, .start_pos = 4096}, 0},
       {{.tokens = 4, .heads = 20, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 900, .start_pos = 896}, 0},
       {{.tokens = 2, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 3000, .start_pos = 2998}, 2048},
       {{.tokens = 1, .heads = 5, .dn = 8, .dr = 16, .c = 16, .dv = 8, .keys = 200, .start_pos = 199}, 0},
       // The per-(query, head) kernel: more queries than the split kernels take, and c = 40.
       {{.tokens = 70, .heads = 2, .dn = 16, .dr = 16, .c = 32, .dv = 8, .keys = 90, .start_pos = 20}, 0},
       {{.tokens = 3, .heads = 2, .dn = 16, .dr = 8, .c = 40, .dv = 12, .keys = 90, .start_pos = 80}, 70}},
      "MlaAttention BF16 cache");
}

// An FP8 cache (packed rows, kernels/kv_fp8.h, with a BF16 rope key) on both backends: the split
// kernels copy the rows as stored and unpack them per tile; the per-(query, head) kernel unpacks
// each value it reads. glm5_nano's c = 64 has padded rows and one partial scale tile.
TEST(CudaMlaAttention, Fp8CacheMatchesCpu) {
  if (Backends().cuda == nullptr) return;
  ExpectRoundedCacheMatchesCpu(
      DType::kF8E4M3, 3607,
      {{{.tokens = 1, .heads = 16, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 4097, .start_pos = 4096}, 0},
       {{.tokens = 4, .heads = 20, .dn = 128, .dr = 64, .c = 512, .dv = 128, .keys = 900, .start_pos = 896}, 0},
       {{.tokens = 2, .heads = 64, .dn = 192, .dr = 64, .c = 512, .dv = 256, .keys = 3000, .start_pos = 2998}, 2048},
       {{.tokens = 1, .heads = 8, .dn = 32, .dr = 16, .c = 64, .dv = 32, .keys = 300, .start_pos = 299}, 0},
       {{.tokens = 4, .heads = 8, .dn = 32, .dr = 16, .c = 64, .dv = 32, .keys = 300, .start_pos = 296}, 100},
       // The per-(query, head) kernel: more queries than the split kernels take, and c = 40.
       {{.tokens = 70, .heads = 2, .dn = 16, .dr = 16, .c = 64, .dv = 8, .keys = 90, .start_pos = 20}, 0},
       {{.tokens = 3, .heads = 2, .dn = 16, .dr = 8, .c = 40, .dv = 12, .keys = 90, .start_pos = 80}, 70}},
      "MlaAttention FP8 cache");
}

// Small enough for compute-sanitizer's racecheck: several key tiles, masked and empty rows.
TEST(CudaMlaAttention, TinySelectedMatchesCpu) {
  if (Backends().cuda == nullptr) return;
  std::mt19937_64 rng = MakeRng(3603);
  const MlaShape m{
      .tokens = 3, .heads = 2, .dn = 16, .dr = 8, .c = 40, .dv = 12, .keys = 90, .start_pos = 80};
  const MlaInputs in = RandomMlaInputs(rng, m, DType::kBF16, DType::kF32, 0.1f);
  constexpr std::int64_t kTopK = 70;
  ErrorSummary summary("MlaAttention tiny", kTolerance);
  for (bool dense : {true, false}) {
    const std::vector<std::int32_t> selected =
        dense ? std::vector<std::int32_t>{} : RandomSelection(rng, m, kTopK, true);
    const std::int64_t top_k = dense ? 0 : kTopK;
    summary.Add(NormalizedError(RunMlaAttention(*Backends().cuda, m, in, DType::kBF16, DType::kF32,
                                                selected, top_k, Scale(m)),
                                RunMlaAttention(*Backends().cpu, m, in, DType::kBF16, DType::kF32,
                                                selected, top_k, Scale(m))));
  }
}

}  // namespace
}  // namespace nq::kernels
