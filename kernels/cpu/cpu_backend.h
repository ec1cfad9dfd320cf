// The CPU backend: host memory and the fp32 reference ops of kernels/cpu/ops.h. It is the oracle
// the CUDA backend is tested against and what CI runs the whole cluster on.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "kernels/backend.h"

namespace nq::kernels::cpu {

class CpuBackend final : public Backend {
 public:
  // `threads` <= 0 picks std::thread::hardware_concurrency(). `float64_attention` runs the float64
  // MlaAttention reference instead of the fp32 kernel (ops.h).
  explicit CpuBackend(int threads, bool float64_attention = false);

  std::string_view name() const override { return "cpu"; }
  bool AppliesNqLowRank() const override { return true; }
  std::string DeviceDescription() const override;
  // CPU ops complete before they return.
  absl::Status Synchronize() override { return RefuseWithSideWorkOpen("Synchronize"); }

 protected:
  absl::StatusOr<std::unique_ptr<Storage>> AllocateStorage(std::size_t bytes) override;
  absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) override;
  absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) override;
  absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) override;
  absl::Status DoMatMul(const Tensor& x, const Tensor& w, Tensor& y,
                        const MatMulDims& dims) override;
  absl::Status DoMatMulBlockScaled(const Tensor& x, const Tensor& w_fp8, const Tensor& scale_inv,
                                   Tensor& y, const MatMulDims& dims) override;
  absl::Status DoRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                         const RowDims& dims) override;
  absl::Status DoSiluAndMul(const Tensor& x, Tensor& y, const RowDims& dims) override;
  absl::Status DoSoftmax(const Tensor& x, float scale, Tensor& y, const RowDims& dims) override;
  absl::Status DoEmbedding(std::span<const std::int32_t> ids, const Tensor& table,
                           Tensor& out) override;
  absl::Status DoEmbeddingDevice(const Tensor& ids, const Tensor& table, Tensor& out) override;
  absl::Status DoAdd(const Tensor& a, const Tensor& b, Tensor& out) override;
  absl::Status DoRope(Tensor& x, const StepPosition& start_pos, std::span<const float> inv_freq,
                      float attention_scaling, bool interleaved) override;
  absl::Status DoLayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps,
                           Tensor& y, const RowDims& dims) override;
  absl::Status DoWriteRows(const Tensor& src, Tensor& dst, const StepPosition& row_offset) override;
  absl::Status DoGatherRows(const Tensor& x, std::span<const std::int32_t> rows,
                            Tensor& out) override;
  absl::Status DoScatterAddRows(const Tensor& src, std::span<const std::int32_t> rows,
                                std::span<const float> weights, Tensor& out) override;
  absl::Status DoMlaAttention(const Tensor& q_nope, const Tensor& q_pe, const Tensor& kv_latent,
                              const Tensor& k_pe, const Tensor& w_uk, const Tensor& w_uv,
                              const Tensor* selected, const StepPosition& start_pos, float scale,
                              Tensor& out) override;
  absl::Status DoIndexerTopK(const Tensor& q, const Tensor& k, const Tensor& weights,
                             const StepPosition& start_pos, Tensor& selected) override;
  absl::Status DoSampleTokens(const Tensor& logits, const Tensor& params, Tensor& ids) override;
  absl::Status DoMoeRoute(const Tensor& logits, const Tensor* bias, const MoeRouteParams& params, Tensor& ids,
                          Tensor& weights) override;
  absl::Status DoNqMoe(const NqMoeParams& params) override;
  absl::Status DoNvfp4Moe(const Nvfp4MoeParams& params) override;
  absl::Status DoApplySlotMailbox(const SlotMailboxRow& row, Tensor& applied, Tensor& slot_of_expert) override;

 private:
  int threads_;
  bool float64_attention_;
};

}  // namespace nq::kernels::cpu
