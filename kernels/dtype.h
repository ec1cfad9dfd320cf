// Element types a backend tensor can hold, and the host/device conversions between them.
//
// This header is shared by host code (g++) and CUDA code (nvcc): it has no absl and no CUDA
// dependency, so kernels can name the storage types directly as template parameters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__CUDACC__)
#define NQ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NQ_HOST_DEVICE inline
#endif

namespace nq::kernels {

// Storage dtypes. Names follow safetensors ("F32", "BF16", "F16", "I32", "F8_E4M3") so checkpoint
// headers map one to one. I32 holds indices (the DSA indexer's selected keys); U8 holds raw bytes
// (NestQuant's packed code planes, kernels/nq_moe.h). F8_E4M3 holds the OCP "e4m3fn" weights of
// FP8 checkpoints (DeepSeek-V3, GLM-5), which are meaningful only with their block scales
// (Backend::MatMulBlockScaled); the order of the first three is relied on by kernel tables.
enum class DType : std::uint8_t { kF32, kBF16, kF16, kI32, kU8, kF8E4M3 };

constexpr std::size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kU8: return 1;
    case DType::kF8E4M3: return 1;
  }
  return 0;
}

// Whether `dtype` holds floating-point values an op may widen on its own (what VisitFloatDType
// accepts). F8_E4M3 is not one: its values need the block scales stored beside them, so only ops
// that take those scales accept it.
constexpr bool IsFloatDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
    case DType::kBF16:
    case DType::kF16:
      return true;
    case DType::kI32:
    case DType::kU8:
    case DType::kF8E4M3:
      return false;
  }
  return false;
}

constexpr const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kI32: return "I32";
    case DType::kU8: return "U8";
    case DType::kF8E4M3: return "F8_E4M3";
  }
  return "?";
}

// 16-bit floats as plain bit patterns: host code needs no CUDA headers to hold or convert them,
// and kernels convert them in registers while loading.
struct Bf16 {
  std::uint16_t bits;
};
struct F16 {
  std::uint16_t bits;
};
// OCP FP8 E4M3 ("e4m3fn"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, the
// two patterns S.1111.111 (0x7f, 0xff) are NaN, the largest finite value is 448.
struct F8E4M3 {
  std::uint8_t bits;
};

// Side of the square weight blocks that share one scale in FP8 checkpoints (w = fp8 * scale_inv):
// DeepSeek-V3's and GLM-5's quantization_config `weight_block_size` [128, 128].
inline constexpr int kWeightScaleBlock = 128;

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kF32;
};
template <>
struct DTypeOf<Bf16> {
  static constexpr DType value = DType::kBF16;
};
template <>
struct DTypeOf<F16> {
  static constexpr DType value = DType::kF16;
};
template <>
struct DTypeOf<F8E4M3> {
  static constexpr DType value = DType::kF8E4M3;
};
template <>
struct DTypeOf<std::int32_t> {
  static constexpr DType value = DType::kI32;
};
template <>
struct DTypeOf<std::uint8_t> {
  static constexpr DType value = DType::kU8;
};

NQ_HOST_DEVICE float BitsToFloat(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

NQ_HOST_DEVICE std::uint32_t FloatToBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// bf16 is the top half of an fp32: widening is exact.
NQ_HOST_DEVICE float ToFloat(Bf16 v) { return BitsToFloat(std::uint32_t{v.bits} << 16); }

// IEEE binary16 -> fp32, exact (normals, subnormals, inf, NaN).
NQ_HOST_DEVICE float ToFloat(F16 v) {
  const std::uint32_t sign = std::uint32_t{v.bits & 0x8000u} << 16;
  const std::uint32_t exponent = (v.bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1f) return BitsToFloat(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  // Zero or subnormal: mantissa * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
  return sign != 0 ? -magnitude : magnitude;
}

// OCP E4M3 -> fp32, exact: normals (1 + m/8) * 2^(e-7), subnormals m/8 * 2^-6, NaN for 0x7f/0xff.
NQ_HOST_DEVICE float ToFloat(F8E4M3 v) {
  const std::uint32_t sign = std::uint32_t{v.bits & 0x80u} << 24;
  const std::uint32_t exponent = (v.bits >> 3) & 0xfu;
  const std::uint32_t mantissa = v.bits & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return BitsToFloat(sign | 0x7fc00000u);
  if (exponent != 0) return BitsToFloat(sign | ((exponent + 120u) << 23) | (mantissa << 20));
  const float magnitude = static_cast<float>(mantissa) * 0.001953125f;  // m * 2^-9, exact
  return sign != 0 ? -magnitude : magnitude;
}

NQ_HOST_DEVICE float ToFloat(float v) { return v; }

// fp32 -> bf16, round to nearest even; NaN stays a (quiet) NaN.
NQ_HOST_DEVICE Bf16 ToBf16(float f) {
  std::uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<std::uint16_t>((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<std::uint16_t>(u >> 16)};
}

// fp32 -> IEEE binary16, round to nearest even, overflow to inf (F. Giesen's
// float_to_half_fast3_rtne, public domain).
NQ_HOST_DEVICE F16 ToF16(float f) {
  constexpr std::uint32_t kF16Overflow = (127u + 16u) << 23;     // 65536.0f
  constexpr std::uint32_t kF16MinNormal = 113u << 23;            // 2^-14
  constexpr std::uint32_t kDenormMagic = ((127u - 15u) + (23u - 10u) + 1u) << 23;
  std::uint32_t u = FloatToBits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  std::uint32_t out;
  if (u >= kF16Overflow) {
    out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < kF16MinNormal) {
    // The float add rounds the mantissa into place (to nearest even) for subnormal results.
    out = FloatToBits(BitsToFloat(u) + BitsToFloat(kDenormMagic)) - kDenormMagic;
  } else {
    const std::uint32_t mantissa_odd = (u >> 13) & 1u;
    u += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu + mantissa_odd;
    out = u >> 13;
  }
  return F16{static_cast<std::uint16_t>(out | sign)};
}

template <typename T>
NQ_HOST_DEVICE T FromFloat(float f);
template <>
NQ_HOST_DEVICE float FromFloat<float>(float f) {
  return f;
}
template <>
NQ_HOST_DEVICE Bf16 FromFloat<Bf16>(float f) {
  return ToBf16(f);
}
template <>
NQ_HOST_DEVICE F16 FromFloat<F16>(float f) {
  return ToF16(f);
}

// Calls fn(T{}) with T the storage type of `dtype` (float, Bf16 or F16), so one generic lambda
// serves every floating dtype: VisitFloatDType(d, [&](auto tag) { using T = decltype(tag); ... }).
// Precondition: IsFloatDType(dtype). Callers validate dtypes first (Backend's ops, tensor_io), so
// an integer dtype here is a programming error.
template <typename Fn>
decltype(auto) VisitFloatDType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: return fn(float{});
    case DType::kBF16: return fn(Bf16{});
    case DType::kF16: return fn(F16{});
    case DType::kI32:
    case DType::kU8:
    case DType::kF8E4M3:
      break;
  }
  std::abort();
}

}  // namespace nq::kernels
