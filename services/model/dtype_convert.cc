#include "services/model/dtype_convert.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"

namespace nq::model {
namespace {

// safetensors stores little-endian bytes; the memcpy loads below read them natively.
static_assert(std::endian::native == std::endian::little, "little-endian host required");

// Rounds a non-negative float to the nearest integer, ties to even, independent of the
// floating-point environment. Exact: y - floor(y) is representable.
uint32_t RoundHalfEven(float y) {
  const float whole = std::floor(y);
  const float frac = y - whole;
  uint32_t q = static_cast<uint32_t>(whole);
  if (frac > 0.5f || (frac == 0.5f && (q & 1u) != 0)) ++q;
  return q;
}

std::array<float, 256> MakeFp8E4M3Table() {
  std::array<float, 256> table{};
  for (int code = 0; code < 256; ++code) {
    const int exponent = (code >> 3) & 0xF;
    const int mantissa = code & 0x7;
    float magnitude;
    if (exponent == 0xF && mantissa == 0x7) {
      magnitude = std::numeric_limits<float>::quiet_NaN();
    } else if (exponent == 0) {
      magnitude = std::ldexp(static_cast<float>(mantissa), -9);  // subnormal: m/8 * 2^-6
    } else {
      magnitude = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);  // (1+m/8)*2^(e-7)
    }
    table[code] = (code & 0x80) != 0 ? -magnitude : magnitude;
  }
  return table;
}

const std::array<float, 256>& Fp8E4M3Table() {
  static const std::array<float, 256> table = MakeFp8E4M3Table();
  return table;
}

template <typename T>
T Load(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

template <typename T>
void Store(std::byte* p, T value) {
  std::memcpy(p, &value, sizeof(T));
}

bool MulOverflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace

float Bf16ToFloat(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t FloatToBf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x0040);  // keep it quiet
  const uint32_t rounding_bias = 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

float F16ToFloat(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F;
  const uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: m * 2^-24, exact in fp32
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign != 0 ? -magnitude : magnitude;
  }
  if (exponent == 0x1F) return std::bit_cast<float>(sign | 0x7F800000 | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

uint16_t FloatToF16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t magnitude_bits = bits & 0x7FFFFFFF;
  if (magnitude_bits > 0x7F800000) return sign | 0x7E00;  // NaN
  if (magnitude_bits >= 0x47800000) return sign | 0x7C00;  // >= 2^16 (inf included): inf
  const float magnitude = std::bit_cast<float>(magnitude_bits);
  if (magnitude < 0x1p-14f) {
    // Subnormal half: a multiple of 2^-24. The scaling is exact; 1024 lands on the smallest
    // normal (0x0400), which is the right encoding.
    return sign | static_cast<uint16_t>(RoundHalfEven(magnitude * 0x1p24f));
  }
  uint32_t half = ((((magnitude_bits >> 23) - 127 + 15) << 10) | ((magnitude_bits >> 13) & 0x3FF));
  const uint32_t remainder = magnitude_bits & 0x1FFF;
  // A carry out of the mantissa bumps the exponent, which is the correct rounding (up to inf).
  if (remainder > 0x1000 || (remainder == 0x1000 && (half & 1) != 0)) ++half;
  return sign | static_cast<uint16_t>(half);
}

float Fp8E4M3ToFloat(uint8_t code) { return Fp8E4M3Table()[code]; }

uint8_t FloatToFp8E4M3(float value) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return sign | 0x7F;
  const float magnitude = std::fabs(value);
  if (magnitude >= kFp8E4M3Max) return sign | 0x7E;
  if (magnitude < 0x1p-6f) {
    // Subnormal: a multiple of 2^-9; 8 lands on the smallest normal (0x08).
    return sign | static_cast<uint8_t>(RoundHalfEven(magnitude * 0x1p9f));
  }
  int exponent = 0;
  const float fraction = std::frexp(magnitude, &exponent);  // magnitude = fraction * 2^exponent
  exponent -= 1;                                           // now significand in [1, 2)
  uint32_t mantissa = RoundHalfEven((fraction * 2.0f - 1.0f) * 8.0f);
  if (mantissa == 8) {
    mantissa = 0;
    ++exponent;
  }
  // magnitude < 448 rounds to at most 448 (exponent 8, mantissa 6): never the NaN code.
  return sign | static_cast<uint8_t>(((exponent + 7) << 3) | mantissa);
}

absl::StatusOr<std::vector<float>> ConvertToFloat32(DType dtype, std::span<const std::byte> bytes) {
  const uint64_t item = DTypeSize(dtype);
  if (bytes.size() % item != 0) {
    return absl::InvalidArgumentError(absl::StrCat(bytes.size(), " bytes are not a whole number of ",
                                                   DTypeName(dtype), " elements"));
  }
  const size_t n = bytes.size() / item;
  std::vector<float> out(n);
  const std::byte* p = bytes.data();
  switch (dtype) {
    case DType::kF32:
      if (n != 0) std::memcpy(out.data(), p, n * sizeof(float));
      return out;
    case DType::kF64:
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(Load<double>(p + 8 * i));
      return out;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) out[i] = Bf16ToFloat(Load<uint16_t>(p + 2 * i));
      return out;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) out[i] = F16ToFloat(Load<uint16_t>(p + 2 * i));
      return out;
    case DType::kF8E4M3: {
      const std::array<float, 256>& table = Fp8E4M3Table();
      for (size_t i = 0; i < n; ++i) out[i] = table[static_cast<uint8_t>(p[i])];
      return out;
    }
    case DType::kF8E5M2:  // E5M2 is the top byte of an IEEE half
      for (size_t i = 0; i < n; ++i) {
        out[i] = F16ToFloat(static_cast<uint16_t>(static_cast<uint16_t>(p[i]) << 8));
      }
      return out;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("cannot convert ", DTypeName(dtype), " to F32: not a floating-point dtype"));
  }
}

absl::StatusOr<std::vector<std::byte>> ConvertFromFloat32(std::span<const float> values,
                                                          DType dtype) {
  const size_t n = values.size();
  std::vector<std::byte> out(n * DTypeSize(dtype));
  std::byte* p = out.data();
  switch (dtype) {
    case DType::kF32:
      if (n != 0) std::memcpy(p, values.data(), n * sizeof(float));
      return out;
    case DType::kBF16:
      for (size_t i = 0; i < n; ++i) Store<uint16_t>(p + 2 * i, FloatToBf16(values[i]));
      return out;
    case DType::kF16:
      for (size_t i = 0; i < n; ++i) Store<uint16_t>(p + 2 * i, FloatToF16(values[i]));
      return out;
    case DType::kF8E4M3:
      for (size_t i = 0; i < n; ++i) p[i] = static_cast<std::byte>(FloatToFp8E4M3(values[i]));
      return out;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot convert F32 to ", DTypeName(dtype), ": supported are F32, BF16, F16, F8_E4M3"));
  }
}

absl::StatusOr<std::vector<float>> DequantizeFp8Block(const Fp8BlockTensor& t) {
  if (t.rows < 0 || t.cols < 0 || t.block <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 block dequantization of [", t.rows, ", ",
                                                   t.cols, "] with block ", t.block,
                                                   ": sizes must be non-negative, block positive"));
  }
  int64_t numel = 0;
  if (MulOverflows(t.rows, t.cols, &numel) || static_cast<uint64_t>(numel) != t.codes.size()) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 weight [", t.rows, ", ", t.cols, "] needs ",
                                                   t.rows, " x ", t.cols, " codes, got ",
                                                   t.codes.size()));
  }
  const int64_t want_rows = CeilDiv(t.rows, t.block);
  const int64_t want_cols = CeilDiv(t.cols, t.block);
  if (t.scale_rows != want_rows || t.scale_cols != want_cols ||
      static_cast<uint64_t>(want_rows * want_cols) != t.scale_inv.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 weight [", t.rows, ", ", t.cols, "] with ", t.block, "x", t.block,
        " blocks needs a scale_inv of shape [", want_rows, ", ", want_cols, "], got [",
        t.scale_rows, ", ", t.scale_cols, "] holding ", t.scale_inv.size(), " values"));
  }
  const std::array<float, 256>& table = Fp8E4M3Table();
  std::vector<float> out(static_cast<size_t>(numel));
  for (int64_t r = 0; r < t.rows; ++r) {
    const float* scale_row = t.scale_inv.data() + (r / t.block) * want_cols;
    const std::byte* codes = t.codes.data() + r * t.cols;
    float* dst = out.data() + r * t.cols;
    for (int64_t c = 0; c < t.cols; ++c) {
      dst[c] = table[static_cast<uint8_t>(codes[c])] * scale_row[c / t.block];
    }
  }
  return out;
}

absl::StatusOr<Fp8BlockQuantized> QuantizeFp8Block(std::span<const float> values, int64_t rows,
                                                   int64_t cols, int64_t block) {
  int64_t numel = 0;
  if (rows < 0 || cols < 0 || block <= 0 || MulOverflows(rows, cols, &numel) ||
      static_cast<uint64_t>(numel) != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat("FP8 block quantization of [", rows, ", ", cols,
                                                   "] with block ", block, ": got ",
                                                   values.size(), " values"));
  }
  Fp8BlockQuantized q;
  q.scale_rows = CeilDiv(rows, block);
  q.scale_cols = CeilDiv(cols, block);
  q.scale_inv.assign(static_cast<size_t>(q.scale_rows * q.scale_cols), 0.0f);
  q.codes.resize(static_cast<size_t>(numel));
  // Pass 1: per-tile amax.
  for (int64_t r = 0; r < rows; ++r) {
    float* scale_row = q.scale_inv.data() + (r / block) * q.scale_cols;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = values[r * cols + c];
      if (!std::isfinite(v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("FP8 block quantization: value at [", r, ", ", c, "] is not finite"));
      }
      scale_row[c / block] = std::max(scale_row[c / block], std::fabs(v));
    }
  }
  // An all-zero tile gets scale 1; a tile so small that amax / 448 underflows gets the
  // smallest normal scale, so dividing by it stays finite.
  for (float& s : q.scale_inv) {
    s = s > 0.0f ? std::max(s / kFp8E4M3Max, std::numeric_limits<float>::min()) : 1.0f;
  }
  // Pass 2: codes.
  for (int64_t r = 0; r < rows; ++r) {
    const float* scale_row = q.scale_inv.data() + (r / block) * q.scale_cols;
    for (int64_t c = 0; c < cols; ++c) {
      q.codes[r * cols + c] =
          static_cast<std::byte>(FloatToFp8E4M3(values[r * cols + c] / scale_row[c / block]));
    }
  }
  return q;
}

}  // namespace nq::model
