#include "kernels/cpu/cpu_backend.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu/nq_moe.h"
#include "kernels/cpu/nvfp4_moe.h"
#include "kernels/cpu/ops.h"
#include "services/common/status_macros.h"

namespace nq::kernels::cpu {
namespace {

// 64-byte alignment: a cache line, and enough for any SIMD load the reference code may use.
constexpr std::size_t kHostAlignment = 64;

class HostStorage final : public Storage {
 public:
  HostStorage(void* data, std::size_t bytes) : Storage(data, bytes) {}
  ~HostStorage() override { std::free(data()); }
};

// The position an op runs at: the host value, or the device tensor's (host memory on this
// backend), read now that the op runs.
absl::StatusOr<std::int64_t> RunPosition(absl::string_view op, const StepPosition& p) {
  if (p.device() == nullptr) return p.bound();
  const std::int32_t value = *p.device()->data_as<std::int32_t>();
  if (value < 0 || value > p.bound()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": the device position holds ", value,
                                                   ", outside [0, ", p.bound(), "] (its bound)"));
  }
  return value;
}

}  // namespace

CpuBackend::CpuBackend(int threads, bool float64_attention)
    : threads_(threads > 0 ? threads
                           : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))),
      float64_attention_(float64_attention) {}

std::string CpuBackend::DeviceDescription() const {
  return absl::StrCat("cpu (", threads_, " threads", float64_attention_ ? ", float64 attention" : "",
                      ")");
}

absl::StatusOr<std::unique_ptr<Storage>> CpuBackend::AllocateStorage(std::size_t bytes) {
  if (bytes == 0) return std::make_unique<HostStorage>(nullptr, 0);
  // aligned_alloc wants a size that is a multiple of the alignment.
  const std::size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
  if (rounded < bytes) return absl::ResourceExhaustedError("host allocation size overflows");
  void* data = std::aligned_alloc(kHostAlignment, rounded);
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("out of host memory (", bytes, " bytes)"));
  }
  return std::make_unique<HostStorage>(data, bytes);
}

absl::Status CpuBackend::DoCopyFromHost(const void* src, std::size_t bytes, void* dst) {
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoCopyToHost(const void* src, std::size_t bytes, void* dst) {
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoCopy(const void* src, std::size_t bytes, void* dst) {
  std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoMatMul(const Tensor& x, const Tensor& w, Tensor& y,
                                  const MatMulDims& dims) {
  cpu::MatMul(x.data_as<float>(), w.data(), w.dtype(), y.data_as<float>(), dims, threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoMatMulBlockScaled(const Tensor& x, const Tensor& w_fp8,
                                             const Tensor& scale_inv, Tensor& y,
                                             const MatMulDims& dims) {
  cpu::MatMulBlockScaled(x.data_as<float>(), w_fp8.data_as<F8E4M3>(), scale_inv.data_as<float>(),
                         y.data_as<float>(), dims, threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                                   const RowDims& dims) {
  cpu::RmsNorm(x.data_as<float>(), weight.data(), weight.dtype(), eps, y.data_as<float>(), dims,
          threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSiluAndMul(const Tensor& x, Tensor& y, const RowDims& dims) {
  cpu::SiluAndMul(x.data_as<float>(), y.data_as<float>(), dims, threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSoftmax(const Tensor& x, float scale, Tensor& y,
                                   const RowDims& dims) {
  cpu::Softmax(x.data_as<float>(), scale, y.data_as<float>(), dims, threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoEmbedding(std::span<const std::int32_t> ids, const Tensor& table,
                                     Tensor& out) {
  cpu::Embedding(ids, table.data(), table.dtype(), table.shape().dim(1), out.data_as<float>(),
                 threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoEmbeddingDevice(const Tensor& ids, const Tensor& table, Tensor& out) {
  const std::span<const std::int32_t> values(ids.data_as<std::int32_t>(), static_cast<std::size_t>(ids.NumElements()));
  const std::int64_t vocab = table.shape().dim(0);
  for (std::size_t t = 0; t < values.size(); ++t) {
    if (values[t] < 0 || values[t] >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("Embedding: ids[", t, "] = ", values[t], " is outside the table's ", vocab, " rows"));
    }
  }
  return DoEmbedding(values, table, out);
}

absl::Status CpuBackend::DoAdd(const Tensor& a, const Tensor& b, Tensor& out) {
  cpu::Add(a.data_as<float>(), b.data_as<float>(), out.data_as<float>(), out.NumElements(),
           threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoRope(Tensor& x, const StepPosition& start,
                                std::span<const float> inv_freq, float attention_scaling,
                                bool interleaved) {
  ASSIGN_OR_RETURN(const std::int64_t start_pos, RunPosition("Rope", start));
  cpu::Rope({.x = x.data_as<float>(),
             .tokens = x.shape().dim(0),
             .heads = x.shape().dim(1),
             .dim = x.shape().dim(2),
             .start_pos = start_pos,
             .inv_freq = inv_freq,
             .attention_scaling = attention_scaling,
             .interleaved = interleaved},
            threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoLayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                     float eps, Tensor& y, const RowDims& dims) {
  cpu::LayerNorm(x.data_as<float>(), weight.data_as<float>(), bias.data_as<float>(), eps,
                 y.data_as<float>(), dims, threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoWriteRows(const Tensor& src, Tensor& dst, const StepPosition& offset) {
  ASSIGN_OR_RETURN(const std::int64_t row_offset, RunPosition("WriteRows", offset));
  // The destination rows are contiguous: one copy, or one conversion into a BF16 cache.
  const std::int64_t first = row_offset * dst.shape().dim(1);
  if (dst.dtype() == DType::kU8) {  // packed FP8 rows (kernels/kv_fp8.h)
    const std::int64_t c = src.shape().dim(1), width = dst.shape().dim(1);
    for (std::int64_t i = 0; i < src.shape().dim(0); ++i) {
      PackKvFp8Row(src.data_as<float>() + i * c, c, dst.data_as<std::uint8_t>() + first + i * width);
    }
    return absl::OkStatus();
  }
  if (dst.dtype() == DType::kBF16) {
    cpu::FloatsToBf16(src.data_as<float>(), src.NumElements(), dst.data_as<Bf16>() + first,
                      threads_);
    return absl::OkStatus();
  }
  std::memcpy(dst.data_as<float>() + first, src.data(), src.nbytes());
  return absl::OkStatus();
}

absl::Status CpuBackend::DoGatherRows(const Tensor& x, std::span<const std::int32_t> rows,
                                      Tensor& out) {
  cpu::GatherRows(x.data_as<float>(), rows, x.shape().dim(1), out.data_as<float>(), threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoScatterAddRows(const Tensor& src, std::span<const std::int32_t> rows,
                                          std::span<const float> weights, Tensor& out) {
  cpu::ScatterAddRows(src.data_as<float>(), rows, weights, src.shape().dim(1),
                      out.data_as<float>(), threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoMlaAttention(const Tensor& q_nope, const Tensor& q_pe,
                                        const Tensor& kv_latent, const Tensor& k_pe,
                                        const Tensor& w_uk, const Tensor& w_uv,
                                        const Tensor* selected, const StepPosition& start,
                                        float scale, Tensor& out) {
  ASSIGN_OR_RETURN(const std::int64_t start_pos, RunPosition("MlaAttention", start));
  // A BF16 cache is widened to fp32 (exactly) and attended like an F32 one: the CPU backend is
  // the oracle the CUDA kernels are checked against, so it computes in one precision only.
  // Only the rows a query can see (s < start_pos + T) are read, so only those are widened: the
  // cost follows the context, not the cache's size.
  const std::int64_t visible_rows = start_pos + q_nope.shape().dim(0);
  std::vector<float> latent_wide, rope_wide;
  const float* latent = nullptr;
  const float* rope = nullptr;
  auto widen = [visible_rows](const Tensor& t, std::vector<float>& wide) {
    const Bf16* v = t.data_as<Bf16>();
    wide.resize(static_cast<std::size_t>(visible_rows * t.shape().dim(1)));
    for (std::size_t i = 0; i < wide.size(); ++i) wide[i] = ToFloat(v[i]);
    return wide.data();
  };
  if (kv_latent.dtype() == DType::kU8) {
    // Packed FP8 rows (kernels/kv_fp8.h): each visible row unpacked to fp32, the rope key widened.
    const std::int64_t c = w_uk.shape().dim(2), width = kv_latent.shape().dim(1);
    latent_wide.resize(static_cast<std::size_t>(visible_rows * c));
    for (std::int64_t s = 0; s < visible_rows; ++s) {
      UnpackKvFp8Row(kv_latent.data_as<std::uint8_t>() + s * width, c, latent_wide.data() + s * c);
    }
    latent = latent_wide.data();
    rope = widen(k_pe, rope_wide);
  } else if (kv_latent.dtype() == DType::kBF16) {
    latent = widen(kv_latent, latent_wide);
    rope = widen(k_pe, rope_wide);
  } else {
    latent = kv_latent.data_as<float>();
    rope = k_pe.data_as<float>();
  }
  const MlaAttentionParams params{.q_nope = q_nope.data_as<float>(),
                                  .q_pe = q_pe.data_as<float>(),
                                  .kv_latent = latent,
                                  .k_pe = rope,
                                  .w_uk = w_uk.data(),
                                  .w_uk_dtype = w_uk.dtype(),
                                  .w_uv = w_uv.data(),
                                  .w_uv_dtype = w_uv.dtype(),
                                  .selected = selected != nullptr ? selected->data_as<std::int32_t>() : nullptr,
                                  .out = out.data_as<float>(),
                                  .tokens = q_nope.shape().dim(0),
                                  .heads = q_nope.shape().dim(1),
                                  .dn = q_nope.shape().dim(2),
                                  .dr = q_pe.shape().dim(2),
                                  .c = w_uk.shape().dim(2),
                                  .dv = w_uv.shape().dim(1),
                                  .keys = kv_latent.dtype() == DType::kF32 ? kv_latent.shape().dim(0) : visible_rows,
                                  .top_k = selected != nullptr ? selected->shape().dim(1) : 0,
                                  .start_pos = start_pos,
                                  .scale = scale};
  if (float64_attention_) {
    cpu::MlaAttentionF64(params, threads_);
  } else {
    cpu::MlaAttention(params, threads_);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoIndexerTopK(const Tensor& q, const Tensor& k, const Tensor& weights,
                                       const StepPosition& start, Tensor& selected) {
  ASSIGN_OR_RETURN(const std::int64_t start_pos, RunPosition("IndexerTopK", start));
  cpu::IndexerTopK({.q = q.data_as<float>(),
                    .k = k.data_as<float>(),
                    .weights = weights.data_as<float>(),
                    .selected = selected.data_as<std::int32_t>(),
                    .tokens = q.shape().dim(0),
                    .heads = q.shape().dim(1),
                    .dim = q.shape().dim(2),
                    .keys = k.shape().dim(0),
                    .top_k = selected.shape().dim(1),
                    .start_pos = start_pos},
                   threads_);
  return absl::OkStatus();
}

absl::Status CpuBackend::DoMoeRoute(const Tensor& logits, const Tensor* bias, const MoeRouteParams& params,
                                    Tensor& ids, Tensor& weights) {
  std::span<const float> bias_values;
  if (bias != nullptr) bias_values = {bias->data_as<float>(), static_cast<size_t>(bias->NumElements())};
  RouteTokensHost({logits.data_as<float>(), static_cast<size_t>(logits.NumElements())}, bias_values, params,
                  {ids.data_as<std::int32_t>(), static_cast<size_t>(ids.NumElements())},
                  {weights.data_as<float>(), static_cast<size_t>(weights.NumElements())});
  return absl::OkStatus();
}

absl::Status CpuBackend::DoSampleTokens(const Tensor& logits, const Tensor& params, Tensor& ids) {
  const std::int64_t rows = logits.shape().dim(0), vocab = logits.shape().dim(1);
  for (std::int64_t r = 0; r < rows; ++r) {
    SampleParams p;
    std::memcpy(&p, params.data_as<std::uint8_t>() + r * static_cast<std::int64_t>(sizeof(SampleParams)), sizeof(p));
    if (const char* error = SampleParamsError(p); *error != '\0') {
      return absl::InvalidArgumentError(absl::StrCat("SampleTokens: row ", r, ": ", error));
    }
    ids.data_as<std::int32_t>()[r] =
        SampleRowHost({logits.data_as<float>() + r * vocab, static_cast<size_t>(vocab)}, p);
  }
  return absl::OkStatus();
}

absl::Status CpuBackend::DoNqMoe(const NqMoeParams& params) { return cpu::NqMoe(params, threads_); }

absl::Status CpuBackend::DoNvfp4Moe(const Nvfp4MoeParams& params) { return cpu::Nvfp4Moe(params, threads_); }

absl::Status CpuBackend::DoApplySlotMailbox(const SlotMailboxRow& row, Tensor& applied, Tensor& slot_of_expert) {
  ApplySlotMailboxRowHost(row, static_cast<std::uint64_t*>(applied.data()), slot_of_expert.data_as<std::int32_t>());
  return absl::OkStatus();
}

}  // namespace nq::kernels::cpu
