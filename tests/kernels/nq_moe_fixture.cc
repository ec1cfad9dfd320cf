#include "tests/kernels/nq_moe_fixture.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/dtype.h"
#include "kernels/tensor_io.h"
#include "services/quant/trellis_decode.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels::testing {
namespace {

constexpr std::int64_t kSegmentAlign = 256;  // record segments start on 256-byte boundaries
constexpr std::int64_t kRecordAlign = 4096;  // records are whole O_DIRECT pages

std::int64_t RoundUp(std::int64_t v, std::int64_t a) { return (v + a - 1) / a * a; }

NqProjectionHost RandomProjection(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, std::int64_t experts) {
  NqProjectionHost p{.rows = rows, .cols = cols};
  const std::int64_t plane = NqPlaneBytes(rows, cols);
  std::uniform_int_distribution<int> byte(0, 255);
  p.base.resize(static_cast<size_t>(experts * plane));
  p.residual.resize(p.base.size());
  for (auto& b : p.base) b = static_cast<std::uint8_t>(byte(rng));
  for (auto& b : p.residual) b = static_cast<std::uint8_t>(byte(rng));
  p.row_scales = RandomUniform(rng, experts * rows, 0.02f, 0.06f);
  p.col_scales = RandomUniform(rng, experts * cols, 0.5f, 1.5f);
  const float design[4] = {-1.51f, -0.453f, 0.453f, 1.51f};
  const float offsets[4] = {-0.25f, -0.08f, 0.08f, 0.25f};
  std::normal_distribution<float> jitter(0.0f, 0.02f);
  // Levels on the fp16 grid, as nq encode writes them (services/quant/nested_codebook.h).
  auto snap = [](float v) { return ToFloat(ToF16(v)); };
  for (std::int64_t e = 0; e < experts; ++e) {
    float table[kNqLevelTable];
    // Even experts: base levels on an even grid whose step has 9 significant bits (nq encode's
    // default, quant::BaseGrid::kUniform); odd experts: free levels (kLloyd); every fourth
    // (e % 4 == 2) uniform nested levels, the 4-bit ones too (kUniformNested, a step of 7
    // significant bits). Every decode runs in every test of three or more experts, also side by
    // side in one chunk.
    if (e % 4 == 2) {
      const float step = std::nearbyint((1.0f + jitter(rng)) * 64.0f) / 64.0f;
      for (int b = 0; b < 4; ++b) table[b] = step * (b - 1.5f);
      for (int k = 0; k < 16; ++k) table[kNqBaseLevels + k] = 0.25f * (step * (k - 7.5f));
    } else {
      if (e % 2 == 0) {
        const float step = std::nearbyint((1.0f + jitter(rng)) * 256.0f) / 256.0f;
        for (int b = 0; b < 4; ++b) table[b] = step * (b - 1.5f);
      } else {
        for (int b = 0; b < 4; ++b) table[b] = snap(design[b] + jitter(rng));
      }
      for (int b = 0; b < 4; ++b) {
        for (int r = 0; r < 4; ++r) {
          table[kNqBaseLevels + 4 * b + r] =
              snap(table[b] + (offsets[r] + jitter(rng)) * (b % 3 == 0 ? 1.6f : 1.0f));
        }
      }
    }
    p.levels.insert(p.levels.end(), table, table + kNqLevelTable);
  }
  return p;
}

NqProjectionHost RandomTrellisProjection(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols,
                                         std::int64_t experts) {
  NqProjectionHost p{.rows = rows, .cols = cols};
  const std::int64_t plane = NqPlaneBytes(rows, cols);
  std::uniform_int_distribution<int> byte(0, 255);
  p.base.resize(static_cast<size_t>(experts * plane));
  p.residual.resize(p.base.size());
  for (auto& b : p.base) b = static_cast<std::uint8_t>(byte(rng));
  for (auto& b : p.residual) b = static_cast<std::uint8_t>(byte(rng));
  p.row_scales = RandomUniform(rng, experts * rows, 0.02f, 0.06f);
  p.col_scales = RandomUniform(rng, experts * cols, 0.5f, 1.5f);
  std::uniform_real_distribution<float> base_gain(0.85f, 1.15f), residual_gain(0.2f, 0.32f);
  for (std::int64_t k = 0; k < experts * (cols / kNqTrellisBlock); ++k) {
    p.gains.push_back(base_gain(rng));
    p.gains.push_back(residual_gain(rng));
  }
  return p;
}

std::vector<float> Signs(std::mt19937_64& rng, std::int64_t n) {
  std::vector<float> s(static_cast<size_t>(n));
  std::bernoulli_distribution coin(0.5);
  for (auto& v : s) v = coin(rng) ? 1.0f : -1.0f;
  return s;
}

std::int64_t Block(std::int64_t n, std::int64_t widest) {
  std::int64_t b = 1;
  while (b * 2 <= widest && n % (b * 2) == 0) b *= 2;
  return b;
}

Tensor UploadBytes(Backend& backend, std::span<const std::uint8_t> bytes, Shape shape) {
  absl::StatusOr<Tensor> t = backend.Allocate(DType::kU8, std::move(shape));
  EXPECT_TRUE(t.ok()) << t.status();
  if (!t.ok()) return Tensor();
  const absl::Status copied = backend.CopyFromHost(std::as_bytes(bytes), *t);
  EXPECT_TRUE(copied.ok()) << copied;
  return *std::move(t);
}

NqProjection UploadProjection(Backend& backend, const NqProjectionHost& p, std::int64_t experts, std::int64_t offset) {
  NqProjection out;
  out.base = UploadBytes(backend, p.base, Shape{experts, NqPlaneBytes(p.rows, p.cols)});
  out.row_scales = Upload(backend, p.row_scales, DType::kF32, {experts, p.rows});
  out.col_scales = Upload(backend, p.col_scales, DType::kF32, {experts, p.cols});
  if (!p.levels.empty()) out.levels = Upload(backend, p.levels, DType::kF32, {experts, kNqLevelTable});
  if (!p.gains.empty()) {
    out.gains = Upload(backend, p.gains, DType::kF32, {experts, p.cols / kNqTrellisBlock, kNqGainsPerBlock});
  }
  out.residual_offset = offset;
  return out;
}

// The projection's resident low-rank factors, and where its residual-level ones lie in a slot.
void UploadLowRank(Backend& backend, const NqProjectionHost& p, std::int64_t experts, std::int64_t rank,
                   std::int64_t offset, NqProjection& out) {
  if (p.lowrank_u.empty()) return;
  out.lowrank_u = Upload(backend, p.lowrank_u, DType::kF32, {experts, p.rows, rank});
  out.lowrank_v = Upload(backend, p.lowrank_v, DType::kF32, {experts, rank, p.cols});
  out.lowrank_offset = offset;
}

// Expert e's residual-level factors of `p` as the slot holds them: fp16 U_r [rows][R], then V_r.
void PackSlotLowRank(const NqProjectionHost& p, std::int64_t e, std::int64_t rank, std::uint8_t* dst) {
  const std::int64_t nu = p.rows * rank, nv = rank * p.cols;
  auto put = [&dst](float v) {
    const std::uint16_t bits = ToF16(v).bits;
    *dst++ = static_cast<std::uint8_t>(bits & 0xff);
    *dst++ = static_cast<std::uint8_t>(bits >> 8);
  };
  for (std::int64_t k = 0; k < nu; ++k) put(p.lowrank_u4[e * nu + k]);
  for (std::int64_t k = 0; k < nv; ++k) put(p.lowrank_v4[e * nv + k]);
}

// Factors of one projection: U[i][k] ~ N(0, 1) * scale * row_scale[i], V[k][j] ~ N(0, 1 / cols),
// so (U V v)_i is about scale * row_scale[i] * |v| / sqrt(cols) against the GEMV's
// row_scale[i] * |v| (levels and column scales near 1): scale 1/4 moves it by about a quarter.
void RandomLowRank(std::mt19937_64& rng, NqProjectionHost& p, std::int64_t experts, std::int64_t rank) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto snap = [](float v) { return ToFloat(ToF16(v)); };
  const float v_scale = 1.0f / std::sqrt(static_cast<float>(p.cols));
  const float u_scale = 0.25f * std::sqrt(static_cast<float>(p.cols) / static_cast<float>(rank));
  for (std::int64_t e = 0; e < experts; ++e) {
    const float on = e % 3 == 2 ? 0.0f : 1.0f;
    for (int level = 0; level < 2; ++level) {
      std::vector<float>& u = level == 0 ? p.lowrank_u : p.lowrank_u4;
      std::vector<float>& v = level == 0 ? p.lowrank_v : p.lowrank_v4;
      // The residual level corrects what is left at 4 bits: a smaller correction.
      const float level_scale = level == 0 ? 1.0f : 0.25f;
      for (std::int64_t i = 0; i < p.rows; ++i) {
        for (std::int64_t k = 0; k < rank; ++k) {
          const float value = on * level_scale * u_scale * p.row_scales[e * p.rows + i] * normal(rng);
          u.push_back(level == 0 ? value : snap(value));
        }
      }
      for (std::int64_t k = 0; k < rank * p.cols; ++k) {
        const float value = on * v_scale * normal(rng);
        v.push_back(level == 0 ? value : snap(value));
      }
    }
  }
}

// Dense normalised Hadamard of width n with blocks of `block`, times diag(signs): the rotation R.
std::vector<double> RotationMatrix(std::span<const float> signs, std::int64_t block) {
  const std::int64_t n = static_cast<std::int64_t>(signs.size());
  std::vector<double> r(static_cast<size_t>(n * n), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(block));
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = (i / block) * block; j < (i / block + 1) * block; ++j) {
      const int parity = __builtin_popcountll(static_cast<unsigned long long>((i % block) & (j % block))) & 1;
      r[i * n + j] = (parity ? -scale : scale) * signs[j];
    }
  }
  return r;
}

// Q[i][j] of expert e of a nested_scalar_v1 projection.
float ScalarWeight(const NqProjectionHost& p, std::int64_t e, bool four_bit, std::int64_t i, std::int64_t j) {
  const std::int64_t plane = NqPlaneBytes(p.rows, p.cols), k = i * p.cols + j;
  const int b = (p.base[e * plane + k / 4] >> (2 * (k % 4))) & 3;
  const int r = (p.residual[e * plane + k / 4] >> (2 * (k % 4))) & 3;
  return four_bit ? p.levels[e * kNqLevelTable + kNqBaseLevels + 4 * b + r] : p.levels[e * kNqLevelTable + b];
}

// Q[i][j] of expert e of a trellis_v1 projection, from the tile's bytes (TileStateFromBytes: the
// byte-wise road, not the word-wise one the op takes).
float TrellisWeight(const NqProjectionHost& p, std::int64_t e, bool four_bit, std::int64_t i, std::int64_t j) {
  namespace trellis = quant::trellis;
  const std::int64_t plane = NqPlaneBytes(p.rows, p.cols);
  const std::int64_t tile = e * plane + trellis::TileByteOffset(i / 16, j / 16, p.cols);
  const int t = static_cast<int>((i % 16) * 16 + j % 16);
  const float* gains = p.gains.data() + (e * (p.cols / kNqTrellisBlock) + j / kNqTrellisBlock) * kNqGainsPerBlock;
  float q = gains[0] * trellis::UnitValue(trellis::TileStateFromBytes(p.base.data() + tile, t));
  if (four_bit) q += gains[1] * trellis::UnitValue(trellis::TileStateFromBytes(p.residual.data() + tile, t));
  return q;
}

// W = R_r^T W' R_c for expert e (rows x cols), W' from the codes.
std::vector<double> DenseExpert(NqCodec codec, const NqProjectionHost& p, std::int64_t R, std::int64_t e, bool four_bit,
                                const std::vector<double>& rr, const std::vector<double>& rc) {
  const std::int64_t rows = p.rows, cols = p.cols;
  std::vector<double> wq(static_cast<size_t>(rows * cols));
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) {
      const float q = codec == NqCodec::kTrellis ? TrellisWeight(p, e, four_bit, i, j) : ScalarWeight(p, e, four_bit, i, j);
      wq[i * cols + j] = static_cast<double>(p.row_scales[e * rows + i]) * q * p.col_scales[e * cols + j];
    }
  }
  // W' += U_b V_b (+ U_r V_r at 4 bits): the low-rank corrections, in the same rotated domain.
  if (R > 0 && !p.lowrank_u.empty()) {
    for (int level = 0; level < (four_bit ? 2 : 1); ++level) {
      const float* u = (level == 0 ? p.lowrank_u : p.lowrank_u4).data() + e * rows * R;
      const float* v = (level == 0 ? p.lowrank_v : p.lowrank_v4).data() + e * R * cols;
      for (std::int64_t i = 0; i < rows; ++i) {
        for (std::int64_t k = 0; k < R; ++k) {
          for (std::int64_t j = 0; j < cols; ++j) wq[i * cols + j] += static_cast<double>(u[i * R + k]) * v[k * cols + j];
        }
      }
    }
  }
  // tmp = W' R_c, then W = R_r^T tmp.
  std::vector<double> tmp(static_cast<size_t>(rows * cols), 0.0), w(static_cast<size_t>(rows * cols), 0.0);
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t k = 0; k < cols; ++k) {
      const double a = wq[i * cols + k];
      if (a == 0.0) continue;
      for (std::int64_t j = 0; j < cols; ++j) tmp[i * cols + j] += a * rc[k * cols + j];
    }
  }
  for (std::int64_t k = 0; k < rows; ++k) {
    for (std::int64_t i = 0; i < rows; ++i) {
      const double a = rr[k * rows + i];
      if (a == 0.0) continue;
      for (std::int64_t j = 0; j < cols; ++j) w[i * cols + j] += a * tmp[k * cols + j];
    }
  }
  return w;
}

}  // namespace

NqMoeHost RandomNqMoe(std::mt19937_64& rng, std::int64_t hidden, std::int64_t intermediate, std::int64_t experts) {
  NqMoeHost h{.hidden = hidden, .intermediate = intermediate, .num_experts = experts};
  h.gate = RandomProjection(rng, intermediate, hidden, experts);
  h.up = RandomProjection(rng, intermediate, hidden, experts);
  h.down = RandomProjection(rng, hidden, intermediate, experts);
  h.input_signs = Signs(rng, hidden);
  h.gate_row_signs = Signs(rng, intermediate);
  h.down_col_signs = Signs(rng, intermediate);
  h.down_row_signs = Signs(rng, hidden);
  // nq encode's choice: 128-wide blocks, 512 on down_proj's input.
  h.input_block = Block(hidden, 128);
  h.gate_row_block = Block(intermediate, 128);
  h.down_col_block = Block(intermediate, 512);
  h.down_row_block = Block(hidden, 128);
  return h;
}

void AddRandomLowRank(std::mt19937_64& rng, NqMoeHost& host, std::int64_t rank, bool gate_up, bool down) {
  host.lowrank_rank = rank;
  if (gate_up) {
    RandomLowRank(rng, host.gate, host.num_experts, rank);
    RandomLowRank(rng, host.up, host.num_experts, rank);
  }
  if (down) RandomLowRank(rng, host.down, host.num_experts, rank);
}

NqMoeHost RandomTrellisNqMoe(std::mt19937_64& rng, std::int64_t hidden, std::int64_t intermediate,
                             std::int64_t experts) {
  NqMoeHost h = RandomNqMoe(rng, hidden, intermediate, experts);
  h.codec = NqCodec::kTrellis;
  h.gate = RandomTrellisProjection(rng, intermediate, hidden, experts);
  h.up = RandomTrellisProjection(rng, intermediate, hidden, experts);
  h.down = RandomTrellisProjection(rng, hidden, intermediate, experts);
  return h;
}

NqMoeDevice UploadNqMoe(Backend& backend, const NqMoeHost& host, std::span<const std::int32_t> slot_of_expert,
                        bool scattered_slots) {
  const std::int64_t E = host.num_experts;
  const std::int64_t gate_plane = NqPlaneBytes(host.gate.rows, host.gate.cols);
  const std::int64_t down_plane = NqPlaneBytes(host.down.rows, host.down.cols);
  const std::int64_t up_offset = RoundUp(gate_plane, kSegmentAlign);
  const std::int64_t down_offset = up_offset + RoundUp(gate_plane, kSegmentAlign);
  // Each projection's residual-level low-rank factors after the planes, where it has them.
  const std::int64_t R = host.lowrank_rank;
  std::int64_t end = down_offset + down_plane;
  std::int64_t lowrank_offset[3] = {-1, -1, -1};
  const NqProjectionHost* projections[3] = {&host.gate, &host.up, &host.down};
  for (int j = 0; j < 3; ++j) {
    if (R == 0 || projections[j]->lowrank_u.empty()) continue;
    lowrank_offset[j] = RoundUp(end, kSegmentAlign);
    end = lowrank_offset[j] + NqLowRankBytes(projections[j]->rows, projections[j]->cols, R);
  }
  const std::int64_t slot_bytes = RoundUp(end, kRecordAlign);
  NqMoeDevice d;
  d.weights.lowrank_rank = R;
  d.weights.codec = host.codec;
  d.weights.hidden = host.hidden;
  d.weights.intermediate = host.intermediate;
  d.weights.num_experts = E;
  d.weights.gate = UploadProjection(backend, host.gate, E, 0);
  d.weights.up = UploadProjection(backend, host.up, E, up_offset);
  d.weights.down = UploadProjection(backend, host.down, E, down_offset);
  if (R > 0) {
    UploadLowRank(backend, host.gate, E, R, lowrank_offset[0], d.weights.gate);
    UploadLowRank(backend, host.up, E, R, lowrank_offset[1], d.weights.up);
    UploadLowRank(backend, host.down, E, R, lowrank_offset[2], d.weights.down);
  }
  d.weights.input = {Upload(backend, host.input_signs, DType::kF32, {host.hidden}), host.input_block};
  d.weights.gate_rows = {Upload(backend, host.gate_row_signs, DType::kF32, {host.intermediate}), host.gate_row_block};
  d.weights.down_cols = {Upload(backend, host.down_col_signs, DType::kF32, {host.intermediate}), host.down_col_block};
  d.weights.down_rows = {Upload(backend, host.down_row_signs, DType::kF32, {host.hidden}), host.down_row_block};
  std::int64_t num_slots = 0;
  for (std::int32_t s : slot_of_expert) num_slots = std::max<std::int64_t>(num_slots, s + 1);
  // Where slot s's record lies in the arena, in records: s, or scattered (reverse order, a gap
  // before each).
  auto record_of = [&](std::int64_t s) { return scattered_slots ? 2 * (num_slots - 1 - s) + 1 : s; };
  const std::int64_t records = std::max<std::int64_t>(scattered_slots ? 2 * num_slots : num_slots, 1);
  std::vector<std::uint8_t> arena(static_cast<size_t>(records * slot_bytes), 0);
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int32_t s = slot_of_expert[e];
    if (s < 0) continue;
    std::uint8_t* slot = arena.data() + record_of(s) * slot_bytes;
    std::copy_n(host.gate.residual.begin() + e * gate_plane, gate_plane, slot);
    std::copy_n(host.up.residual.begin() + e * gate_plane, gate_plane, slot + up_offset);
    std::copy_n(host.down.residual.begin() + e * down_plane, down_plane, slot + down_offset);
    for (int j = 0; j < 3; ++j) {
      if (lowrank_offset[j] >= 0) PackSlotLowRank(*projections[j], e, R, slot + lowrank_offset[j]);
    }
  }
  d.arena = UploadBytes(backend, arena, Shape{static_cast<std::int64_t>(arena.size())});
  d.slot_table = UploadI32(backend, slot_of_expert, {E});
  d.slots = {.slot_of_expert = &d.slot_table,
             .arena = static_cast<const std::byte*>(d.arena.data()),
             .slot_bytes = slot_bytes,
             .num_slots = num_slots};
  if (scattered_slots && num_slots > 0) {
    std::vector<std::uint8_t> addresses(static_cast<size_t>(num_slots) * sizeof(void*));
    for (std::int64_t s = 0; s < num_slots; ++s) {
      const std::byte* record = static_cast<const std::byte*>(d.arena.data()) + record_of(s) * slot_bytes;
      std::memcpy(addresses.data() + s * sizeof(void*), &record, sizeof(void*));
    }
    d.slot_records = UploadBytes(backend, addresses, Shape{static_cast<std::int64_t>(addresses.size())});
    d.slots.slot_records = &d.slot_records;
    // arena says there are slots; no kernel may read it as slot 0 (a gap lies there).
  }
  return d;
}

std::vector<double> DenseNqMoeReference(const NqMoeHost& h, std::span<const float> x, std::span<const std::int32_t> ids,
                                        std::span<const float> weights, std::int64_t top_k,
                                        std::span<const std::int32_t> slot_of_expert) {
  const std::int64_t D = h.hidden, I = h.intermediate;
  const std::int64_t T = static_cast<std::int64_t>(x.size()) / D;
  const std::vector<double> r_in = RotationMatrix(h.input_signs, h.input_block);
  const std::vector<double> r_g = RotationMatrix(h.gate_row_signs, h.gate_row_block);
  const std::vector<double> r_dc = RotationMatrix(h.down_col_signs, h.down_col_block);
  const std::vector<double> r_dr = RotationMatrix(h.down_row_signs, h.down_row_block);
  std::vector<double> out(static_cast<size_t>(T * D), 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t k = 0; k < top_k; ++k) {
      const std::int32_t e = ids[t * top_k + k];
      const bool four = slot_of_expert[e] >= 0;
      const std::vector<double> wg = DenseExpert(h.codec, h.gate, h.lowrank_rank, e, four, r_g, r_in);
      const std::vector<double> wu = DenseExpert(h.codec, h.up, h.lowrank_rank, e, four, r_g, r_in);
      const std::vector<double> wd = DenseExpert(h.codec, h.down, h.lowrank_rank, e, four, r_dr, r_dc);
      std::vector<double> act(static_cast<size_t>(I));
      for (std::int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (std::int64_t j = 0; j < D; ++j) {
          g += wg[i * D + j] * x[t * D + j];
          u += wu[i * D + j] * x[t * D + j];
        }
        act[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (std::int64_t i = 0; i < D; ++i) {
        double y = 0;
        for (std::int64_t j = 0; j < I; ++j) y += wd[i * I + j] * act[j];
        out[t * D + i] += weights[t * top_k + k] * y;
      }
    }
  }
  return out;
}

NqMoeRouting RandomNqMoeRouting(std::mt19937_64& rng, std::int64_t tokens, std::int64_t top_k, std::int64_t experts,
                                std::int64_t pool) {
  NqMoeRouting r;
  std::vector<std::int32_t> all(static_cast<size_t>(experts));
  for (std::int64_t e = 0; e < experts; ++e) all[e] = static_cast<std::int32_t>(e);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.begin() + std::min(pool, experts), rng);
    for (std::int64_t k = 0; k < top_k; ++k) {
      r.ids.push_back(all[k]);
      r.weights.push_back(weight(rng));
    }
  }
  return r;
}

std::vector<std::int32_t> NqMoeSlots(std::mt19937_64& rng, std::int64_t experts, int mode) {
  std::vector<std::int32_t> slots(static_cast<size_t>(experts), -1);
  std::bernoulli_distribution coin(0.5);
  std::int32_t next = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    if (mode == 1 || (mode == 2 && coin(rng))) slots[e] = next++;
  }
  return slots;
}

std::vector<float> RunNqMoe(Backend& backend, const NqMoeHost& host, std::span<const std::int32_t> slot_of_expert,
                            const std::vector<float>& x, const NqMoeRouting& routing, std::int64_t top_k,
                            bool scattered_slots) {
  const std::int64_t T = static_cast<std::int64_t>(x.size()) / host.hidden;
  NqMoeDevice layer = UploadNqMoe(backend, host, slot_of_expert, scattered_slots);
  Tensor tx = Upload(backend, x, DType::kF32, {T, host.hidden});
  Tensor ids = UploadI32(backend, routing.ids, {T, top_k});
  Tensor weights = Upload(backend, routing.weights, DType::kF32, {T, top_k});
  absl::StatusOr<Tensor> out = backend.Allocate(DType::kF32, Shape{T, host.hidden});
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  const absl::Status run = backend.NqMoe(tx, ids, weights, layer.weights, layer.slots, *out);
  EXPECT_TRUE(run.ok()) << run;
  if (!run.ok()) return {};
  return Download(backend, *out);
}

}  // namespace nq::kernels::testing
