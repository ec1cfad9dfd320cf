// LaunchMlaAttention: the (w_uk, w_uv) dtype pair picks the instantiation by one table lookup.
#include "absl/strings/str_cat.h"
#include "kernels/cuda/mla_attention.cuh"

namespace nq::kernels::cuda {
namespace {

using Launcher = absl::Status (*)(const MlaAttentionParams&, std::size_t, const LaunchContext&);

template <typename KvT, typename UkT, typename UvT>
absl::Status Launch(const MlaAttentionParams& p, std::size_t shared_bytes,
                    const LaunchContext& ctx) {
  const dim3 grid(static_cast<unsigned>(std::int64_t{p.tokens} * p.heads));
  MlaAttentionKernel<KvT, UkT, UvT><<<grid, kMlaThreads, shared_bytes, ctx.stream>>>(p);
  return CheckLaunch("MlaAttentionKernel");
}

// [kv cache: F32, BF16, FP8 rows][w_uk][w_uv: F32, BF16].
constexpr Launcher kLaunchers[3][2][2] = {
    {{&Launch<float, float, float>, &Launch<float, float, Bf16>},
     {&Launch<float, Bf16, float>, &Launch<float, Bf16, Bf16>}},
    {{&Launch<Bf16, float, float>, &Launch<Bf16, float, Bf16>},
     {&Launch<Bf16, Bf16, float>, &Launch<Bf16, Bf16, Bf16>}},
    {{&Launch<KvFp8, float, float>, &Launch<KvFp8, float, Bf16>},
     {&Launch<KvFp8, Bf16, float>, &Launch<KvFp8, Bf16, Bf16>}},
};

// The index of kLaunchers for a weight dtype, or -1.
int WeightIndex(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 0;
    case DType::kBF16: return 1;
    default: return -1;
  }
}

int CacheIndex(DType dtype) { return dtype == DType::kU8 ? 2 : WeightIndex(dtype); }

}  // namespace

absl::Status LaunchMlaAttention(const MlaAttentionParams& p, const LaunchContext& ctx) {
  if (p.tokens < 0 || p.heads < 0 || p.dn < 0 || p.dr < 0 || p.c < 0 || p.dv < 0 ||
      p.start_pos < 0 || std::int64_t{p.tokens} * p.heads > kMaxGridX ||
      (p.selected != nullptr && p.top_k < 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MlaAttention: unsupported size tokens=", p.tokens, " heads=", p.heads, " dn=", p.dn,
        " dr=", p.dr, " c=", p.c, " dv=", p.dv, " top_k=", p.top_k, " start_pos=", p.start_pos));
  }
  const int kv = CacheIndex(p.kv_dtype);
  const int uk = WeightIndex(p.w_uk_dtype);
  const int uv = WeightIndex(p.w_uv_dtype);
  if (kv < 0 || uk < 0 || uv < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MlaAttention: no CUDA kernel for a ", DTypeName(p.kv_dtype), " cache with w_uk ",
        DTypeName(p.w_uk_dtype), " and w_uv ", DTypeName(p.w_uv_dtype),
        " (a cache of F32, BF16 or U8 FP8 rows; weights F32 or BF16)"));
  }
  const std::size_t shared_bytes = MlaSharedBytes(p.dn, p.dr, p.c);
  if (shared_bytes > kMlaMaxSharedBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MlaAttention: dn=", p.dn, " dr=", p.dr, " c=", p.c, " need ", shared_bytes,
        " bytes of shared memory per block; the CUDA kernel supports up to ", kMlaMaxSharedBytes));
  }
  if (p.tokens == 0 || p.heads == 0) return absl::OkStatus();
  return kLaunchers[kv][uk][uv](p, shared_bytes, ctx);
}

}  // namespace nq::kernels::cuda
