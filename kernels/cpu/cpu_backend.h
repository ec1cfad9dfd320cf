// The CPU backend: host memory and the fp32 reference ops of kernels/cpu/ops.h. It is the oracle
// the CUDA backend is tested against and what CI runs the whole cluster on.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "kernels/backend.h"

namespace nq::kernels::cpu {

class CpuBackend final : public Backend {
 public:
  // `threads` <= 0 picks std::thread::hardware_concurrency().
  explicit CpuBackend(int threads);

  std::string_view name() const override { return "cpu"; }
  std::string DeviceDescription() const override;
  // CPU ops complete before they return.
  absl::Status Synchronize() override { return absl::OkStatus(); }

 protected:
  absl::StatusOr<std::unique_ptr<Storage>> AllocateStorage(std::size_t bytes) override;
  absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) override;
  absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) override;
  absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) override;
  absl::Status DoMatMul(const Tensor& x, const Tensor& w, Tensor& y,
                        const MatMulDims& dims) override;
  absl::Status DoRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                         const RowDims& dims) override;
  absl::Status DoSiluAndMul(const Tensor& x, Tensor& y, const RowDims& dims) override;
  absl::Status DoSoftmax(const Tensor& x, float scale, Tensor& y, const RowDims& dims) override;

 private:
  int threads_;
};

}  // namespace nq::kernels::cpu
