// The compute backend the model code calls (DESIGN.md "Backends"): memory, copies and ops, with
// a CPU implementation (fp32 reference, kernels/cpu/) and a CUDA one (kernels/cuda/).
//
// Public ops validate their arguments here, once for every backend (dtype, shape, ownership), and
// then call the backend's Do* hook with the dimensions already worked out; an implementation only
// computes. Errors are InvalidArgumentError naming the op, the argument and the shapes, so a bad
// call never reaches a kernel.
//
// Execution model: ops are enqueued in order on the backend's one stream and may run
// asynchronously (CUDA); Synchronize() waits for them and reports any asynchronous failure.
// CopyToHost returns only once the data is on the host. A Backend is not thread-safe: one
// thread drives it (the worker's decode loop).
//
// Later issues add ops here in the same shape (public validating method + Do* hook): MLA
// attention, RoPE, routing, NestQuant dequant-GEMV. The tensor-parallel communicator is a
// separate interface.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/dtype.h"
#include "kernels/tensor.h"

namespace nq::kernels {

// Geometry of y[m, n] = x[m, k] · w[n, k]^T after validation (leading dims of x folded into m).
struct MatMulDims {
  std::int64_t m = 0;
  std::int64_t n = 0;
  std::int64_t k = 0;
};

// Geometry of a row-wise op over the last dim: `rows` rows of `cols` contiguous elements.
struct RowDims {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  // "cpu" or "cuda".
  virtual std::string_view name() const = 0;
  // Human-readable device, e.g. "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" or "cpu (16 threads)".
  virtual std::string DeviceDescription() const = 0;
  // Unique per backend instance in this process; tensors carry it (Tensor::backend_id()).
  std::uint64_t id() const { return id_; }

  // ---- Memory ----

  // A new uninitialised row-major tensor. InvalidArgumentError for a negative dimension or a
  // size that overflows; ResourceExhaustedError when the device is out of memory.
  absl::StatusOr<Tensor> Allocate(DType dtype, Shape shape);

  // Copies exactly dst.nbytes() bytes from host memory; `src` may be reused once this returns.
  absl::Status CopyFromHost(std::span<const std::byte> src, Tensor& dst);
  // Copies exactly src.nbytes() bytes to host memory, after all work enqueued before it.
  absl::Status CopyToHost(const Tensor& src, std::span<std::byte> dst);
  // Device-to-device copy between two tensors of this backend with equal dtype and shape.
  absl::Status Copy(const Tensor& src, Tensor& dst);

  // Waits for every enqueued op; returns the first asynchronous error, if any.
  virtual absl::Status Synchronize() = 0;

  // ---- Ops (F32 activations, F32 accumulation and output) ----

  // Linear layer: y[..., n] = x[..., k] · w[n, k]^T, weights stored [out, in] as in HF
  // checkpoints. x: F32 [..., k]; w: F32, BF16 or F16 [n, k]; y: F32 [..., n]. y must not be x.
  absl::Status MatMul(const Tensor& x, const Tensor& w, Tensor& y);

  // y = x / sqrt(mean(x^2 over the last dim) + eps) * weight. x, y: F32 [..., d] (y may be x);
  // weight: F32, BF16 or F16 [d]; eps >= 0 and finite.
  absl::Status RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y);

  // y[..., j] = silu(x[..., j]) * x[..., d + j] for j < d (gate first, then up, as vLLM's
  // silu_and_mul). x: F32 [..., 2d]; y: F32 [..., d]; y must not be x.
  absl::Status SiluAndMul(const Tensor& x, Tensor& y);

  // y = softmax(scale * x) over the last dim, computed stably (max subtracted). A row that is
  // entirely -inf (fully masked) gives zeros. x, y: F32 [..., n] (y may be x); scale finite.
  absl::Status Softmax(const Tensor& x, float scale, Tensor& y);

 protected:
  Backend();

  // Wraps memory this backend allocated into a tensor stamped with this backend's id.
  Tensor MakeTensor(std::unique_ptr<Storage> storage, DType dtype, Shape shape) const;

  // Hooks; arguments are validated (dtypes, shapes, ownership, non-overlap where required).
  virtual absl::StatusOr<std::unique_ptr<Storage>> AllocateStorage(std::size_t bytes) = 0;
  virtual absl::Status DoCopyFromHost(const void* src, std::size_t bytes, void* dst) = 0;
  virtual absl::Status DoCopyToHost(const void* src, std::size_t bytes, void* dst) = 0;
  virtual absl::Status DoCopy(const void* src, std::size_t bytes, void* dst) = 0;
  virtual absl::Status DoMatMul(const Tensor& x, const Tensor& w, Tensor& y,
                                const MatMulDims& dims) = 0;
  virtual absl::Status DoRmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y,
                                 const RowDims& dims) = 0;
  // dims.cols is d, the width of y (x has 2d columns).
  virtual absl::Status DoSiluAndMul(const Tensor& x, Tensor& y, const RowDims& dims) = 0;
  virtual absl::Status DoSoftmax(const Tensor& x, float scale, Tensor& y,
                                 const RowDims& dims) = 0;

 private:
  // InvalidArgumentError unless `t` is a non-empty tensor allocated by this backend.
  absl::Status CheckOwned(absl::string_view op, absl::string_view arg, const Tensor& t) const;

  std::uint64_t id_;
};

struct BackendOptions {
  // CUDA device ordinal.
  int device = 0;
  // CPU worker threads for large ops; 0 picks std::thread::hardware_concurrency().
  int cpu_threads = 0;
};

// Whether `name` ("cpu", "cuda") was compiled into this build.
bool IsBackendCompiledIn(std::string_view name);

// Creates a backend by name. "cuda" in a build without CUDA is UnimplementedError; "cuda" with no
// usable device (no device or driver, kernels not built for its architecture) is
// FailedPreconditionError; an unknown name or a device ordinal out of range is
// InvalidArgumentError.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                       const BackendOptions& options = {});

}  // namespace nq::kernels
