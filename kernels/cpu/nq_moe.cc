// CPU reference of the NestQuant routed-expert block (kernels/nq_moe.h): the oracle the CUDA
// kernels are tested against. It follows the contract's math step by step in fp32 (double for
// the dot products), one (token, assignment) at a time; parallel over the rows of each GEMV.
// Weights are decoded from the codes inside each GEMV, as each codec's Decode computes them:
// no dense copy of an expert is ever kept.
#include "kernels/cpu/nq_moe.h"

#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/parallel.h"
#include "kernels/dtype.h"
#include "kernels/nq_moe.h"
#include "services/quant/trellis_decode.h"

namespace nq::kernels::cpu {
namespace {

constexpr int kCodeBits = 2;
constexpr int kCodesPerByte = 8 / kCodeBits;

// In-place normalised Walsh-Hadamard transform of each `block`-wide slice of x[0, n) (Sylvester
// order, scaled by 1/sqrt(block)): the blockdiag(H) of hadamard.h.
void BlockFwht(float* x, std::int64_t n, std::int64_t block) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(block));
  for (std::int64_t b0 = 0; b0 < n; b0 += block) {
    float* v = x + b0;
    for (std::int64_t h = 1; h < block; h *= 2) {
      for (std::int64_t i = 0; i < block; i += 2 * h) {
        for (std::int64_t j = i; j < i + h; ++j) {
          const float a = v[j], b = v[j + h];
          v[j] = a + b;
          v[j + h] = a - b;
        }
      }
    }
    for (std::int64_t i = 0; i < block; ++i) v[i] *= scale;
  }
}

void Rotate(std::vector<float>& x, const NqRotationView& r) {
  for (size_t i = 0; i < x.size(); ++i) x[i] *= r.signs[i];
  BlockFwht(x.data(), static_cast<std::int64_t>(x.size()), r.block);
}

void Unrotate(std::vector<float>& x, const NqRotationView& r) {
  BlockFwht(x.data(), static_cast<std::int64_t>(x.size()), r.block);
  for (size_t i = 0; i < x.size(); ++i) x[i] *= r.signs[i];
}

inline int Code(const std::uint8_t* plane, std::int64_t k) {
  return (plane[k / kCodesPerByte] >> (kCodeBits * (k % kCodesPerByte))) & 3;
}

// y[i] = rs[i] * sum_j Q[i][j] * cs[j] * v[j] for the rows x cols nested_scalar_v1 matrix of
// expert e.
void ScalarGemv(const NqProjectionView& p, std::int64_t e, std::int64_t rows, std::int64_t cols,
                const std::uint8_t* residual, const std::vector<float>& v, float* y, int threads) {
  const std::uint8_t* base = p.base + e * NqPlaneBytes(rows, cols);
  const float* rs = p.row_scales + e * rows;
  const float* cs = p.col_scales + e * cols;
  const float* levels = p.levels + e * kNqLevelTable;
  std::vector<float> scaled(static_cast<size_t>(cols));
  for (std::int64_t j = 0; j < cols; ++j) scaled[j] = cs[j] * v[j];
  ParallelFor(rows, 64, threads, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      double acc = 0.0;
      for (std::int64_t j = 0; j < cols; ++j) {
        const std::int64_t k = i * cols + j;
        const int b = Code(base, k);
        const float level = residual == nullptr ? levels[b] : levels[kNqBaseLevels + 4 * b + Code(residual, k)];
        acc += static_cast<double>(level) * scaled[j];
      }
      y[i] = rs[i] * static_cast<float>(acc);
    }
  });
}

// Sixteen little-endian words of the tile at `bytes`, assembled from bytes as TrellisCodec::Decode
// does, so the decode does not depend on host byte order.
void TileWords(const std::uint8_t* bytes, std::uint32_t* words) {
  for (int k = 0; k < quant::trellis::kTileWords; ++k) {
    words[k] = static_cast<std::uint32_t>(bytes[4 * k]) | static_cast<std::uint32_t>(bytes[4 * k + 1]) << 8 |
               static_cast<std::uint32_t>(bytes[4 * k + 2]) << 16 | static_cast<std::uint32_t>(bytes[4 * k + 3]) << 24;
  }
}

// The same GEMV for a trellis_v1 matrix: Q[i][j] = gb * U(sb) (+ gr * U(sr) at 4 bits) in float,
// term by term as TrellisCodec::Decode computes it, decoded tile by tile inside the GEMV. Work is
// split by 16-row tile rows, so every tile is decoded once.
void TrellisGemv(const NqProjectionView& p, std::int64_t e, std::int64_t rows, std::int64_t cols,
                 const std::uint8_t* residual, const std::vector<float>& v, float* y, int threads) {
  namespace trellis = quant::trellis;
  const std::int64_t blocks = cols / trellis::kTileDim;
  const std::uint8_t* base = p.base + e * NqPlaneBytes(rows, cols);
  const float* rs = p.row_scales + e * rows;
  const float* cs = p.col_scales + e * cols;
  const float* gains = p.gains + e * blocks * kNqGainsPerBlock;
  std::vector<float> scaled(static_cast<size_t>(cols));
  for (std::int64_t j = 0; j < cols; ++j) scaled[j] = cs[j] * v[j];
  ParallelFor(rows / trellis::kTileDim, 4, threads, [&](std::int64_t begin, std::int64_t end) {
    std::uint32_t base_words[trellis::kTileWords];
    std::uint32_t residual_words[trellis::kTileWords];
    for (std::int64_t ti = begin; ti < end; ++ti) {
      double acc[trellis::kTileDim] = {};
      for (std::int64_t tj = 0; tj < blocks; ++tj) {
        const std::int64_t offset = trellis::TileByteOffset(ti, tj, cols);
        TileWords(base + offset, base_words);
        if (residual != nullptr) TileWords(residual + offset, residual_words);
        const float base_gain = gains[tj * kNqGainsPerBlock];
        const float residual_gain = gains[tj * kNqGainsPerBlock + 1];
        const float* x = scaled.data() + tj * trellis::kTileDim;
        for (int t = 0; t < trellis::kTileWeights; ++t) {
          float q = base_gain * trellis::UnitValue(trellis::TileState(base_words, t));
          if (residual != nullptr) q += residual_gain * trellis::UnitValue(trellis::TileState(residual_words, t));
          acc[t / trellis::kTileDim] += static_cast<double>(q) * x[t % trellis::kTileDim];
        }
      }
      for (int r = 0; r < trellis::kTileDim; ++r) {
        const std::int64_t i = ti * trellis::kTileDim + r;
        y[i] = rs[i] * static_cast<float>(acc[r]);
      }
    }
  });
}

// y += U (V v) for one expert's rank-R factors (kernels/nq_moe.h): R dot products, then R axpys.
// `load` reads element k of a factor array (resident F32, or a slot's fp16 bytes).
template <typename LoadU, typename LoadV>
void AddLowRank(LoadU load_u, LoadV load_v, std::int64_t rows, std::int64_t cols, std::int64_t R,
                const std::vector<float>& v, float* y) {
  double t[kNqMaxLowRank] = {};
  for (std::int64_t k = 0; k < R; ++k) {
    for (std::int64_t j = 0; j < cols; ++j) t[k] += static_cast<double>(load_v(k * cols + j)) * v[j];
  }
  for (std::int64_t i = 0; i < rows; ++i) {
    double acc = 0;
    for (std::int64_t k = 0; k < R; ++k) acc += static_cast<double>(load_u(i * R + k)) * t[k];
    y[i] += static_cast<float>(acc);
  }
}

float HalfAt(const std::uint8_t* bytes, std::int64_t k) {
  return ToFloat(F16{static_cast<std::uint16_t>(bytes[2 * k] | bytes[2 * k + 1] << 8)});
}

// The projection's GEMV in the rotated domain, then its low-rank corrections where it has them:
// the resident (base-level) factors always, the slot's (residual-level) factors at 4 bits.
void Gemv(const NqMoeParams& params, const NqProjectionView& p, std::int64_t e, std::int64_t rows, std::int64_t cols,
          std::int32_t slot, const std::vector<float>& v, float* y, int threads) {
  const std::uint8_t* residual = NqResidualPlane(params, p, slot);
  if (params.codec == NqCodec::kTrellis) {
    TrellisGemv(p, e, rows, cols, residual, v, y, threads);
  } else {
    ScalarGemv(p, e, rows, cols, residual, v, y, threads);
  }
  const std::int64_t R = params.lowrank_rank;
  if (R == 0 || p.lowrank_u == nullptr) return;
  const float* u = p.lowrank_u + e * rows * R;
  const float* vt = p.lowrank_v + e * R * cols;
  AddLowRank([u](std::int64_t k) { return u[k]; }, [vt](std::int64_t k) { return vt[k]; }, rows, cols, R, v, y);
  if (residual == nullptr || p.lowrank_offset < 0) return;
  const std::uint8_t* factors = NqSlotRecord(params, slot) + p.lowrank_offset;
  const std::uint8_t* v_bytes = factors + 2 * rows * R;
  AddLowRank([factors](std::int64_t k) { return HalfAt(factors, k); },
             [v_bytes](std::int64_t k) { return HalfAt(v_bytes, k); }, rows, cols, R, v, y);
}

}  // namespace

absl::Status NqMoe(const NqMoeParams& p, int threads) {
  const std::int64_t D = p.hidden, I = p.intermediate, K = p.top_k;
  for (std::int64_t a = 0; a < p.tokens * K; ++a) {
    const std::int32_t e = p.expert_ids[a];
    if (e < 0 || e >= p.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("NqMoe: expert id ", e, " of token ", a / K,
                                                     " is outside [0, ", p.num_experts, ")"));
    }
    for (std::int64_t b = (a / K) * K; b < a; ++b) {
      if (p.expert_ids[b] == e) {
        return absl::InvalidArgumentError(absl::StrCat("NqMoe: token ", a / K, " names expert ", e, " twice"));
      }
    }
  }
  std::vector<float> xr(static_cast<size_t>(D)), acc(static_cast<size_t>(D)), y(static_cast<size_t>(D));
  std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I)), h(static_cast<size_t>(I));
  for (std::int64_t t = 0; t < p.tokens; ++t) {
    xr.assign(p.x + t * D, p.x + (t + 1) * D);
    Rotate(xr, p.input);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k = 0; k < K; ++k) {
      const std::int32_t e = p.expert_ids[t * K + k];
      const std::int32_t slot = p.slot_of_expert[e];
      Gemv(p, p.gate, e, I, D, slot, xr, g.data(), threads);
      Gemv(p, p.up, e, I, D, slot, xr, u.data(), threads);
      Unrotate(g, p.gate_rows);
      Unrotate(u, p.gate_rows);
      for (std::int64_t j = 0; j < I; ++j) h[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
      Rotate(h, p.down_cols);
      Gemv(p, p.down, e, D, I, slot, h, y.data(), threads);
      const float w = p.expert_weights[t * K + k];
      for (std::int64_t i = 0; i < D; ++i) acc[i] += w * y[i];
    }
    Unrotate(acc, p.down_rows);
    std::copy(acc.begin(), acc.end(), p.out + t * D);
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels::cpu
