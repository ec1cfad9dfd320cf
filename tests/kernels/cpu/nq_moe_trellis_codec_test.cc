// The CPU NqMoe op on a layer coded by the real trellis_v1 encoder: random expert matrices go
// through TrellisCodec::Encode; the reference decodes them with TrellisCodec::Decode (rotation
// undone by the codec) and runs the dense MoE math in double; the op gets the packed planes,
// gains, scales and the rotations' signs, as a release would give them. 2 bits, 4 bits and a mix.
// Shapes are tiny: the Viterbi encoder is the slow part.
#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/backend.h"
#include "services/quant/hadamard.h"
#include "services/quant/trellis_codec.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels {
namespace {

using ::nq::kernels::testing::Download;
using ::nq::kernels::testing::MakeCpuBackend;
using ::nq::kernels::testing::MakeRng;
using ::nq::kernels::testing::NormalizedError;
using ::nq::kernels::testing::RandomNormal;
using ::nq::kernels::testing::Upload;
using ::nq::kernels::testing::UploadI32;

constexpr std::int64_t kD = 32, kI = 16, kE = 3, kK = 2, kT = 4;
// gate/up share one rotation (the op rotates a token's input once); down has its own.
constexpr quant::RotationParams kGateUpRotation{.row_block = 16, .col_block = 32, .row_sign_seed = 11, .col_sign_seed = 12};
constexpr quant::RotationParams kDownRotation{.row_block = 32, .col_block = 16, .row_sign_seed = 13, .col_sign_seed = 14};

struct CodedProjection {
  std::vector<quant::EncodedMatrix> experts;
  std::vector<std::vector<float>> dense2, dense4;  // TrellisCodec::Decode of each expert
};

CodedProjection Code(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, const quant::RotationParams& rotation) {
  const quant::TrellisCodec codec;
  CodedProjection c;
  for (std::int64_t e = 0; e < kE; ++e) {
    const std::vector<float> w = RandomNormal(rng, rows * cols, 0.05f);
    absl::StatusOr<quant::EncodedMatrix> m =
        codec.Encode(w, rows, cols, nullptr, {.keep_residual = true, .rotation = rotation});
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return c;
    std::vector<float> two(static_cast<size_t>(rows * cols)), four(two.size());
    NQ_EXPECT_OK(codec.Decode(*m, quant::Precision::k2Bit, two));
    NQ_EXPECT_OK(codec.Decode(*m, quant::Precision::k4Bit, four));
    c.experts.push_back(*std::move(m));
    c.dense2.push_back(std::move(two));
    c.dense4.push_back(std::move(four));
  }
  return c;
}

// The op's NqProjection from the encoded experts; residual planes go to the arena at `offset`.
NqProjection Pack(Backend& cpu, const CodedProjection& c, std::int64_t offset) {
  const std::int64_t rows = c.experts[0].rows, cols = c.experts[0].cols;
  std::vector<std::uint8_t> base;
  std::vector<float> rs, cs, gains;
  for (const quant::EncodedMatrix& m : c.experts) {
    base.insert(base.end(), m.base_codes.begin(), m.base_codes.end());
    rs.insert(rs.end(), m.row_scales.begin(), m.row_scales.end());
    cs.insert(cs.end(), m.col_scales.begin(), m.col_scales.end());
    for (size_t b = 0; b < m.params.base_codebook.size(); ++b) {
      gains.push_back(m.params.base_codebook[b]);
      gains.push_back(m.params.residual_codebook[b]);
    }
  }
  NqProjection p;
  absl::StatusOr<Tensor> t = cpu.Allocate(DType::kU8, Shape{kE, NqPlaneBytes(rows, cols)});
  if (!t.ok()) {
    ADD_FAILURE() << t.status();
    return p;
  }
  p.base = *std::move(t);
  NQ_EXPECT_OK(cpu.CopyFromHost(std::as_bytes(std::span<const std::uint8_t>(base)), p.base));
  p.row_scales = Upload(cpu, rs, DType::kF32, {kE, rows});
  p.col_scales = Upload(cpu, cs, DType::kF32, {kE, cols});
  p.gains = Upload(cpu, gains, DType::kF32, {kE, cols / 16, 2});
  p.residual_offset = offset;
  return p;
}

NqRotation Rotation(Backend& cpu, std::uint64_t seed, std::int64_t n, std::int64_t block) {
  return {Upload(cpu, quant::RandomSigns(seed, n), DType::kF32, {n}), block};
}

// sum_k w_k * down(silu(gate x) * up x) with the decoded dense matrices, in double.
std::vector<double> DenseMoe(const CodedProjection& gate, const CodedProjection& up, const CodedProjection& down,
                             const std::vector<float>& x, const std::vector<std::int32_t>& ids,
                             const std::vector<float>& weights, const std::vector<std::int32_t>& slots) {
  std::vector<double> out(static_cast<size_t>(kT * kD), 0.0);
  for (std::int64_t t = 0; t < kT; ++t) {
    for (std::int64_t k = 0; k < kK; ++k) {
      const std::int32_t e = ids[t * kK + k];
      const bool four = slots[e] >= 0;
      const std::vector<float>& wg = four ? gate.dense4[e] : gate.dense2[e];
      const std::vector<float>& wu = four ? up.dense4[e] : up.dense2[e];
      const std::vector<float>& wd = four ? down.dense4[e] : down.dense2[e];
      std::vector<double> act(kI);
      for (std::int64_t i = 0; i < kI; ++i) {
        double g = 0, u = 0;
        for (std::int64_t j = 0; j < kD; ++j) {
          g += static_cast<double>(wg[i * kD + j]) * x[t * kD + j];
          u += static_cast<double>(wu[i * kD + j]) * x[t * kD + j];
        }
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (std::int64_t i = 0; i < kD; ++i) {
        double y = 0;
        for (std::int64_t j = 0; j < kI; ++j) y += static_cast<double>(wd[i * kI + j]) * act[j];
        out[t * kD + i] += weights[t * kK + k] * y;
      }
    }
  }
  return out;
}

TEST(CpuNqMoeTrellisCodec, MatchesTheCodecsDenseDecodeAtTwoFourAndMixedBits) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend();
  std::mt19937_64 rng = MakeRng(4221);
  const CodedProjection gate = Code(rng, kI, kD, kGateUpRotation);
  const CodedProjection up = Code(rng, kI, kD, kGateUpRotation);
  const CodedProjection down = Code(rng, kD, kI, kDownRotation);
  ASSERT_FALSE(::testing::Test::HasFailure()) << "an encode failed; the projections are incomplete";
  const std::int64_t plane = NqPlaneBytes(kI, kD);  // every projection has I * D weights
  const std::int64_t slot_bytes = 3 * plane;

  NqMoeWeights w;
  w.codec = NqCodec::kTrellis;
  w.hidden = kD;
  w.intermediate = kI;
  w.num_experts = kE;
  w.gate = Pack(*cpu, gate, 0);
  w.up = Pack(*cpu, up, plane);
  w.down = Pack(*cpu, down, 2 * plane);
  w.input = Rotation(*cpu, kGateUpRotation.col_sign_seed, kD, kGateUpRotation.col_block);
  w.gate_rows = Rotation(*cpu, kGateUpRotation.row_sign_seed, kI, kGateUpRotation.row_block);
  w.down_cols = Rotation(*cpu, kDownRotation.col_sign_seed, kI, kDownRotation.col_block);
  w.down_rows = Rotation(*cpu, kDownRotation.row_sign_seed, kD, kDownRotation.row_block);

  const std::vector<float> x = RandomNormal(rng, kT * kD, 1.0f);
  const std::vector<std::int32_t> ids = {0, 1, 2, 0, 1, 2, 2, 1};
  const std::vector<float> weights = {0.6f, 0.4f, 0.9f, 0.1f, 0.5f, 0.5f, 0.3f, 0.7f};
  Tensor tx = Upload(*cpu, x, DType::kF32, {kT, kD});
  Tensor tids = UploadI32(*cpu, ids, {kT, kK});
  Tensor tw = Upload(*cpu, weights, DType::kF32, {kT, kK});

  double largest_change = 0.0;
  std::vector<float> two_bit_out;
  for (const std::vector<std::int32_t>& slots :
       {std::vector<std::int32_t>{-1, -1, -1}, std::vector<std::int32_t>{0, 1, 2}, std::vector<std::int32_t>{-1, 0, -1}}) {
    // Each expert in a slot gets its residual planes there, at the projections' offsets.
    std::vector<std::uint8_t> arena(static_cast<size_t>(kE * slot_bytes), 0);
    for (std::int64_t e = 0; e < kE; ++e) {
      if (slots[e] < 0) continue;
      std::uint8_t* slot = arena.data() + slots[e] * slot_bytes;
      for (const CodedProjection* c : {&gate, &up, &down}) {
        const std::vector<std::uint8_t>& r = c->experts[e].residual_codes;
        ASSERT_EQ(static_cast<std::int64_t>(r.size()), plane);
        std::copy(r.begin(), r.end(), slot + (c == &gate ? 0 : c == &up ? plane : 2 * plane));
      }
    }
    absl::StatusOr<Tensor> tarena = cpu->Allocate(DType::kU8, Shape{kE * slot_bytes});
    ASSERT_TRUE(tarena.ok());
    NQ_ASSERT_OK(cpu->CopyFromHost(std::as_bytes(std::span<const std::uint8_t>(arena)), *tarena));
    Tensor table = UploadI32(*cpu, slots, {kE});
    const NqSlots s{.slot_of_expert = &table,
                    .arena = static_cast<const std::byte*>(tarena->data()),
                    .slot_bytes = slot_bytes,
                    .num_slots = kE};
    absl::StatusOr<Tensor> out = cpu->Allocate(DType::kF32, Shape{kT, kD});
    ASSERT_TRUE(out.ok());
    NQ_ASSERT_OK(cpu->NqMoe(tx, tids, tw, w, s, *out));
    const std::vector<float> got = Download(*cpu, *out);
    const std::vector<double> want = DenseMoe(gate, up, down, x, ids, weights, slots);
    EXPECT_LT(NormalizedError(got, want), 1e-5) << "slots " << slots[0] << " " << slots[1] << " " << slots[2];
    if (two_bit_out.empty()) {
      two_bit_out = got;
    } else {
      // The residual must matter (else a 4-bit path reading nothing would pass too).
      largest_change = std::max(largest_change, NormalizedError(got, two_bit_out));
    }
  }
  EXPECT_GT(largest_change, 1e-2);
}

}  // namespace
}  // namespace nq::kernels
