// Loads of weight elements widened to fp32 in registers: the "convert in the load" every kernel
// uses for BF16 / F16 weights, so no kernel ever stages a widened copy in memory.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace nq::kernels::cuda {

__device__ __forceinline__ float LoadFloat(const float* p) { return __ldg(p); }
__device__ __forceinline__ float LoadFloat(const Bf16* p) {
  return __uint_as_float(std::uint32_t{__ldg(reinterpret_cast<const unsigned short*>(p))} << 16);
}
__device__ __forceinline__ float LoadFloat(const F16* p) {
  return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(p))));
}
__device__ __forceinline__ float LoadFloat(const F8E4M3* p) {
  return ToFloat(F8E4M3{__ldg(reinterpret_cast<const unsigned char*>(p))});
}

// Widens two 16-bit values packed in one 32-bit word (element 0 in the low half).
__device__ __forceinline__ void Widen2(std::uint32_t packed, Bf16, float* out) {
  out[0] = __uint_as_float(packed << 16);
  out[1] = __uint_as_float(packed & 0xffff0000u);
}
__device__ __forceinline__ void Widen2(std::uint32_t packed, F16, float* out) {
  out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(packed & 0xffffu)));
  out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(packed >> 16)));
}

// Widens four E4M3 values packed in one 32-bit word (element 0 in the low byte), exactly: the
// sm_89+ cvt turns two E4M3 into two f16, which hold every E4M3 value (subnormals included) and
// keep NaN a NaN, in one instruction instead of the bit assembly of ToFloat(F8E4M3).
__device__ __forceinline__ void Widen4(std::uint32_t packed, F8E4M3, float* out) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(packed & 0xffffu), __NV_E4M3);
  const __half2_raw hi =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(packed >> 16), __NV_E4M3);
  out[0] = __half2float(__ushort_as_half(lo.x));
  out[1] = __half2float(__ushort_as_half(lo.y));
  out[2] = __half2float(__ushort_as_half(hi.x));
  out[3] = __half2float(__ushort_as_half(hi.y));
}

// Elements of T in one 16-byte load.
template <typename T>
inline constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// Loads kVec16<T> consecutive elements at `p` (16-byte aligned) as floats.
__device__ __forceinline__ void Load16B(const float* p, float* out) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
template <typename T>
__device__ __forceinline__ void Load16B(const T* p, float* out) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
  Widen2(v.x, T{}, out + 0);
  Widen2(v.y, T{}, out + 2);
  Widen2(v.z, T{}, out + 4);
  Widen2(v.w, T{}, out + 6);
}

// Loads 4 consecutive elements at `p` (aligned to 4 elements) as floats.
__device__ __forceinline__ void Load4(const float* p, float* out) { Load16B(p, out); }
template <typename T>
__device__ __forceinline__ void Load4(const T* p, float* out) {
  const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
  Widen2(v.x, T{}, out + 0);
  Widen2(v.y, T{}, out + 2);
}

// 16 bytes of weight codes read once by the decode GEMVs (nvfp4_gemv.cu, nq_gemv_batched.cu): not
// kept in L1 (no other warp reads them). A warp step reads 64 bytes of each of a tile's rows and
// the next step the next 64: asking L2 for the whole 256-byte line (.L2::256B) makes one DRAM
// burst of four steps. p must be 16-byte aligned.
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

}  // namespace nq::kernels::cuda
