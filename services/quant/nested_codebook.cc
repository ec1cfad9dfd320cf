#include "services/quant/nested_codebook.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/dtype.h"

namespace nq::quant {
namespace {

// Integration grid for N(0,1): [-kGridHalfWidth, kGridHalfWidth] in kGridSteps steps. The
// tail mass beyond 8 sigma (~1e-15) is below float precision of the levels.
constexpr double kGridHalfWidth = 8.0;
constexpr int kGridSteps = 16000;
// Lloyd iterations: the levels move by < 1e-7 well before this.
constexpr int kLloydIterations = 300;
// Initial 16 levels: the uniform quantiser step that is MSE-optimal for N(0,1) at 16
// levels (Max 1960, Table II).
constexpr double kUniform16Step = 0.3352;

struct Grid {
  std::vector<double> x;
  std::vector<double> p;  // probability mass of each grid cell
};

const Grid& GaussianGrid() {
  static const Grid grid = [] {
    Grid g;
    const double dx = 2.0 * kGridHalfWidth / kGridSteps;
    const double norm = dx / std::sqrt(2.0 * M_PI);
    // Cell midpoints: symmetric about 0 with no point on 0 (where ties would break one way).
    for (int i = 0; i < kGridSteps; ++i) {
      const double x = -kGridHalfWidth + (i + 0.5) * dx;
      g.x.push_back(x);
      g.p.push_back(norm * std::exp(-0.5 * x * x));
    }
    return g;
  }();
  return grid;
}

NestedCodebook Design(double lambda, BaseGrid grid) {
  NestedCodebook cb;
  cb.lambda = lambda;
  cb.grid = grid;
  for (int b = 0; b < kBaseLevels; ++b) {
    double mean = 0.0;
    for (int r = 0; r < kResidualLevels; ++r) {
      mean += (b * kResidualLevels + r - 7.5) * kUniform16Step / kResidualLevels;
    }
    cb.base[b] = static_cast<float>(mean);
    for (int r = 0; r < kResidualLevels; ++r) {
      cb.residual[b * kResidualLevels + r] =
          static_cast<float>((b * kResidualLevels + r - 7.5) * kUniform16Step - mean);
    }
  }
  const Grid& g = GaussianGrid();
  for (int it = 0; it < kLloydIterations; ++it) {
    std::array<double, kBaseLevels> base_sum{}, base_mass{};
    std::array<double, kBaseLevels * kResidualLevels> sub_sum{}, sub_mass{};
    for (size_t i = 0; i < g.x.size(); ++i) {
      const NestedChoice c = ChooseNested(cb, g.x[i], g.x[i]);
      base_sum[c.base] += g.p[i] * g.x[i];
      base_mass[c.base] += g.p[i];
      const int k = c.base * kResidualLevels + c.residual;
      sub_sum[k] += g.p[i] * g.x[i];
      sub_mass[k] += g.p[i];
    }
    if (grid == BaseGrid::kUniformNested) {
      cb = UniformNestedCodebook(lambda, FitUniformNestedStep(base_sum, base_mass, sub_sum, sub_mass, lambda,
                                                              cb.base[kBaseLevels - 1] - cb.base[kBaseLevels - 2]));
      continue;  // symmetric by construction
    }
    const double step = grid == BaseGrid::kUniform
                            ? FitUniformStep(base_sum, base_mass, cb.base[kBaseLevels - 1] - cb.base[kBaseLevels - 2])
                            : 0.0;
    for (int b = 0; b < kBaseLevels; ++b) {
      double c_b = base_mass[b] > 0 ? base_sum[b] / base_mass[b] : cb.base[b];
      if (grid == BaseGrid::kUniform) c_b = EvenGridLevel(step, b);
      for (int r = 0; r < kResidualLevels; ++r) {
        const int k = b * kResidualLevels + r;
        const double level = sub_mass[k] > 0 ? sub_sum[k] / sub_mass[k] : cb.Level4(b, r);
        cb.residual[k] = static_cast<float>(level - c_b);
      }
      cb.base[b] = static_cast<float>(c_b);
    }
    // N(0,1) is symmetric, so is the optimum: average each level with its mirror so that
    // rounding noise cannot drift the design off symmetry.
    NestedCodebook mirrored = cb;
    for (int b = 0; b < kBaseLevels; ++b) {
      const int mb = kBaseLevels - 1 - b;
      mirrored.base[b] = 0.5f * (cb.base[b] - cb.base[mb]);
      for (int r = 0; r < kResidualLevels; ++r) {
        const int mr = kResidualLevels - 1 - r;
        mirrored.residual[b * kResidualLevels + r] =
            0.5f * (cb.residual[b * kResidualLevels + r] - cb.residual[mb * kResidualLevels + mr]);
      }
    }
    cb = mirrored;
  }
  return cb;
}

}  // namespace

absl::string_view BaseGridName(BaseGrid grid) {
  switch (grid) {
    case BaseGrid::kUniform: return "uniform";
    case BaseGrid::kLloyd: return "lloyd";
    case BaseGrid::kUniformNested: return "uniform_nested";
  }
  return "uniform";
}

absl::StatusOr<BaseGrid> ParseBaseGrid(absl::string_view name) {
  for (const BaseGrid grid : {BaseGrid::kUniform, BaseGrid::kLloyd, BaseGrid::kUniformNested}) {
    if (name == BaseGridName(grid)) return grid;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("must be uniform, lloyd or uniform_nested, got '", name, "'"));
}

double SnapUniformStep(double step, int bits) {
  // 9 bits: s = m * 2^k with m < 512, so 1.5 s = 3 m * 2^(k-1) with 3 m < 2048 fits fp16's 11.
  // 7 bits (uniform nested): s / 4 * (odd / 2) = odd * m * 2^(k-3), odd <= 15, 15 m < 2048.
  if (step == 0.0 || !std::isfinite(step)) return step;
  int exponent = 0;
  const double mantissa = std::frexp(step, &exponent);  // [0.5, 1)
  return std::ldexp(std::nearbyint(std::ldexp(mantissa, bits)), exponent - bits);
}

double FitUniformNestedStep(const std::array<double, kBaseLevels>& base_sum,
                            const std::array<double, kBaseLevels>& base_mass,
                            const std::array<double, kBaseLevels * kResidualLevels>& sub_sum,
                            const std::array<double, kBaseLevels * kResidualLevels>& sub_mass, double lambda,
                            double fallback) {
  // d/ds of lambda sum (x - s o_b)^2 + (1 - lambda) sum (x - s q_br)^2 = 0, with o_b and q_br the
  // levels at s = 1.
  double num = 0.0, den = 0.0;
  for (int b = 0; b < kBaseLevels; ++b) {
    const double o = EvenGridLevel(1.0, b);
    num += lambda * o * base_sum[b];
    den += lambda * o * o * base_mass[b];
    for (int r = 0; r < kResidualLevels; ++r) {
      const int k = b * kResidualLevels + r;
      const double q = UniformNestedLevel(1.0, b, r);
      num += (1.0 - lambda) * q * sub_sum[k];
      den += (1.0 - lambda) * q * q * sub_mass[k];
    }
  }
  return SnapUniformStep(den > 0.0 && num > 0.0 ? num / den : fallback, kUniformNestedStepBits);
}

NestedCodebook UniformNestedCodebook(double lambda, double step) {
  NestedCodebook cb;
  cb.lambda = lambda;
  cb.grid = BaseGrid::kUniformNested;
  for (int b = 0; b < kBaseLevels; ++b) {
    cb.base[b] = static_cast<float>(EvenGridLevel(step, b));
    for (int r = 0; r < kResidualLevels; ++r) {
      // Exact: both levels are fp16 values with few significant bits.
      cb.residual[b * kResidualLevels + r] = static_cast<float>(UniformNestedLevel(step, b, r)) - cb.base[b];
    }
  }
  return cb;
}

double FitUniformStep(const std::array<double, kBaseLevels>& base_sum,
                      const std::array<double, kBaseLevels>& base_mass, double fallback) {
  double num = 0.0, den = 0.0;
  for (int b = 0; b < kBaseLevels; ++b) {
    const double offset = EvenGridLevel(1.0, b);
    num += offset * base_sum[b];
    den += offset * offset * base_mass[b];
  }
  return SnapUniformStep(den > 0.0 && num > 0.0 ? num / den : fallback);
}

float RoundToHalfPrecision(float v) {
  constexpr float kHalfMax = 65504.0f;  // the largest finite fp16
  if (!std::isfinite(v)) return v;
  if (std::fabs(v) >= kHalfMax) return std::copysign(kHalfMax, v);
  return kernels::ToFloat(kernels::ToF16(v));  // round to nearest even, subnormals included
}

NestedCodebook SnapToHalfGrid(NestedCodebook cb) {
  std::array<float, kBaseLevels * kResidualLevels> level4{};
  for (int b = 0; b < kBaseLevels; ++b) {
    for (int r = 0; r < kResidualLevels; ++r) level4[b * kResidualLevels + r] = RoundToHalfPrecision(cb.Level4(b, r));
  }
  for (int b = 0; b < kBaseLevels; ++b) {
    cb.base[b] = RoundToHalfPrecision(cb.base[b]);
    // Both fp16 values, so the float difference and the decoder's float sum are exact.
    for (int r = 0; r < kResidualLevels; ++r) {
      cb.residual[b * kResidualLevels + r] = level4[b * kResidualLevels + r] - cb.base[b];
    }
  }
  return cb;
}

NestedChoice ChooseNested(const NestedCodebook& cb, double x2, double x4) {
  const double lambda = cb.lambda;
  double best_cost = std::numeric_limits<double>::infinity();
  NestedChoice best{0, 0};
  for (int b = 0; b < kBaseLevels; ++b) {
    const double e2 = x2 - cb.base[b];
    double best_e4 = std::numeric_limits<double>::infinity();
    int best_r = 0;
    for (int r = 0; r < kResidualLevels; ++r) {
      const double e4 = x4 - cb.Level4(b, r);
      if (e4 * e4 < best_e4) {
        best_e4 = e4 * e4;
        best_r = r;
      }
    }
    const double cost = lambda * e2 * e2 + (1.0 - lambda) * best_e4;
    if (cost < best_cost) {
      best_cost = cost;
      best = {static_cast<uint8_t>(b), static_cast<uint8_t>(best_r)};
    }
  }
  return best;
}

absl::StatusOr<NestedCodebook> DesignNestedCodebook(double lambda, BaseGrid grid) {
  if (!(lambda >= 0.0 && lambda <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("blend lambda must lie in [0, 1], got ", lambda));
  }
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<double, BaseGrid>, NestedCodebook>();
  std::lock_guard<std::mutex> lock(mu);
  const std::pair<double, BaseGrid> key{lambda, grid};
  auto it = cache->find(key);
  if (it == cache->end()) it = cache->emplace(key, SnapToHalfGrid(Design(lambda, grid))).first;
  return it->second;
}

std::array<double, 2> GaussianDistortion(const NestedCodebook& cb, double lambda) {
  NestedCodebook coded = cb;
  coded.lambda = lambda;
  const Grid& g = GaussianGrid();
  std::array<double, 2> mse{0.0, 0.0};
  for (size_t i = 0; i < g.x.size(); ++i) {
    const NestedChoice c = ChooseNested(coded, g.x[i], g.x[i]);
    const double e2 = g.x[i] - coded.base[c.base];
    const double e4 = g.x[i] - coded.Level4(c.base, c.residual);
    mse[0] += g.p[i] * e2 * e2;
    mse[1] += g.p[i] * e4 * e4;
  }
  return mse;
}

}  // namespace nq::quant
