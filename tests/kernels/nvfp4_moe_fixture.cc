#include "tests/kernels/nvfp4_moe_fixture.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "gtest/gtest.h"
#include "kernels/nvfp4_codes.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels::testing {
namespace {

// E4M3 codes 0x38 (1.0) to 0x7E (448): the block scales amax / 6 / global takes when the
// global maps the tensor's amax to 448 x 6, as ModelOpt's recipe does.
constexpr int kTypicalScaleMin = 0x38;
constexpr int kTypicalScaleMax = 0x7E;

double Weight(const Nvfp4ProjectionHost& p, std::int64_t e, std::int64_t r, std::int64_t c) {
  const std::uint8_t byte = p.packed[(e * p.rows + r) * (p.cols / 2) + c / 2];
  const std::uint8_t code = c % 2 == 0 ? byte & 0x0F : byte >> 4;
  const std::uint8_t scale = p.scales[(e * p.rows + r) * (p.cols / kNvfp4BlockSize) + c / kNvfp4BlockSize];
  return double{E2M1ToFloat(code)} * double{E4M3ToFloat(scale)} * double{p.global[e]};
}

Nvfp4ProjectionHost RandomProjection(std::mt19937_64& rng, std::int64_t experts, std::int64_t rows, std::int64_t cols,
                                     Nvfp4ScaleDraw draw, float weight_rms) {
  Nvfp4ProjectionHost p;
  p.rows = rows;
  p.cols = cols;
  std::uniform_int_distribution<int> byte(0, 255), typical(kTypicalScaleMin, kTypicalScaleMax);
  p.packed.resize(experts * rows * cols / 2);
  for (std::uint8_t& b : p.packed) b = static_cast<std::uint8_t>(byte(rng));
  if (draw == Nvfp4ScaleDraw::kFullRange) {
    p.scales = RandomE4M3(rng, experts * rows * cols / kNvfp4BlockSize, /*allow_nan=*/false);
  } else {
    p.scales.resize(experts * rows * cols / kNvfp4BlockSize);
    for (std::uint8_t& s : p.scales) s = static_cast<std::uint8_t>(typical(rng));
  }
  p.global.assign(experts, 1.0f);
  for (std::int64_t e = 0; e < experts; ++e) {
    double sum = 0.0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) sum += Weight(p, e, r, c) * Weight(p, e, r, c);
    }
    const double rms = std::sqrt(sum / static_cast<double>(rows * cols));
    p.global[e] = rms > 0.0 ? static_cast<float>(weight_rms / rms) : 1.0f;
  }
  return p;
}

Nvfp4Projection UploadProjection(Backend& backend, const Nvfp4ProjectionHost& p, std::int64_t experts) {
  Nvfp4Projection out;
  out.packed = UploadBytes(backend, p.packed, DType::kU8, Shape{experts, p.rows, p.cols / 2});
  out.scales = UploadBytes(backend, p.scales, DType::kF8E4M3, Shape{experts, p.rows, p.cols / kNvfp4BlockSize});
  out.global_scales = Upload(backend, p.global, DType::kF32, Shape{experts});
  return out;
}

}  // namespace

Nvfp4MoeHost RandomNvfp4Moe(std::mt19937_64& rng, std::int64_t hidden, std::int64_t intermediate,
                            std::int64_t experts, Nvfp4ScaleDraw draw, float weight_rms) {
  Nvfp4MoeHost h;
  h.hidden = hidden;
  h.intermediate = intermediate;
  h.num_experts = experts;
  h.gate_up = RandomProjection(rng, experts, 2 * intermediate, hidden, draw, weight_rms);
  h.down = RandomProjection(rng, experts, hidden, intermediate, draw, weight_rms);
  return h;
}

Nvfp4MoeHost HandComputedNvfp4Moe(std::int64_t dim) {
  auto projection = [&](std::int64_t rows, std::uint8_t code_pair, std::uint8_t scale, float global) {
    Nvfp4ProjectionHost p;
    p.rows = rows;
    p.cols = dim;
    p.packed.assign(rows * dim / 2, code_pair);
    p.scales.assign(rows * dim / kNvfp4BlockSize, scale);
    p.global = {global};
    return p;
  };
  Nvfp4MoeHost h;
  h.hidden = h.intermediate = dim;
  h.num_experts = 1;
  h.gate_up = projection(2 * dim, 0x22, 0x38, 0.5f);
  // Up rows: codes 9 (-0.5) at scale 2.0 in place of the gate's.
  for (std::int64_t i = dim * dim / 2; i < 2 * dim * dim / 2; ++i) h.gate_up.packed[i] = 0x99;
  for (std::int64_t i = dim * dim / kNvfp4BlockSize; i < 2 * dim * dim / kNvfp4BlockSize; ++i) h.gate_up.scales[i] = 0x40;
  h.down = projection(dim, 0x77, 0x30, 2.0f);
  return h;
}

double HandComputedNvfp4Output(std::int64_t dim, double weight) {
  const double g = 1.0 * 1.0 * 0.5 * dim, u = -0.5 * 2.0 * 0.5 * dim;
  const double act = g / (1.0 + std::exp(-g)) * u;
  return weight * (6.0 * 0.5 * 2.0) * dim * act;
}

Nvfp4Routing RandomNvfp4Routing(std::mt19937_64& rng, std::int64_t tokens, std::int64_t top_k, std::int64_t pool) {
  Nvfp4Routing r;
  std::vector<std::int32_t> all(static_cast<std::size_t>(pool));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> weight(0.1f, 1.0f);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    r.ids.insert(r.ids.end(), all.begin(), all.begin() + top_k);
    for (std::int64_t k = 0; k < top_k; ++k) r.weights.push_back(weight(rng));
  }
  return r;
}

Nvfp4MoeWeights UploadNvfp4Moe(Backend& backend, const Nvfp4MoeHost& host) {
  return {.hidden = host.hidden,
          .intermediate = host.intermediate,
          .num_experts = host.num_experts,
          .gate_up = UploadProjection(backend, host.gate_up, host.num_experts),
          .down = UploadProjection(backend, host.down, host.num_experts)};
}

std::vector<float> RunNvfp4Moe(Backend& backend, const Nvfp4MoeHost& host, const std::vector<float>& x,
                               const std::vector<std::int32_t>& ids, const std::vector<float>& weights,
                               std::int64_t top_k) {
  const std::int64_t T = static_cast<std::int64_t>(x.size()) / host.hidden;
  const Nvfp4MoeWeights w = UploadNvfp4Moe(backend, host);
  const Tensor dx = Upload(backend, x, DType::kF32, Shape{T, host.hidden});
  const Tensor dids = UploadI32(backend, ids, Shape{T, top_k});
  const Tensor dw = Upload(backend, weights, DType::kF32, Shape{T, top_k});
  Tensor out = AllocateOrFail(backend, DType::kF32, Shape{T, host.hidden});
  const absl::Status status = backend.Nvfp4Moe(dx, dids, dw, w, out);
  EXPECT_TRUE(status.ok()) << status;
  if (!status.ok()) return {};
  return Download(backend, out);
}

std::vector<double> RefNvfp4Moe(const Nvfp4MoeHost& host, const std::vector<float>& x,
                                const std::vector<std::int32_t>& ids, const std::vector<float>& weights,
                                std::int64_t top_k) {
  const std::int64_t D = host.hidden, I = host.intermediate, T = static_cast<std::int64_t>(x.size()) / D;
  std::vector<double> out(static_cast<std::size_t>(T * D), 0.0), h(2 * I), act(I);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t k = 0; k < top_k; ++k) {
      const std::int64_t e = ids[t * top_k + k];
      for (std::int64_t r = 0; r < 2 * I; ++r) {
        double sum = 0.0;
        for (std::int64_t c = 0; c < D; ++c) sum += Weight(host.gate_up, e, r, c) * x[t * D + c];
        h[r] = sum;
      }
      for (std::int64_t i = 0; i < I; ++i) act[i] = h[i] / (1.0 + std::exp(-h[i])) * h[I + i];
      for (std::int64_t d = 0; d < D; ++d) {
        double sum = 0.0;
        for (std::int64_t i = 0; i < I; ++i) sum += Weight(host.down, e, d, i) * act[i];
        out[t * D + d] += double{weights[t * top_k + k]} * sum;
      }
    }
  }
  return out;
}

}  // namespace nq::kernels::testing
