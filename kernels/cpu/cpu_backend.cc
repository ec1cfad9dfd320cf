#include "kernels/cpu/cpu_backend.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/ops.h"

namespace nq::kernels::cpu {
namespace {

// 64-byte alignment: a cache line, and enough for any SIMD load the reference code may use.
constexpr std::size_t kHostAlignment = 64;

class HostStorage final : public Storage {
 public:
  HostStorage(void* data, std::size_t bytes) : Storage(data, bytes) {}
  ~HostStorage() override { std::free(data()); }
};

}  // namespace

CpuBackend::CpuBackend(int threads)
    : threads_(threads > 0 ? threads
                           : std::max(1, static_cast<int>(std::thread::hardware_concurrency()))) {}

std::string CpuBackend::DeviceDescription() const {
  return absl::StrCat("cpu (", threads_, " threads)");
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

}  // namespace nq::kernels::cpu
