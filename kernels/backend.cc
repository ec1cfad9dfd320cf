// Backend: argument validation shared by every implementation (see backend.h).
#include "kernels/backend.h"

#include <atomic>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::kernels {
namespace {

std::atomic<std::uint64_t> next_backend_id{1};

absl::Status CheckDType(absl::string_view op, absl::string_view arg, const Tensor& t,
                        DType want) {
  if (t.dtype() == want) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", arg, " must be ", DTypeName(want), ", got ", t.DebugString()));
}

absl::Status CheckRank(absl::string_view op, absl::string_view arg, const Tensor& t, int rank) {
  if (t.shape().rank() == rank) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", arg, " must have rank ", rank, ", got ", t.DebugString()));
}

// Ops over the last dim take any rank >= 1 and fold the leading dims into rows.
absl::Status CheckHasLastDim(absl::string_view op, absl::string_view arg, const Tensor& t) {
  if (t.shape().rank() >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", arg, " must have rank at least 1, got ", t.DebugString()));
}

// y must have exactly `want` as its shape.
absl::Status CheckOutputShape(absl::string_view op, const Tensor& y, const Shape& want,
                              absl::string_view derived_from) {
  if (y.shape() == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": y is ", y.DebugString(), ", expected ",
                                                 want.ToString(), " from ", derived_from));
}

absl::Status CheckDistinct(absl::string_view op, const Tensor& in, absl::string_view in_name,
                           const Tensor& out) {
  if (&in != &out && (in.data() != out.data() || in.nbytes() == 0)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": y must not be the same tensor as ", in_name, " (", in.DebugString(),
                   "); this op does not run in place"));
}

}  // namespace

Backend::Backend() : id_(next_backend_id.fetch_add(1, std::memory_order_relaxed)) {}

Tensor Backend::MakeTensor(std::unique_ptr<Storage> storage, DType dtype, Shape shape) const {
  return Tensor(std::move(storage), dtype, std::move(shape), id_);
}

absl::Status Backend::CheckOwned(absl::string_view op, absl::string_view arg,
                                 const Tensor& t) const {
  if (!t.valid()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", arg, " is an empty tensor"));
  }
  if (t.backend_id() != id_) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", arg, " ", t.DebugString(), " belongs to another backend (id ", t.backend_id(),
        "), not this ", std::string(name()), " backend (id ", id_, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Backend::Allocate(DType dtype, Shape shape) {
  absl::StatusOr<std::int64_t> count = shape.CheckedNumElements();
  if (!count.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("Allocate: ", count.status().message()));
  }
  const std::size_t element_size = DTypeSize(dtype);
  if (static_cast<std::uint64_t>(*count) > SIZE_MAX / element_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("Allocate: ", DTypeName(dtype), shape.ToString(), " overflows size_t"));
  }
  const std::size_t bytes = static_cast<std::size_t>(*count) * element_size;
  absl::StatusOr<std::unique_ptr<Storage>> storage = AllocateStorage(bytes);
  if (!storage.ok()) {
    return Annotate(storage.status(), absl::StrCat("Allocate ", DTypeName(dtype),
                                                   shape.ToString(), " on ", std::string(name())));
  }
  return MakeTensor(*std::move(storage), dtype, std::move(shape));
}

absl::Status Backend::CopyFromHost(std::span<const std::byte> src, Tensor& dst) {
  RETURN_IF_ERROR(CheckOwned("CopyFromHost", "dst", dst));
  if (src.size() != dst.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyFromHost: ", src.size(),
                                                   " bytes given for ", dst.DebugString(), " (",
                                                   dst.nbytes(), " bytes)"));
  }
  if (src.empty()) return absl::OkStatus();
  return DoCopyFromHost(src.data(), src.size(), dst.data());
}

absl::Status Backend::CopyToHost(const Tensor& src, std::span<std::byte> dst) {
  RETURN_IF_ERROR(CheckOwned("CopyToHost", "src", src));
  if (dst.size() != src.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyToHost: ", dst.size(),
                                                   " bytes of room for ", src.DebugString(), " (",
                                                   src.nbytes(), " bytes)"));
  }
  if (dst.empty()) return absl::OkStatus();
  return DoCopyToHost(src.data(), src.nbytes(), dst.data());
}

absl::Status Backend::Copy(const Tensor& src, Tensor& dst) {
  RETURN_IF_ERROR(CheckOwned("Copy", "src", src));
  RETURN_IF_ERROR(CheckOwned("Copy", "dst", dst));
  if (src.dtype() != dst.dtype() || src.shape() != dst.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("Copy: src ", src.DebugString(), " and dst ",
                                                   dst.DebugString(), " differ"));
  }
  if (src.data() == dst.data() || src.nbytes() == 0) return absl::OkStatus();
  return DoCopy(src.data(), src.nbytes(), dst.data());
}

absl::Status Backend::MatMul(const Tensor& x, const Tensor& w, Tensor& y) {
  constexpr absl::string_view kOp = "MatMul";
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "w", w));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  RETURN_IF_ERROR(CheckHasLastDim(kOp, "x", x));
  RETURN_IF_ERROR(CheckRank(kOp, "w", w, 2));
  const MatMulDims dims{.m = x.shape().NumRows(), .n = w.shape().dim(0), .k = w.shape().dim(1)};
  if (x.shape().dim(-1) != dims.k) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": x ", x.DebugString(), " and w ",
                                                   w.DebugString(), " disagree on k (",
                                                   x.shape().dim(-1), " vs ", dims.k, ")"));
  }
  RETURN_IF_ERROR(CheckOutputShape(kOp, y, x.shape().WithLastDim(dims.n),
                                   absl::StrCat("x ", x.DebugString(), " and w ",
                                                w.DebugString())));
  RETURN_IF_ERROR(CheckDistinct(kOp, x, "x", y));
  RETURN_IF_ERROR(CheckDistinct(kOp, w, "w", y));
  if (dims.m == 0 || dims.n == 0) return absl::OkStatus();
  return DoMatMul(x, w, y, dims);
}

absl::Status Backend::RmsNorm(const Tensor& x, const Tensor& weight, float eps, Tensor& y) {
  constexpr absl::string_view kOp = "RmsNorm";
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "weight", weight));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  RETURN_IF_ERROR(CheckHasLastDim(kOp, "x", x));
  RETURN_IF_ERROR(CheckRank(kOp, "weight", weight, 1));
  if (weight.shape().dim(0) != x.shape().dim(-1)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": weight ", weight.DebugString(),
                                                   " does not match the last dim of x ",
                                                   x.DebugString()));
  }
  if (!std::isfinite(eps) || eps < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": eps must be finite and >= 0, got ", eps));
  }
  RETURN_IF_ERROR(CheckOutputShape(kOp, y, x.shape(), absl::StrCat("x ", x.DebugString())));
  const RowDims dims{.rows = x.shape().NumRows(), .cols = x.shape().dim(-1)};
  if (dims.rows == 0 || dims.cols == 0) return absl::OkStatus();
  return DoRmsNorm(x, weight, eps, y, dims);
}

absl::Status Backend::SiluAndMul(const Tensor& x, Tensor& y) {
  constexpr absl::string_view kOp = "SiluAndMul";
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  RETURN_IF_ERROR(CheckHasLastDim(kOp, "x", x));
  if (x.shape().dim(-1) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": the last dim of x ", x.DebugString(), " must be even (gate and up halves)"));
  }
  const RowDims dims{.rows = x.shape().NumRows(), .cols = x.shape().dim(-1) / 2};
  RETURN_IF_ERROR(CheckOutputShape(kOp, y, x.shape().WithLastDim(dims.cols),
                                   absl::StrCat("x ", x.DebugString())));
  RETURN_IF_ERROR(CheckDistinct(kOp, x, "x", y));
  if (dims.rows == 0 || dims.cols == 0) return absl::OkStatus();
  return DoSiluAndMul(x, y, dims);
}

absl::Status Backend::Softmax(const Tensor& x, float scale, Tensor& y) {
  constexpr absl::string_view kOp = "Softmax";
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  RETURN_IF_ERROR(CheckHasLastDim(kOp, "x", x));
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": scale must be finite, got ", scale));
  }
  RETURN_IF_ERROR(CheckOutputShape(kOp, y, x.shape(), absl::StrCat("x ", x.DebugString())));
  const RowDims dims{.rows = x.shape().NumRows(), .cols = x.shape().dim(-1)};
  if (dims.rows == 0 || dims.cols == 0) return absl::OkStatus();
  return DoSoftmax(x, scale, y, dims);
}

}  // namespace nq::kernels
