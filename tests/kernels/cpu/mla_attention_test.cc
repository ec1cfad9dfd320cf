// The CPU backend's float64 MlaAttention reference (BackendOptions::cpu_float64_attention)
// against HF's non-absorbed form in double: dense causal prefill, chunked prefill and decode at
// start_pos > 0, DSA selected keys with -1 padding, BF16 weights. Decode calls reproducing a
// prefill's rows and a full selection equalling dense, for the reference and for the fp32
// serving kernel (which mla_attention_fp32_test.cc compares with the reference); argument errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "kernels/kv_fp8.h"
#include "tests/kernels/model_ref.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::AllocateOrFail;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeCpuReferenceBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::MlaInputs;
using ::nq::kernels::testing::MlaShape;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomInt;
using ::nq::kernels::testing::RandomMlaInputs;
using ::nq::kernels::testing::RefMlaAttention;
using ::nq::kernels::testing::RunMlaAttention;
using ::nq::kernels::testing::StatusIs;
using ::nq::kernels::testing::UploadI32;
using ::testing::HasSubstr;

// Everything in double but the inputs and the final rounding; the reference sums in another
// order (decompressed keys), so agreement is to a few fp32 ulps of the largest output.
constexpr double kTolerance = 1e-6;

float Scale(const MlaShape& m) { return 1.0f / std::sqrt(static_cast<float>(m.dn + m.dr)); }

// Rows [first, first + count) of a [tokens, width] output.
std::vector<float> Rows(const std::vector<float>& x, std::int64_t width, std::int64_t first,
                        std::int64_t count) {
  return std::vector<float>(x.begin() + first * width, x.begin() + (first + count) * width);
}

// The fp32 serving kernel and the float64 reference, for the properties both must keep.
std::vector<std::unique_ptr<Backend>> BothKernels() {
  std::vector<std::unique_ptr<Backend>> backends;
  backends.push_back(MakeCpuBackend());
  backends.push_back(MakeCpuReferenceBackend());
  return backends;
}

TEST(CpuMlaAttention, DenseCausalMatchesNonAbsorbedReference) {
  std::mt19937_64 rng = MakeRng(2601);
  std::unique_ptr<Backend> backend = MakeCpuReferenceBackend();
  std::vector<MlaShape> cases = {
      {.tokens = 1, .heads = 1, .dn = 1, .dr = 2, .c = 1, .dv = 1, .keys = 1},
      {.tokens = 5, .heads = 3, .dn = 8, .dr = 4, .c = 16, .dv = 8, .keys = 5},
      // Chunked prefill: 4 new tokens after 6 cached; a cache longer than needed.
      {.tokens = 4, .heads = 2, .dn = 16, .dr = 8, .c = 32, .dv = 16, .keys = 12, .start_pos = 6},
      // 20 heads: more than one head group per token; enough work for both threads.
      {.tokens = 9, .heads = 20, .dn = 32, .dr = 16, .c = 64, .dv = 24, .keys = 9}};
  for (int i = 0; i < 3; ++i) {
    const std::int64_t tokens = RandomInt(rng, 1, 8);
    const std::int64_t start = RandomInt(rng, 0, 10);
    cases.push_back({.tokens = tokens,
                     .heads = RandomInt(rng, 1, 5),
                     .dn = RandomInt(rng, 1, 24),
                     .dr = RandomInt(rng, 0, 8),
                     .c = RandomInt(rng, 1, 40),
                     .dv = RandomInt(rng, 1, 20),
                     .keys = start + tokens + RandomInt(rng, 0, 3),
                     .start_pos = start});
  }
  for (const auto& [uk, uv] : {std::pair{DType::kF32, DType::kF32},
                               {DType::kBF16, DType::kBF16},
                               {DType::kF32, DType::kBF16}}) {
    for (const MlaShape& m : cases) {
      SCOPED_TRACE(absl::StrCat("w_uk ", DTypeName(uk), " w_uv ", DTypeName(uv), " T=", m.tokens,
                                " H=", m.heads, " dn=", m.dn, " dr=", m.dr, " c=", m.c,
                                " dv=", m.dv, " S=", m.keys, " start=", m.start_pos));
      const MlaInputs in = RandomMlaInputs(rng, m, uk, uv);
      EXPECT_LT(NormalizedError(RunMlaAttention(*backend, m, in, uk, uv, {}, 0, Scale(m)),
                                RefMlaAttention(m, in, {}, 0, Scale(m))),
                kTolerance);
    }
  }
}

TEST(CpuMlaAttention, DecodeCallsMatchTheRowsOfAPrefillCall) {
  std::mt19937_64 rng = MakeRng(2602);
  const MlaShape prefill{.tokens = 7, .heads = 4, .dn = 16, .dr = 8, .c = 32, .dv = 16, .keys = 7};
  const MlaInputs in = RandomMlaInputs(rng, prefill, DType::kBF16, DType::kBF16);
  for (const std::unique_ptr<Backend>& backend : BothKernels()) {
    SCOPED_TRACE(backend->DeviceDescription());
    const std::int64_t width = prefill.heads * prefill.dv;
    const std::vector<float> full =
        RunMlaAttention(*backend, prefill, in, DType::kBF16, DType::kBF16, {}, 0, Scale(prefill));
    // Token by token (decode), then a chunk of 3 at start_pos 2, against the same full cache.
    for (const auto& [first, count] :
         {std::pair<std::int64_t, std::int64_t>{0, 1}, {3, 1}, {6, 1}, {2, 3}}) {
      MlaShape m = prefill;
      m.tokens = count;
      m.start_pos = first;
      MlaInputs part = in;
      const std::int64_t q_nope_row = prefill.heads * prefill.dn;
      const std::int64_t q_pe_row = prefill.heads * prefill.dr;
      part.q_nope.assign(in.q_nope.begin() + first * q_nope_row,
                         in.q_nope.begin() + (first + count) * q_nope_row);
      part.q_pe.assign(in.q_pe.begin() + first * q_pe_row,
                       in.q_pe.begin() + (first + count) * q_pe_row);
      const std::vector<float> got =
          RunMlaAttention(*backend, m, part, DType::kBF16, DType::kBF16, {}, 0, Scale(m));
      EXPECT_EQ(got, Rows(full, width, first, count)) << "first=" << first << " count=" << count;
    }
  }
}

TEST(CpuMlaAttention, SelectedKeysMaskPadAndIgnoreInvisibleEntries) {
  std::mt19937_64 rng = MakeRng(2603);
  std::unique_ptr<Backend> backend = MakeCpuReferenceBackend();
  const MlaShape m{
      .tokens = 6, .heads = 3, .dn = 8, .dr = 4, .c = 16, .dv = 8, .keys = 16, .start_pos = 10};
  const MlaInputs in = RandomMlaInputs(rng, m, DType::kF32, DType::kBF16);
  constexpr std::int64_t kTopK = 5;
  // Row 0: three visible keys and -1 padding; row 1: a duplicate-free full set with an invisible
  // key (15 > position 11) that must be ignored; row 2: nothing visible (zeros); the others random
  // distinct visible keys, some padded.
  std::vector<std::int32_t> selected = {4,  0,  9,  -1, -1,  //
                                        11, 2,  15, 7,  1,   //
                                        -1, -1, -1, -1, -1};
  for (std::int64_t t = 3; t < m.tokens; ++t) {
    std::vector<std::int32_t> keys(m.start_pos + t + 1);
    std::iota(keys.begin(), keys.end(), 0);
    std::shuffle(keys.begin(), keys.end(), rng);
    const std::int64_t used = RandomInt(rng, 1, kTopK);
    for (std::int64_t k = 0; k < kTopK; ++k) selected.push_back(k < used ? keys[k] : -1);
  }
  const std::vector<float> got =
      RunMlaAttention(*backend, m, in, DType::kF32, DType::kBF16, selected, kTopK, Scale(m));
  const std::vector<double> want = RefMlaAttention(m, in, selected, kTopK, Scale(m));
  EXPECT_LT(NormalizedError(got, want), kTolerance);
  const std::int64_t width = m.heads * m.dv;
  EXPECT_THAT(Rows(got, width, 2, 1), ::testing::Each(0.0f));
  // The selection must matter: dense attention differs.
  EXPECT_GT(NormalizedError(
                RunMlaAttention(*backend, m, in, DType::kF32, DType::kBF16, {}, 0, Scale(m)), want),
            1e-3);
}

TEST(CpuMlaAttention, SelectingEveryVisibleKeyEqualsDense) {
  std::mt19937_64 rng = MakeRng(2604);
  const MlaShape m{
      .tokens = 4, .heads = 2, .dn = 8, .dr = 4, .c = 16, .dv = 8, .keys = 6, .start_pos = 2};
  const MlaInputs in = RandomMlaInputs(rng, m, DType::kF32, DType::kF32);
  // K = 6 columns: each row lists its visible keys in reverse order, then -1.
  constexpr std::int64_t kTopK = 6;
  std::vector<std::int32_t> selected;
  for (std::int64_t t = 0; t < m.tokens; ++t) {
    for (std::int64_t k = 0; k < kTopK; ++k) {
      const std::int64_t s = m.start_pos + t - k;
      selected.push_back(s >= 0 ? static_cast<std::int32_t>(s) : -1);
    }
  }
  for (const std::unique_ptr<Backend>& backend : BothKernels()) {
    EXPECT_LT(
        NormalizedError(
            RunMlaAttention(*backend, m, in, DType::kF32, DType::kF32, selected, kTopK, Scale(m)),
            RunMlaAttention(*backend, m, in, DType::kF32, DType::kF32, {}, 0, Scale(m))),
        kTolerance)
        << backend->DeviceDescription();
  }
}

// A BF16 cache is its values widened: the same result, bit for bit, as an F32 cache holding the
// BF16-rounded values (dense and DSA, decode and prefill).
// A cache of `dtype` holding `in`'s values must attend exactly like an F32 cache holding
// `stored`, the values that dtype keeps of them: dense, and over a DSA selection.
void ExpectAttendsLikeAnF32Cache(Backend& backend, const MlaShape& m, const MlaInputs& in, const MlaInputs& stored,
                                 DType dtype) {
  constexpr std::int64_t kTopK = 9;
  std::vector<std::int32_t> selected;
  for (std::int64_t t = 0; t < m.tokens; ++t) {
    for (std::int64_t k = 0; k < kTopK; ++k) selected.push_back(static_cast<std::int32_t>((7 * k + t) % 33));
  }
  for (bool dense : {true, false}) {
    SCOPED_TRACE(dense ? "dense" : "selected");
    const std::span<const std::int32_t> sel = dense ? std::span<const std::int32_t>() : selected;
    const std::int64_t top_k = dense ? 0 : kTopK;
    const std::vector<float> rounded =
        RunMlaAttention(backend, m, in, DType::kBF16, DType::kBF16, sel, top_k, Scale(m), dtype);
    const std::vector<float> f32 =
        RunMlaAttention(backend, m, stored, DType::kBF16, DType::kBF16, sel, top_k, Scale(m), DType::kF32);
    EXPECT_EQ(rounded, f32);
    EXPECT_NE(rounded, RunMlaAttention(backend, m, in, DType::kBF16, DType::kBF16, sel, top_k, Scale(m)));
  }
}

TEST(CpuMlaAttention, Bf16CacheEqualsAnF32CacheOfTheRoundedValues) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(3701);
  const MlaShape m{.tokens = 3, .heads = 4, .dn = 16, .dr = 8, .c = 32, .dv = 12, .keys = 40, .start_pos = 30};
  MlaInputs in = RandomMlaInputs(rng, m, DType::kBF16, DType::kBF16, 0.1f);
  MlaInputs rounded = in;
  for (std::vector<float>* v : {&rounded.kv_latent, &rounded.k_pe}) {
    for (float& x : *v) x = ToFloat(ToBf16(x));
  }
  ASSERT_NE(rounded.kv_latent, in.kv_latent);  // the rounding is not a no-op on these values
  ExpectAttendsLikeAnF32Cache(*backend, m, in, rounded, DType::kBF16);
}

// An FP8 cache (packed E4M3 rows with a scale per 128 values, kernels/kv_fp8.h, and a BF16 rope
// key) attends exactly like an F32 cache holding the values those rows unpack to: dense and
// DSA-selected, a latent of one whole tile and a partial second one (c = 160).
TEST(CpuMlaAttention, Fp8CacheEqualsAnF32CacheOfTheUnpackedValues) {
  std::unique_ptr<Backend> backend = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(3702);
  const MlaShape m{.tokens = 3, .heads = 4, .dn = 16, .dr = 8, .c = 160, .dv = 12, .keys = 40, .start_pos = 30};
  MlaInputs in = RandomMlaInputs(rng, m, DType::kBF16, DType::kBF16, 0.1f);
  MlaInputs unpacked = in;
  std::vector<std::uint8_t> row(static_cast<std::size_t>(KvFp8RowBytes(m.c)));
  for (std::int64_t s = 0; s < m.keys; ++s) {
    PackKvFp8Row(in.kv_latent.data() + s * m.c, m.c, row.data());
    UnpackKvFp8Row(row.data(), m.c, unpacked.kv_latent.data() + s * m.c);
  }
  for (float& x : unpacked.k_pe) x = ToFloat(ToBf16(x));
  ASSERT_NE(unpacked.kv_latent, in.kv_latent);  // FP8 rounds these values
  ExpectAttendsLikeAnF32Cache(*backend, m, in, unpacked, DType::kF8E4M3);
}

class CpuMlaAttentionErrors : public ::testing::Test {
 protected:
  absl::Status Call(const Tensor* selected = nullptr, std::int64_t start_pos = 2) {
    return backend_->MlaAttention(q_nope_, q_pe_, kv_, k_pe_, w_uk_, w_uv_, selected, start_pos,
                                  0.1f, out_);
  }
  Tensor F32(Shape shape) { return AllocateOrFail(*backend_, DType::kF32, std::move(shape)); }

  std::unique_ptr<Backend> backend_ = MakeCpuBackend();
  // T = 3, H = 2, dn = 4, dr = 2, c = 8, dv = 5, S = 6.
  Tensor q_nope_ = F32({3, 2, 4});
  Tensor q_pe_ = F32({3, 2, 2});
  Tensor kv_ = F32({6, 8});
  Tensor k_pe_ = F32({6, 2});
  Tensor w_uk_ = AllocateOrFail(*backend_, DType::kBF16, {2, 4, 8});
  Tensor w_uv_ = AllocateOrFail(*backend_, DType::kBF16, {2, 5, 8});
  Tensor out_ = F32({3, 10});
};

TEST_F(CpuMlaAttentionErrors, AcceptsTheBaseArguments) { NQ_EXPECT_OK(Call()); }

TEST_F(CpuMlaAttentionErrors, RejectsQueriesThatDisagree) {
  q_pe_ = F32({3, 3, 2});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("MlaAttention: q_pe is F32[3, 3, 2], expected [3, 2, 2] "
                                         "from q_nope F32[3, 2, 4]")));
}

TEST_F(CpuMlaAttentionErrors, RejectsCacheRowsThatDisagree) {
  k_pe_ = F32({5, 2});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("MlaAttention: k_pe is F32[5, 2], expected [6, 2] from "
                                         "kv_latent F32[6, 8] and q_pe F32[3, 2, 2]")));
}

TEST_F(CpuMlaAttentionErrors, RejectsACacheOfOtherDTypes) {
  kv_ = AllocateOrFail(*backend_, DType::kF16, {6, 8});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MlaAttention: kv_latent")));
  kv_ = AllocateOrFail(*backend_, DType::kBF16, {6, 8});  // k_pe stays F32
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("MlaAttention: k_pe must be BF16, got F32[6, 2]")));
  k_pe_ = AllocateOrFail(*backend_, DType::kBF16, {6, 2});
  NQ_EXPECT_OK(Call());
  // Packed FP8 rows: KvFp8RowBytes(8) = 16 bytes a row for w_uk's 8 latent values (8 codes, a
  // scale, padding), rope key BF16.
  kv_ = AllocateOrFail(*backend_, DType::kU8, {6, 8});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("is not packed FP8 rows of w_uk BF16[2, 4, 8]'s 8 latent values (16 bytes a row)")));
  kv_ = AllocateOrFail(*backend_, DType::kU8, {6, 16});
  std::memset(kv_.data(), 0, kv_.nbytes());
  k_pe_ = F32({6, 2});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("MlaAttention: k_pe must be BF16")));
  k_pe_ = AllocateOrFail(*backend_, DType::kBF16, {6, 2});
  NQ_EXPECT_OK(Call());
}

TEST_F(CpuMlaAttentionErrors, RejectsWeightsOfWrongShapeOrDType) {
  w_uk_ = AllocateOrFail(*backend_, DType::kBF16, {2, 8, 4});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("MlaAttention: w_uk is BF16[2, 8, 4], expected [2, 4, 8] "
                                         "from q_nope F32[3, 2, 4] and kv_latent F32[6, 8]")));
  w_uk_ = AllocateOrFail(*backend_, DType::kF16, {2, 4, 8});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("MlaAttention: w_uk must be F32 or BF16, got "
                                         "F16[2, 4, 8]")));
  w_uk_ = F32({2, 4, 8});
  w_uv_ = F32({3, 5, 8});
  EXPECT_THAT(Call(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MlaAttention: w_uv is F32[3, 5, 8], expected [2, 5, 8]")));
}

TEST_F(CpuMlaAttentionErrors, RejectsWrongOutput) {
  out_ = F32({3, 8});
  EXPECT_THAT(Call(), StatusIs(absl::StatusCode::kInvalidArgument,
                               HasSubstr("MlaAttention: out is F32[3, 8], expected [3, 10] from "
                                         "q_nope F32[3, 2, 4] and w_uv BF16[2, 5, 8]")));
}

TEST_F(CpuMlaAttentionErrors, RejectsPositionsPastTheCache) {
  EXPECT_THAT(Call(nullptr, 4),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MlaAttention: start_pos 4 + 3 tokens exceeds the 6 keys of "
                                 "kv_latent F32[6, 8]")));
  EXPECT_THAT(Call(nullptr, -1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MlaAttention: start_pos must be >= 0, got -1")));
}

TEST_F(CpuMlaAttentionErrors, RejectsBadSelection) {
  Tensor f32 = F32({3, 4});
  EXPECT_THAT(Call(&f32), StatusIs(absl::StatusCode::kInvalidArgument,
                                   HasSubstr("MlaAttention: selected must be I32, got F32[3, 4]")));
  Tensor rows = UploadI32(*backend_, std::vector<std::int32_t>(8, 0), {2, 4});
  EXPECT_THAT(Call(&rows), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("MlaAttention: selected I32[2, 4] must be [3, K] "
                                              "with K >= 1")));
  Tensor none = AllocateOrFail(*backend_, DType::kI32, {3, 0});
  EXPECT_THAT(Call(&none), StatusIs(absl::StatusCode::kInvalidArgument,
                                    HasSubstr("selected I32[3, 0] must be [3, K] with K >= 1")));
}

TEST_F(CpuMlaAttentionErrors, RejectsNonFiniteScaleAndForeignTensors) {
  EXPECT_THAT(backend_->MlaAttention(q_nope_, q_pe_, kv_, k_pe_, w_uk_, w_uv_, nullptr, 0,
                                     std::numeric_limits<float>::infinity(), out_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MlaAttention: scale must be finite, got inf")));
  std::unique_ptr<Backend> other = MakeCpuBackend();
  Tensor foreign_kv = AllocateOrFail(*other, DType::kF32, {6, 8});
  EXPECT_THAT(backend_->MlaAttention(q_nope_, q_pe_, foreign_kv, k_pe_, w_uk_, w_uv_, nullptr, 0,
                                     0.1f, out_),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("MlaAttention: kv_latent F32[6, 8] belongs to another backend")));
}

}  // namespace
}  // namespace nq::kernels
