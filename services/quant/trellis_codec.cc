#include "services/quant/trellis_codec.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/quant/codec_prep.h"
#include "services/quant/ldlq_feedforward.h"
#include "services/quant/trellis_decode.h"
#include "services/quant/trellis_search.h"
#include "services/quant/trellis_viterbi.h"

namespace nq::quant {
namespace {

using trellis::kTileDim;
using trellis::kTileWeights;

constexpr int kCodeBits = trellis::kSymbolBits;
// Codebook gain per unit RMS of the targets. Measured on i.i.d. N(0,1) (64-256 tiles):
// the base's MSE is flat within 0.5% over gains 1.00..1.03; the residual (the base's error,
// kurtosis 3.08, i.e. near-Gaussian) gives 4-bit MSE 0.00497 / 0.00484 / 0.00479 / 0.00481 /
// 0.00485 at 0.90 / 0.95 / 1.00 / 1.05 / 1.10.
constexpr double kBaseGainPerRms = 1.0;
constexpr double kResidualGainPerRms = 1.0;

// RMS over the rows x 16 block of x (`cols` values a row) at columns [j0, j0 + 16).
double BlockRms(const std::vector<double>& x, int64_t rows, int64_t cols, int64_t j0) {
  double s = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t c = 0; c < kTileDim; ++c) s += x[i * cols + j0 + c] * x[i * cols + j0 + c];
  }
  return std::sqrt(s / static_cast<double>(rows * kTileDim));
}

// Codes every tile of the column blocks [tj0, tj1) from `target` (rows x 16 (tj1 - tj0): those
// blocks alone, row-major), block tj with gain gains[tj], in one search: symbols go to `codes` (tile
// order, trellis_decode.h), the decoded blocks to `decoded` (rows x 16 (tj1 - tj0), row-major).
absl::Status CodeBlocks(TrellisTileSearch& search, const std::vector<double>& target, int64_t rows, int64_t cols,
                        int64_t tj0, int64_t tj1, std::span<const float> gains, std::vector<uint8_t>& codes,
                        std::vector<double>& decoded) {
  const int64_t width = (tj1 - tj0) * kTileDim;
  const int64_t tile_rows = rows / kTileDim;
  const int64_t tiles = tile_rows * (tj1 - tj0);
  // Search order: tile (ti, tj) at ti * (tj1 - tj0) + (tj - tj0), which is the codes' own order
  // when the blocks are the whole matrix.
  std::vector<float> x(static_cast<size_t>(tiles * kTileWeights));
  std::vector<uint8_t> symbols(x.size());
  for (int64_t ti = 0; ti < tile_rows; ++ti) {
    for (int64_t tj = tj0; tj < tj1; ++tj) {
      const double gain = gains[tj];
      const double inv_gain = gain > 0.0 ? 1.0 / gain : 0.0;
      float* tx = x.data() + (ti * (tj1 - tj0) + tj - tj0) * kTileWeights;
      for (int t = 0; t < kTileWeights; ++t) {
        const int64_t i = ti * kTileDim + t / kTileDim;
        tx[t] = static_cast<float>(target[i * width + (tj - tj0) * kTileDim + t % kTileDim] * inv_gain);
      }
    }
  }
  RETURN_IF_ERROR(search.Search(x, symbols));
  const std::vector<float>& values = trellis::UnitValues();
  std::array<float, kTileWeights> unit;
  for (int64_t ti = 0; ti < tile_rows; ++ti) {
    for (int64_t tj = tj0; tj < tj1; ++tj) {
      const int64_t k = (ti * (tj1 - tj0) + tj - tj0) * kTileWeights;
      trellis::DecodeRing(values, x.data() + k, symbols.data() + k, unit.data());
      std::copy_n(symbols.data() + k, kTileWeights, codes.data() + (ti * (cols / kTileDim) + tj) * kTileWeights);
      for (int t = 0; t < kTileWeights; ++t) {
        decoded[(ti * kTileDim + t / kTileDim) * width + (tj - tj0) * kTileDim + t % kTileDim] = static_cast<double>(gains[tj]) * unit[t];
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<EncodedMatrix> TrellisCodec::Encode(std::span<const float> w, int64_t rows,
                                                   int64_t cols, const Hessian* hessian,
                                                   const EncodeOptions& options) const {
  RETURN_IF_ERROR(ValidateEncodeInput(w, rows, cols, options));
  if (rows % kTileDim != 0 || cols % kTileDim != 0) {
    return absl::InvalidArgumentError(absl::StrCat("trellis_v1 codes 16 x 16 tiles; ", rows, " x ",
                                                   cols, " is not a multiple of 16 on both sides"));
  }
  if (options.codebook_refinements != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("trellis_v1 has a computed codebook; codebook_refinements must be 0, got ",
                     options.codebook_refinements));
  }
  if (!(options.lambda >= 0.0 && options.lambda <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("lambda must lie in [0, 1], got ", options.lambda));
  }
  ASSIGN_OR_RETURN(PreparedMatrix p, PrepareMatrix(w, rows, cols, hessian, options));

  EncodedMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.params.codec = std::string(kTrellisV1);
  m.params.base_bits = kCodeBits;
  m.params.residual_bits = kCodeBits;
  m.params.rotation = options.rotation;
  m.params.lambda = options.lambda;
  const int64_t blocks = cols / kTileDim;
  m.params.base_codebook.assign(static_cast<size_t>(blocks), 0.0f);
  m.params.residual_codebook.assign(static_cast<size_t>(blocks), 0.0f);

  const bool feedback = !p.feedback.empty();
  // x2 / x4: the 2-bit and 4-bit feedback streams (equal to Z without a Hessian).
  std::vector<double> x2 = std::move(p.z);
  std::vector<double> x4 = feedback ? x2 : std::vector<double>();
  const std::vector<double>& x4_ref = feedback ? x4 : x2;
  // The targets of the blocks being coded: rows x 16 with feedback, the whole matrix without.
  const int64_t group = feedback ? 1 : blocks;
  const int64_t width = group * kTileDim;
  std::vector<double> base_target(static_cast<size_t>(rows * width));
  std::vector<double> residual_target(base_target.size());
  std::vector<uint8_t> base_codes(static_cast<size_t>(rows * cols));
  std::vector<uint8_t> residual_codes(static_cast<size_t>(rows * cols));
  std::unique_ptr<TrellisTileSearch> own_search;
  TrellisTileSearch* search = options.trellis_search;
  if (search == nullptr) {
    own_search = MakeCpuTrellisTileSearch(1);
    search = own_search.get();
  }
  // Without feedback no block depends on another: every tile of the matrix is searched at once
  // (base, then residual). With it, one 16-column block at a time, its error fed forward.
  std::vector<double> base_hat(static_cast<size_t>(rows * width));
  std::vector<double> residual_hat(base_hat.size());
  std::vector<double> e(static_cast<size_t>(rows * kTileDim));

  for (int64_t tj0 = 0; tj0 < blocks; tj0 += group) {
    const int64_t tj1 = tj0 + group;
    for (int64_t tj = tj0; tj < tj1; ++tj) {
      const int64_t j0 = tj * kTileDim, b0 = (tj - tj0) * kTileDim;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < kTileDim; ++c) {
          const int64_t k = i * cols + j0 + c;
          base_target[i * width + b0 + c] = options.lambda * x2[k] + (1.0 - options.lambda) * x4_ref[k];
        }
      }
      m.params.base_codebook[tj] = static_cast<float>(kBaseGainPerRms * BlockRms(base_target, rows, width, b0));
    }
    RETURN_IF_ERROR(CodeBlocks(*search, base_target, rows, cols, tj0, tj1, m.params.base_codebook, base_codes, base_hat));

    for (int64_t tj = tj0; tj < tj1; ++tj) {
      const int64_t j0 = tj * kTileDim, b0 = (tj - tj0) * kTileDim;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t c = 0; c < kTileDim; ++c) {
          residual_target[i * width + b0 + c] = x4_ref[i * cols + j0 + c] - base_hat[i * width + b0 + c];
        }
      }
      m.params.residual_codebook[tj] =
          static_cast<float>(kResidualGainPerRms * BlockRms(residual_target, rows, width, b0));
    }
    RETURN_IF_ERROR(CodeBlocks(*search, residual_target, rows, cols, tj0, tj1, m.params.residual_codebook,
                               residual_codes, residual_hat));

    if (!feedback) continue;
    const int64_t j0 = tj0 * kTileDim;  // one block
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c = 0; c < kTileDim; ++c) {
        e[i * kTileDim + c] = x2[i * cols + j0 + c] - base_hat[i * kTileDim + c];
      }
    }
    FeedForwardBlock(p.feedback, rows, cols, j0, e, x2, options.host_threads);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t c = 0; c < kTileDim; ++c) {
        e[i * kTileDim + c] = x4[i * cols + j0 + c] - base_hat[i * kTileDim + c] -
                              residual_hat[i * kTileDim + c];
      }
    }
    FeedForwardBlock(p.feedback, rows, cols, j0, e, x4, options.host_threads);
  }

  m.row_scales = std::move(p.row_scales);
  m.col_scales = std::move(p.col_scales);
  // Codes are in tile order, so PackCodes lays out whole 64-byte tiles (trellis_decode.h).
  m.base_codes = PackCodes(base_codes, kCodeBits);
  if (options.keep_residual) m.residual_codes = PackCodes(residual_codes, kCodeBits);
  return m;
}

absl::Status TrellisCodec::Decode(const EncodedMatrix& m, Precision precision,
                                  std::span<float> out) const {
  const int64_t rows = m.rows;
  const int64_t cols = m.cols;
  if (rows <= 0 || cols <= 0 || rows % kTileDim != 0 || cols % kTileDim != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("trellis_v1 matrices are whole 16 x 16 tiles, got ", rows, " x ", cols));
  }
  // One base and one residual gain per 16-column block.
  const size_t blocks = static_cast<size_t>(cols / kTileDim);
  RETURN_IF_ERROR(ValidateDecodeInput(m, name(), precision, out.size(), "gains", blocks, blocks));
  for (size_t b = 0; b < blocks; ++b) {
    if (!std::isfinite(m.params.base_codebook[b]) || !std::isfinite(m.params.residual_codebook[b])) {
      return absl::InvalidArgumentError(absl::StrCat("trellis_v1 gain of column block ", b, " is not finite"));
    }
  }
  const bool four_bit = precision == Precision::k4Bit;
  // Words are assembled from bytes so the decode is independent of host byte order.
  auto tile_words = [](const uint8_t* bytes, uint32_t* words) {
    for (int k = 0; k < trellis::kTileWords; ++k) {
      words[k] = static_cast<uint32_t>(bytes[4 * k]) | static_cast<uint32_t>(bytes[4 * k + 1]) << 8 |
                 static_cast<uint32_t>(bytes[4 * k + 2]) << 16 | static_cast<uint32_t>(bytes[4 * k + 3]) << 24;
    }
  };
  uint32_t base_words[trellis::kTileWords];
  uint32_t residual_words[trellis::kTileWords];
  for (int64_t ti = 0; ti < rows / kTileDim; ++ti) {
    for (int64_t tj = 0; tj < cols / kTileDim; ++tj) {
      const int64_t offset = trellis::TileByteOffset(ti, tj, cols);
      tile_words(m.base_codes.data() + offset, base_words);
      if (four_bit) tile_words(m.residual_codes.data() + offset, residual_words);
      const float base_gain = m.params.base_codebook[tj];
      const float residual_gain = m.params.residual_codebook[tj];
      for (int t = 0; t < kTileWeights; ++t) {
        float v = base_gain * trellis::UnitValue(trellis::TileState(base_words, t));
        if (four_bit) v += residual_gain * trellis::UnitValue(trellis::TileState(residual_words, t));
        const int64_t i = ti * kTileDim + t / kTileDim;
        const int64_t j = tj * kTileDim + t % kTileDim;
        out[i * cols + j] = m.row_scales[i] * v * m.col_scales[j];
      }
    }
  }
  return UnrotateMatrix(out, rows, cols, m.params.rotation);
}

}  // namespace nq::quant
