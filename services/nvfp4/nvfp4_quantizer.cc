#include "services/nvfp4/nvfp4_quantizer.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "services/model/dtype_convert.h"

namespace nq::nvfp4 {
namespace {

// Positive finite E4M3 codes are 0x01..0x7E, increasing in value; 0x7F is NaN.
constexpr int kMaxScaleCode = 0x7E;
// ModelOpt gives an all-zero block scale 1.0 (its `per_block_scale[== 0] = 1.0`).
constexpr uint8_t kScaleCodeOne = 0x38;

const std::array<float, kMaxScaleCode + 1>& ScaleValues() {
  static const std::array<float, kMaxScaleCode + 1> values = [] {
    std::array<float, kMaxScaleCode + 1> v{};
    for (int c = 0; c <= kMaxScaleCode; ++c) v[c] = kernels::E4M3ToFloat(static_cast<uint8_t>(c));
    return v;
  }();
  return values;
}

// Smallest positive code whose value is >= v (kMaxScaleCode + 1 when none).
int CeilScaleCode(float v) {
  const auto& values = ScaleValues();
  return static_cast<int>(std::lower_bound(values.begin() + 1, values.end(), v) - values.begin());
}

// Largest positive code whose value is <= v (0 when none).
int FloorScaleCode(float v) {
  const auto& values = ScaleValues();
  return static_cast<int>(std::upper_bound(values.begin() + 1, values.end(), v) - values.begin()) - 1;
}

// Per-thread running sums, merged at the end.
struct Partial {
  double sse = 0, ww = 0, qq = 0, wq = 0, clipped_energy = 0, multiplier_sum = 0;
  double multiplier_min = std::numeric_limits<double>::infinity();
  double multiplier_max = 0;
  int64_t multiplier_blocks = 0, scale_clamps = 0, clipped_blocks = 0, clipped_weights = 0, raised_blocks = 0;
};

struct Block {
  const float* w;    // kBlockSize weights
  uint8_t* codes;    // kBlockSize E2M1 codes (unpacked)
};

// Squared error of `w` coded at block scale value `scale`; fills `codes`.
double CodeBlock(const float* w, float scale, float scale_2, uint8_t* codes) {
  const float divisor = scale * scale_2;
  double sse = 0;
  for (int j = 0; j < kBlockSize; ++j) {
    codes[j] = FloatToE2M1(w[j] / divisor);
    const double err = static_cast<double>(w[j]) - kernels::E2M1ToFloat(codes[j]) * divisor;
    sse += err * err;
  }
  return sse;
}

// Chooses the block's scale code per the search, writes its E2M1 codes, updates `partial`.
uint8_t QuantizeBlock(const float* w, float scale_2, ScaleSearch search, uint8_t* codes, Partial& partial) {
  float block_amax = 0;
  for (int j = 0; j < kBlockSize; ++j) block_amax = std::max(block_amax, std::fabs(w[j]));
  const float ideal = block_amax / (kE2M1Max * scale_2);
  if (ideal == 0.0f) {
    std::fill(codes, codes + kBlockSize, 0);
    return kScaleCodeOne;
  }
  if (ideal < kScaleMin || ideal > kScaleMax) ++partial.scale_clamps;
  const float clamped = std::clamp(ideal, kScaleMin, kScaleMax);
  const int stock = model::FloatToFp8E4M3(clamped);
  const auto& values = ScaleValues();
  // The smallest code that clips nothing, computed the way CodeBlock divides.
  int first_unclipped = CeilScaleCode(clamped);
  while (first_unclipped <= kMaxScaleCode && block_amax / (values[first_unclipped] * scale_2) > kE2M1Max) {
    ++first_unclipped;
  }
  int lo = stock, hi = stock;
  if (search == ScaleSearch::kNonclip) {
    lo = first_unclipped;
    hi = std::max(lo, FloorScaleCode(clamped * kNonclipMaxMultiplier));
  } else if (search == ScaleSearch::kClip) {
    lo = std::min({stock, first_unclipped, CeilScaleCode(clamped * kClipMinMultiplier)});
    hi = std::max({stock, first_unclipped, FloorScaleCode(clamped * kNonclipMaxMultiplier)});
  }
  hi = std::min(hi, kMaxScaleCode);
  int best = -1;
  double best_sse = std::numeric_limits<double>::infinity();
  std::array<uint8_t, kBlockSize> trial;
  for (int c = lo; c <= hi; ++c) {
    const double sse = CodeBlock(w, values[c], scale_2, trial.data());
    if (sse < best_sse) {  // strict: ties keep the smaller scale
      best_sse = sse;
      best = c;
    }
  }
  const float divisor = values[best] * scale_2;
  CodeBlock(w, values[best], scale_2, codes);
  bool clipped = false;
  for (int j = 0; j < kBlockSize; ++j) {
    if (std::fabs(w[j]) / divisor > kE2M1Max) {
      clipped = true;
      ++partial.clipped_weights;
      partial.clipped_energy += static_cast<double>(w[j]) * w[j];
    }
  }
  partial.clipped_blocks += clipped ? 1 : 0;
  partial.raised_blocks += best > stock ? 1 : 0;
  const double multiplier = values[best] / clamped;
  partial.multiplier_sum += multiplier;
  partial.multiplier_min = std::min(partial.multiplier_min, multiplier);
  partial.multiplier_max = std::max(partial.multiplier_max, multiplier);
  ++partial.multiplier_blocks;
  return static_cast<uint8_t>(best);
}

void QuantizeRows(std::span<const float> values, int64_t cols, float scale_2, ScaleSearch search,
                  int64_t row_begin, int64_t row_end, Nvfp4Tensor& out, Partial& partial) {
  const int64_t blocks_per_row = cols / kBlockSize;
  std::array<uint8_t, kBlockSize> codes;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t b = 0; b < blocks_per_row; ++b) {
      const float* w = values.data() + r * cols + b * kBlockSize;
      out.scales[r * blocks_per_row + b] = QuantizeBlock(w, scale_2, search, codes.data(), partial);
      const float divisor = kernels::E4M3ToFloat(out.scales[r * blocks_per_row + b]) * scale_2;
      for (int j = 0; j < kBlockSize; j += 2) {
        out.packed[(r * cols + b * kBlockSize + j) / 2] = codes[j] | (codes[j + 1] << 4);
      }
      for (int j = 0; j < kBlockSize; ++j) {
        const double q = kernels::E2M1ToFloat(codes[j]) * divisor;
        const double err = w[j] - q;
        partial.sse += err * err;
        partial.ww += static_cast<double>(w[j]) * w[j];
        partial.qq += q * q;
        partial.wq += w[j] * q;
      }
    }
  }
}

}  // namespace

absl::StatusOr<ScaleSearch> ParseScaleSearch(absl::string_view text) {
  if (text == "off") return ScaleSearch::kOff;
  if (text == "nonclip") return ScaleSearch::kNonclip;
  if (text == "clip") return ScaleSearch::kClip;
  return absl::InvalidArgumentError(absl::StrCat("scale search: want off, nonclip or clip, got '", text, "'"));
}

absl::string_view ScaleSearchName(ScaleSearch search) {
  switch (search) {
    case ScaleSearch::kOff: return "off";
    case ScaleSearch::kNonclip: return "nonclip";
    case ScaleSearch::kClip: return "clip";
  }
  return "?";
}

absl::StatusOr<QuantizeResult> QuantizeNvfp4(std::span<const float> values, int64_t rows, int64_t cols,
                                             const QuantizeOptions& options) {
  if (rows < 0 || cols < 0 || cols % kBlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 quantize: [", rows, ", ", cols, "]: the input dim must be a multiple of 16"));
  }
  if (values.size() != static_cast<size_t>(rows * cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NVFP4 quantize: [", rows, ", ", cols, "] needs ", rows * cols, " values, got ", values.size()));
  }
  float amax = 0;
  for (float v : values) {
    if (!std::isfinite(v)) return absl::InvalidArgumentError("NVFP4 quantize: non-finite weight");
    amax = std::max(amax, std::fabs(v));
  }
  float scale_2;
  if (options.scale_2.has_value()) {
    scale_2 = *options.scale_2;
    if (!std::isfinite(scale_2) || scale_2 <= 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat("NVFP4 quantize: fixed global scale must be > 0, got ", scale_2));
    }
    if (options.search == ScaleSearch::kNonclip && amax / (kScaleMax * scale_2) > kE2M1Max) {
      return absl::FailedPreconditionError(absl::StrCat("NVFP4 quantize: global scale ", scale_2,
                                                        " cannot hold amax ", amax, " without clipping"));
    }
  } else if (amax == 0.0f) {
    scale_2 = 1.0f;  // any positive value: every code is 0
  } else {
    scale_2 = amax / (kE2M1Max * kScaleMax);
    // Float rounding may leave even scale 448 short of the largest block by an ulp; nonclip
    // promises no clipping, so it widens the global scale by as many ulps as that takes.
    if (options.search != ScaleSearch::kOff) {
      while (amax / (kScaleMax * scale_2) > kE2M1Max) scale_2 = std::nextafter(scale_2, 1.0f);
    }
  }

  QuantizeResult result;
  Nvfp4Tensor& t = result.tensor;
  t.rows = rows;
  t.cols = cols;
  t.scale_2 = scale_2;
  t.packed.assign(static_cast<size_t>(rows * cols / 2), 0);
  t.scales.assign(static_cast<size_t>(rows * cols / kBlockSize), 0);
  const int threads = static_cast<int>(std::clamp<int64_t>(options.threads, 1, std::max<int64_t>(rows, 1)));
  std::vector<Partial> partials(threads);
  std::vector<std::thread> workers;
  for (int i = 0; i < threads; ++i) {
    const int64_t begin = rows * i / threads, end = rows * (i + 1) / threads;
    auto run = [&, i, begin, end] { QuantizeRows(values, cols, scale_2, options.search, begin, end, t, partials[i]); };
    if (i + 1 == threads) {
      run();
    } else {
      workers.emplace_back(run);
    }
  }
  for (std::thread& w : workers) w.join();

  Partial total;
  for (const Partial& p : partials) {
    total.sse += p.sse;
    total.ww += p.ww;
    total.qq += p.qq;
    total.wq += p.wq;
    total.clipped_energy += p.clipped_energy;
    total.multiplier_sum += p.multiplier_sum;
    total.multiplier_min = std::min(total.multiplier_min, p.multiplier_min);
    total.multiplier_max = std::max(total.multiplier_max, p.multiplier_max);
    total.multiplier_blocks += p.multiplier_blocks;
    total.scale_clamps += p.scale_clamps;
    total.clipped_blocks += p.clipped_blocks;
    total.clipped_weights += p.clipped_weights;
    total.raised_blocks += p.raised_blocks;
  }
  TensorStats& s = result.stats;
  s.rows = rows;
  s.cols = cols;
  s.blocks = rows * cols / kBlockSize;
  s.mse = rows * cols > 0 ? total.sse / static_cast<double>(rows * cols) : 0.0;
  s.rel_error = total.ww > 0 ? std::sqrt(total.sse / total.ww) : 0.0;
  s.cosine = total.ww > 0 && total.qq > 0 ? total.wq / std::sqrt(total.ww * total.qq) : 1.0;
  s.scale_clamps = total.scale_clamps;
  s.clipped_blocks = total.clipped_blocks;
  s.clipped_weights = total.clipped_weights;
  s.clipped_energy_share = total.ww > 0 ? total.clipped_energy / total.ww : 0.0;
  s.raised_blocks = total.raised_blocks;
  if (total.multiplier_blocks > 0) {
    s.multiplier_mean = total.multiplier_sum / static_cast<double>(total.multiplier_blocks);
    s.multiplier_min = total.multiplier_min;
    s.multiplier_max = total.multiplier_max;
  }
  return result;
}

std::string TapLine(absl::string_view tensor, ScaleSearch search, const TensorStats& s) {
  const nlohmann::json line = {
      {"tensor", std::string(tensor)},
      {"search", std::string(ScaleSearchName(search))},
      {"rows", s.rows},
      {"cols", s.cols},
      {"cosine", s.cosine},
      {"rel_error", s.rel_error},
      {"mse", s.mse},
      {"blocks", s.blocks},
      {"scale_clamps", s.scale_clamps},
      {"clipped_blocks", s.clipped_blocks},
      {"clipped_block_share", s.blocks > 0 ? static_cast<double>(s.clipped_blocks) / s.blocks : 0.0},
      {"clipped_weights", s.clipped_weights},
      {"clipped_energy_share", s.clipped_energy_share},
      {"raised_blocks", s.raised_blocks},
      {"multiplier", {{"mean", s.multiplier_mean}, {"min", s.multiplier_min}, {"max", s.multiplier_max}}},
  };
  return line.dump();
}

}  // namespace nq::nvfp4
