// Backend: argument validation shared by every implementation (see backend.h).
#include "kernels/backend.h"

#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/fp8_block_quantize.h"
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

absl::Status CheckDTypeIn(absl::string_view op, absl::string_view arg, const Tensor& t,
                          std::initializer_list<DType> allowed) {
  for (DType d : allowed) {
    if (t.dtype() == d) return absl::OkStatus();
  }
  std::string names;
  int i = 0;
  for (DType d : allowed) {
    const bool last = i + 1 == static_cast<int>(allowed.size());
    absl::StrAppend(&names, i == 0 ? "" : (last ? " or " : ", "), DTypeName(d));
    ++i;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", arg, " must be ", names, ", got ", t.DebugString()));
}

// `t` (an output, or an input whose shape follows from others) must have exactly `want` as its
// shape.
absl::Status CheckShape(absl::string_view op, absl::string_view arg, const Tensor& t,
                        const Shape& want, absl::string_view derived_from) {
  if (t.shape() == want) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", arg, " is ", t.DebugString(),
                                                 ", expected ", want.ToString(), " from ",
                                                 derived_from));
}

absl::Status CheckDistinct(absl::string_view op, const Tensor& in, absl::string_view in_name,
                           const Tensor& out, absl::string_view out_name) {
  if (&in != &out && (in.data() != out.data() || in.nbytes() == 0)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": ", out_name, " must not be the same tensor as ", in_name, " (",
                   in.DebugString(), "); this op does not run in place"));
}

// Host row indices (token ids, row lists) must lie in [0, limit); `of` names what they index.
absl::Status CheckIndices(absl::string_view op, absl::string_view arg,
                          std::span<const std::int32_t> indices, std::int64_t limit,
                          absl::string_view of) {
  for (std::size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || indices[i] >= limit) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", arg, "[", i, "] = ", indices[i],
                                                     " is out of range for ", of, " (", limit,
                                                     " rows)"));
    }
  }
  return absl::OkStatus();
}

// A host span that must hold one entry per row of `t`.
absl::Status CheckSpanLength(absl::string_view op, absl::string_view arg, std::size_t size,
                             absl::string_view t_name, const Tensor& t) {
  if (static_cast<std::uint64_t>(t.shape().dim(0)) == size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": ", size, " ", arg, " for ", t_name, " ",
                                                 t.DebugString(), " (", t.shape().dim(0),
                                                 " rows)"));
}

// Queries at positions start_pos .. start_pos + tokens - 1 against a cache of `keys` rows
// (`cache` names it): start_pos >= 0 and start_pos + tokens <= keys.
absl::Status CheckPositions(absl::string_view op, std::int64_t start_pos, std::int64_t tokens,
                            std::int64_t keys, absl::string_view cache) {
  if (start_pos < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": start_pos must be >= 0, got ", start_pos));
  }
  if (start_pos > keys - tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": start_pos ", start_pos, " + ", tokens, " tokens exceeds the ", keys,
        " keys of ", cache, " (the cache must hold every query's own position)"));
  }
  return absl::OkStatus();
}

// The shapes MatMul and MatMulBlockScaled share: x [..., k], w [n, k] (rank 2), y [..., n], y
// distinct from x and w. Returns the folded dims.
absl::StatusOr<MatMulDims> CheckMatMulShapes(absl::string_view op, const Tensor& x,
                                             const Tensor& w, const Tensor& y) {
  RETURN_IF_ERROR(CheckHasLastDim(op, "x", x));
  RETURN_IF_ERROR(CheckRank(op, "w", w, 2));
  const MatMulDims dims{.m = x.shape().NumRows(), .n = w.shape().dim(0), .k = w.shape().dim(1)};
  if (x.shape().dim(-1) != dims.k) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x ", x.DebugString(), " and w ",
                                                   w.DebugString(), " disagree on k (",
                                                   x.shape().dim(-1), " vs ", dims.k, ")"));
  }
  RETURN_IF_ERROR(CheckShape(op, "y", y, x.shape().WithLastDim(dims.n),
                             absl::StrCat("x ", x.DebugString(), " and w ", w.DebugString())));
  RETURN_IF_ERROR(CheckDistinct(op, x, "x", y, "y"));
  RETURN_IF_ERROR(CheckDistinct(op, w, "w", y, "y"));
  return dims;
}

// F32 [ceil(n / 128), ceil(k / 128)] scales of an FP8 weight (MatMulBlockScaled).
absl::Status CheckBlockScales(absl::string_view op, const Tensor& w_fp8, const Tensor& scale_inv, const MatMulDims& dims) {
  RETURN_IF_ERROR(CheckDType(op, "scale_inv", scale_inv, DType::kF32));
  return CheckShape(op, "scale_inv", scale_inv, Shape{WeightScaleBlocks(dims.n), WeightScaleBlocks(dims.k)},
                    absl::StrCat("w_fp8 ", w_fp8.DebugString(), " in ", kWeightScaleBlock, " x ", kWeightScaleBlock,
                                 " blocks"));
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
  RETURN_IF_ERROR(RefuseOnSide("CopyFromHost"));
  RETURN_IF_ERROR(CheckOwned("CopyFromHost", "dst", dst));
  if (src.size() != dst.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyFromHost: ", src.size(),
                                                   " bytes given for ", dst.DebugString(), " (",
                                                   dst.nbytes(), " bytes)"));
  }
  if (src.empty()) return absl::OkStatus();
  return DoCopyFromHost(src.data(), src.size(), dst.data());
}

absl::Status Backend::CopyFromHostAt(std::span<const std::byte> src, Tensor& dst, std::size_t dst_offset) {
  RETURN_IF_ERROR(RefuseOnSide("CopyFromHostAt"));
  RETURN_IF_ERROR(CheckOwned("CopyFromHostAt", "dst", dst));
  // Written so that no sum can wrap: offset <= nbytes, then size <= what is left.
  if (dst_offset > dst.nbytes() || src.size() > dst.nbytes() - dst_offset) {
    return absl::InvalidArgumentError(absl::StrCat("CopyFromHostAt: ", src.size(), " bytes at offset ", dst_offset,
                                                   " do not fit in ", dst.DebugString(), " (", dst.nbytes(),
                                                   " bytes)"));
  }
  if (src.empty()) return absl::OkStatus();
  // The Do hook takes addresses, so a range of a tensor is the tensor's address plus the offset
  // (on CUDA, a device pointer into the same allocation).
  return DoCopyFromHost(src.data(), src.size(), static_cast<std::byte*>(dst.data()) + dst_offset);
}

absl::Status Backend::CopyToHost(const Tensor& src, std::span<std::byte> dst) {
  RETURN_IF_ERROR(RefuseWithSideWorkOpen("CopyToHost"));
  RETURN_IF_ERROR(CheckOwned("CopyToHost", "src", src));
  if (dst.size() != src.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyToHost: ", dst.size(),
                                                   " bytes of room for ", src.DebugString(), " (",
                                                   src.nbytes(), " bytes)"));
  }
  if (dst.empty()) return absl::OkStatus();
  return DoCopyToHost(src.data(), src.nbytes(), dst.data());
}

namespace {
class HeapStaging final : public Storage {
 public:
  explicit HeapStaging(std::size_t bytes) : Storage(bytes == 0 ? nullptr : new std::byte[bytes], bytes) {}
  ~HeapStaging() override { delete[] static_cast<std::byte*>(data()); }
};
}  // namespace

absl::StatusOr<std::unique_ptr<Storage>> Backend::AllocateHostStaging(std::size_t bytes) {
  return AllocateHostStagingStorage(bytes);
}

absl::StatusOr<std::unique_ptr<Storage>> Backend::AllocateHostStagingStorage(std::size_t bytes) {
  return std::make_unique<HeapStaging>(bytes);
}

absl::Status Backend::CopyToHostAsync(const Tensor& src, std::span<std::byte> dst) {
  RETURN_IF_ERROR(CheckOwned("CopyToHostAsync", "src", src));
  if (dst.size() != src.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyToHostAsync: ", dst.size(), " bytes of room for ",
                                                   src.DebugString(), " (", src.nbytes(), " bytes)"));
  }
  if (dst.empty()) return absl::OkStatus();
  return DoCopyToHostAsync(src.data(), src.nbytes(), dst.data());
}

absl::Status Backend::DoCopyToHostAsync(const void* src, std::size_t bytes, void* dst) {
  return DoCopyToHost(src, bytes, dst);
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

absl::Status Backend::CopyRows(const Tensor& src, std::int64_t src_row, Tensor& dst, std::int64_t dst_row,
                               std::int64_t rows) {
  constexpr absl::string_view kOp = "CopyRows";
  RETURN_IF_ERROR(CheckOwned(kOp, "src", src));
  RETURN_IF_ERROR(CheckOwned(kOp, "dst", dst));
  const Shape& from = src.shape();
  const Shape& to = dst.shape();
  bool same_rows = src.dtype() == dst.dtype() && from.rank() >= 1 && from.rank() == to.rank();
  for (int d = 1; same_rows && d < from.rank(); ++d) same_rows = from.dim(d) == to.dim(d);
  if (!same_rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": src ", src.DebugString(), " and dst ", dst.DebugString(), " differ in their rows"));
  }
  if (rows < 0 || src_row < 0 || dst_row < 0 || src_row > from.dim(0) - rows || dst_row > to.dim(0) - rows) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": rows [", src_row, ", ", src_row, " + ", rows, ") of ",
                                                   src.DebugString(), " into [", dst_row, ", ", dst_row, " + ", rows,
                                                   ") of ", dst.DebugString()));
  }
  if (rows == 0 || from.dim(0) == 0) return absl::OkStatus();
  const std::size_t row_bytes = src.nbytes() / static_cast<std::size_t>(from.dim(0));
  if (src.data() == dst.data()) {
    if (src_row == dst_row) return absl::OkStatus();
    // A device copy between overlapping ranges is undefined.
    if (src_row < dst_row + rows && dst_row < src_row + rows) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": rows [", src_row, ", ", src_row + rows, ") and [",
                                                     dst_row, ", ", dst_row + rows, ") of one tensor overlap"));
    }
  }
  return DoCopy(static_cast<const std::byte*>(src.data()) + static_cast<std::size_t>(src_row) * row_bytes,
                static_cast<std::size_t>(rows) * row_bytes,
                static_cast<std::byte*>(dst.data()) + static_cast<std::size_t>(dst_row) * row_bytes);
}

absl::Status Backend::MatMul(const Tensor& x, const Tensor& w, Tensor& y) {
  constexpr absl::string_view kOp = "MatMul";
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "w", w));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  if (w.dtype() == DType::kF8E4M3) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": w ", w.DebugString(), " needs its block scales; use MatMulBlockScaled"));
  }
  RETURN_IF_ERROR(CheckDTypeIn(kOp, "w", w, {DType::kF32, DType::kBF16, DType::kF16}));
  ASSIGN_OR_RETURN(const MatMulDims dims, CheckMatMulShapes(kOp, x, w, y));
  if (dims.m == 0 || dims.n == 0) return absl::OkStatus();
  return DoMatMul(x, w, y, dims);
}

absl::Status Backend::MatMulSharedInput(const Tensor& x, std::span<const WeightRef> ws, std::span<Tensor* const> ys) {
  constexpr absl::string_view kOp = "MatMulSharedInput";
  if (ws.size() != ys.size() || ws.empty() || ws.size() > static_cast<std::size_t>(kMaxSharedInputMatMuls)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", ws.size(), " weights and ", ys.size(),
                                                   " outputs; want equal counts from 1 to ", kMaxSharedInputMatMuls));
  }
  for (std::size_t i = 0; i < ws.size(); ++i) {
    if (ws[i].w == nullptr || ys[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": pair ", i, " has a null weight or output"));
    }
  }
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  MatMulDims dims[kMaxSharedInputMatMuls];
  WeightRef kept_ws[kMaxSharedInputMatMuls];
  Tensor* kept_ys[kMaxSharedInputMatMuls];
  std::size_t count = 0;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    const Tensor& w = *ws[i].w;
    const std::string w_name = absl::StrCat("ws[", i, "]"), y_name = absl::StrCat("ys[", i, "]");
    RETURN_IF_ERROR(CheckOwned(kOp, w_name, w));
    RETURN_IF_ERROR(CheckOwned(kOp, y_name, *ys[i]));
    RETURN_IF_ERROR(CheckDType(kOp, y_name, *ys[i], DType::kF32));
    RETURN_IF_ERROR(CheckDTypeIn(kOp, w_name, w, {DType::kF32, DType::kBF16, DType::kF16, DType::kF8E4M3}));
    ASSIGN_OR_RETURN(const MatMulDims d, CheckMatMulShapes(kOp, x, w, *ys[i]));
    if (w.dtype() == DType::kF8E4M3) {
      if (ws[i].scale_inv == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", w_name, " ", w.DebugString(), " needs its block scales"));
      }
      RETURN_IF_ERROR(CheckOwned(kOp, absl::StrCat("ws[", i, "].scale_inv"), *ws[i].scale_inv));
      RETURN_IF_ERROR(CheckBlockScales(kOp, w, *ws[i].scale_inv, d));
    } else if (ws[i].scale_inv != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": ", w_name, " ", w.DebugString(), " has block scales; only F8_E4M3 weights take them"));
    }
    for (std::size_t j = 0; j < ws.size(); ++j) {
      RETURN_IF_ERROR(CheckDistinct(kOp, *ws[j].w, absl::StrCat("ws[", j, "]"), *ys[i], y_name));
      if (j < i) RETURN_IF_ERROR(CheckDistinct(kOp, *ys[j], absl::StrCat("ys[", j, "]"), *ys[i], y_name));
    }
    if (d.m == 0 || d.n == 0) continue;  // nothing to compute, as MatMul
    dims[count] = d;
    kept_ws[count] = ws[i];
    kept_ys[count] = ys[i];
    ++count;
  }
  if (count == 0) return absl::OkStatus();
  return DoMatMulSharedInput(x, std::span<const WeightRef>(kept_ws, count), std::span<Tensor* const>(kept_ys, count),
                             std::span<const MatMulDims>(dims, count));
}

absl::Status Backend::DoMatMulSharedInput(const Tensor& x, std::span<const WeightRef> ws, std::span<Tensor* const> ys,
                                          std::span<const MatMulDims> dims) {
  for (std::size_t i = 0; i < ws.size(); ++i) {
    if (ws[i].scale_inv != nullptr) {
      RETURN_IF_ERROR(DoMatMulBlockScaled(x, *ws[i].w, *ws[i].scale_inv, *ys[i], dims[i]));
    } else {
      RETURN_IF_ERROR(DoMatMul(x, *ws[i].w, *ys[i], dims[i]));
    }
  }
  return absl::OkStatus();
}

absl::Status Backend::MatMulBlockScaled(const Tensor& x, const Tensor& w_fp8,
                                        const Tensor& scale_inv, Tensor& y) {
  constexpr absl::string_view kOp = "MatMulBlockScaled";
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "w_fp8", w_fp8));
  RETURN_IF_ERROR(CheckOwned(kOp, "scale_inv", scale_inv));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "w_fp8", w_fp8, DType::kF8E4M3));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  ASSIGN_OR_RETURN(const MatMulDims dims, CheckMatMulShapes(kOp, x, w_fp8, y));
  RETURN_IF_ERROR(CheckBlockScales(kOp, w_fp8, scale_inv, dims));
  if (dims.m == 0 || dims.n == 0) return absl::OkStatus();
  return DoMatMulBlockScaled(x, w_fp8, scale_inv, y, dims);
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
  RETURN_IF_ERROR(CheckShape(kOp, "y", y, x.shape(), absl::StrCat("x ", x.DebugString())));
  const RowDims dims{.rows = x.shape().NumRows(), .cols = x.shape().dim(-1)};
  if (dims.rows == 0 || dims.cols == 0) return absl::OkStatus();
  return DoRmsNorm(x, weight, eps, y, dims);
}

absl::Status Backend::AddRmsNorm(Tensor& x, std::span<const Tensor* const> deltas, const Tensor& weight, float eps,
                                Tensor& y) {
  constexpr absl::string_view kOp = "AddRmsNorm";
  if (deltas.empty() || deltas.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": one or two deltas, got ", deltas.size()));
  }
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  for (std::size_t i = 0; i < deltas.size(); ++i) {
    const std::string name = absl::StrCat("deltas[", i, "]");
    if (deltas[i] == nullptr) return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " is null"));
    RETURN_IF_ERROR(CheckOwned(kOp, name, *deltas[i]));
    RETURN_IF_ERROR(CheckDType(kOp, name, *deltas[i], DType::kF32));
    RETURN_IF_ERROR(CheckShape(kOp, name, *deltas[i], x.shape(), absl::StrCat("x ", x.DebugString())));
    // x and y are written; a delta read after either would see the new values.
    RETURN_IF_ERROR(CheckDistinct(kOp, *deltas[i], name, x, "x"));
    RETURN_IF_ERROR(CheckDistinct(kOp, *deltas[i], name, y, "y"));
  }
  // RmsNorm's checks (weight, eps, y's shape and dtype) on the sum x will hold.
  RETURN_IF_ERROR(CheckOwned(kOp, "weight", weight));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  RETURN_IF_ERROR(CheckHasLastDim(kOp, "x", x));
  RETURN_IF_ERROR(CheckRank(kOp, "weight", weight, 1));
  if (weight.shape().dim(0) != x.shape().dim(-1)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": weight ", weight.DebugString(),
                                                   " does not match the last dim of x ", x.DebugString()));
  }
  if (!std::isfinite(eps) || eps < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": eps must be finite and >= 0, got ", eps));
  }
  RETURN_IF_ERROR(CheckShape(kOp, "y", y, x.shape(), absl::StrCat("x ", x.DebugString())));
  const RowDims dims{.rows = x.shape().NumRows(), .cols = x.shape().dim(-1)};
  if (dims.rows == 0 || dims.cols == 0) return absl::OkStatus();
  return DoAddRmsNorm(x, deltas, weight, eps, y, dims);
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
  RETURN_IF_ERROR(CheckShape(kOp, "y", y, x.shape().WithLastDim(dims.cols),
                             absl::StrCat("x ", x.DebugString())));
  RETURN_IF_ERROR(CheckDistinct(kOp, x, "x", y, "y"));
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
  RETURN_IF_ERROR(CheckShape(kOp, "y", y, x.shape(), absl::StrCat("x ", x.DebugString())));
  const RowDims dims{.rows = x.shape().NumRows(), .cols = x.shape().dim(-1)};
  if (dims.rows == 0 || dims.cols == 0) return absl::OkStatus();
  return DoSoftmax(x, scale, y, dims);
}

// ---- Model ops ----

absl::Status Backend::Embedding(std::span<const std::int32_t> ids, const Tensor& table,
                                Tensor& out) {
  constexpr absl::string_view kOp = "Embedding";
  RETURN_IF_ERROR(RefuseOnSide("Embedding from host ids"));
  RETURN_IF_ERROR(CheckOwned(kOp, "table", table));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  RETURN_IF_ERROR(CheckDTypeIn(kOp, "table", table, {DType::kF32, DType::kBF16, DType::kF16}));
  RETURN_IF_ERROR(CheckDType(kOp, "out", out, DType::kF32));
  RETURN_IF_ERROR(CheckRank(kOp, "table", table, 2));
  const std::int64_t tokens = static_cast<std::int64_t>(ids.size());
  RETURN_IF_ERROR(CheckShape(kOp, "out", out, Shape{tokens, table.shape().dim(1)},
                             absl::StrCat(tokens, " ids and table ", table.DebugString())));
  RETURN_IF_ERROR(CheckIndices(kOp, "ids", ids, table.shape().dim(0),
                               absl::StrCat("table ", table.DebugString())));
  if (out.NumElements() == 0) return absl::OkStatus();
  return DoEmbedding(ids, table, out);
}

absl::Status Backend::Embedding(const Tensor& ids, const Tensor& table, Tensor& out) {
  constexpr absl::string_view kOp = "Embedding";
  RETURN_IF_ERROR(CheckOwned(kOp, "ids", ids));
  RETURN_IF_ERROR(CheckOwned(kOp, "table", table));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  RETURN_IF_ERROR(CheckDType(kOp, "ids", ids, DType::kI32));
  RETURN_IF_ERROR(CheckDTypeIn(kOp, "table", table, {DType::kF32, DType::kBF16, DType::kF16}));
  RETURN_IF_ERROR(CheckDType(kOp, "out", out, DType::kF32));
  RETURN_IF_ERROR(CheckRank(kOp, "ids", ids, 1));
  RETURN_IF_ERROR(CheckRank(kOp, "table", table, 2));
  const std::int64_t tokens = ids.shape().dim(0);
  RETURN_IF_ERROR(CheckShape(kOp, "out", out, Shape{tokens, table.shape().dim(1)},
                             absl::StrCat("ids ", ids.DebugString(), " and table ", table.DebugString())));
  if (out.NumElements() == 0) return absl::OkStatus();
  return DoEmbeddingDevice(ids, table, out);
}

absl::Status Backend::Add(const Tensor& a, const Tensor& b, Tensor& out) {
  constexpr absl::string_view kOp = "Add";
  RETURN_IF_ERROR(CheckOwned(kOp, "a", a));
  RETURN_IF_ERROR(CheckOwned(kOp, "b", b));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  RETURN_IF_ERROR(CheckDType(kOp, "a", a, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "b", b, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "out", out, DType::kF32));
  RETURN_IF_ERROR(CheckShape(kOp, "b", b, a.shape(), absl::StrCat("a ", a.DebugString())));
  RETURN_IF_ERROR(CheckShape(kOp, "out", out, a.shape(), absl::StrCat("a ", a.DebugString())));
  if (out.NumElements() == 0) return absl::OkStatus();
  return DoAdd(a, b, out);
}

absl::Status Backend::Rope(Tensor& x, StepPosition start, std::span<const float> inv_freq,
                           float attention_scaling, bool interleaved) {
  const RopeTarget target{.x = &x, .interleaved = interleaved};
  return Rope(std::span<const RopeTarget>(&target, 1), start, inv_freq, attention_scaling);
}

absl::Status Backend::Rope(std::span<const RopeTarget> targets, StepPosition start, std::span<const float> inv_freq,
                           float attention_scaling) {
  constexpr absl::string_view kOp = "Rope";
  if (targets.empty() || targets.size() > static_cast<std::size_t>(kMaxRopeTargets)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": ", targets.size(), " tensors to rotate; want 1 to ", kMaxRopeTargets));
  }
  RETURN_IF_ERROR(CheckStepPosition(kOp, "start_pos", start));
  const std::int64_t start_pos = start.bound();
  // The rotated slice is the leading 2 * inv_freq.size() elements of each head.
  for (std::size_t i = 0; i < inv_freq.size(); ++i) {
    if (!std::isfinite(inv_freq[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": inv_freq[", i, "] = ", inv_freq[i], " is not finite"));
    }
  }
  if (!std::isfinite(attention_scaling)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": attention_scaling must be finite, got ", attention_scaling));
  }
  bool any_elements = false;
  for (std::size_t t = 0; t < targets.size(); ++t) {
    const std::string arg = targets.size() == 1 ? "x" : absl::StrCat("targets[", t, "].x");
    if (targets[t].x == nullptr) return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", arg, " is null"));
    const Tensor& x = *targets[t].x;
    RETURN_IF_ERROR(CheckOwned(kOp, arg, x));
    RETURN_IF_ERROR(CheckDType(kOp, arg, x, DType::kF32));
    RETURN_IF_ERROR(CheckRank(kOp, arg, x, 3));
    const std::int64_t d = x.shape().dim(2);
    if (d % 2 != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": the last dim of ", arg, " ", x.DebugString(), " must be even (rotated pairs)"));
    }
    if (inv_freq.empty() || static_cast<std::uint64_t>(d / 2) < inv_freq.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(kOp, ": inv_freq has ", inv_freq.size(), " entries; want 1 to ", d / 2,
                       " (the rotated slice is 2 * inv_freq.size() of the last dim of ", arg, " ", x.DebugString(), ")"));
    }
    // One start position for every target: the same tokens, rotated in one pass.
    if (x.shape().dim(0) != targets[0].x->shape().dim(0)) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", arg, " ", x.DebugString(), " has ",
                                                     x.shape().dim(0), " tokens; targets[0].x has ",
                                                     targets[0].x->shape().dim(0)));
    }
    for (std::size_t u = 0; u < t; ++u) {
      // Rotating one buffer twice in one launch would race.
      if (x.nbytes() > 0 && x.data() == targets[u].x->data()) {
        return absl::InvalidArgumentError(
            absl::StrCat(kOp, ": ", arg, " shares its memory with targets[", u, "].x"));
      }
    }
    any_elements = any_elements || x.NumElements() > 0;
  }
  const std::int64_t tokens = targets[0].x->shape().dim(0);
  if (start_pos < 0 || start_pos > std::numeric_limits<std::int64_t>::max() - tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": start_pos must be >= 0 and leave room for ", tokens, " positions, got ",
        start_pos));
  }
  if (!any_elements) return absl::OkStatus();
  if (targets.size() == 1) return DoRope(*targets[0].x, start, inv_freq, attention_scaling, targets[0].interleaved);
  return DoRopes(targets, start, inv_freq, attention_scaling);
}

absl::Status Backend::LayerNorm(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                float eps, Tensor& y) {
  constexpr absl::string_view kOp = "LayerNorm";
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "weight", weight));
  RETURN_IF_ERROR(CheckOwned(kOp, "bias", bias));
  RETURN_IF_ERROR(CheckOwned(kOp, "y", y));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "weight", weight, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "bias", bias, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "y", y, DType::kF32));
  RETURN_IF_ERROR(CheckHasLastDim(kOp, "x", x));
  for (const auto& [name, t] : {std::pair<absl::string_view, const Tensor*>{"weight", &weight},
                                {"bias", &bias}}) {
    RETURN_IF_ERROR(CheckRank(kOp, name, *t, 1));
    if (t->shape().dim(0) != x.shape().dim(-1)) {
      return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", name, " ", t->DebugString(),
                                                     " does not match the last dim of x ",
                                                     x.DebugString()));
    }
  }
  if (!std::isfinite(eps) || eps < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": eps must be finite and >= 0, got ", eps));
  }
  RETURN_IF_ERROR(CheckShape(kOp, "y", y, x.shape(), absl::StrCat("x ", x.DebugString())));
  const RowDims dims{.rows = x.shape().NumRows(), .cols = x.shape().dim(-1)};
  if (dims.rows == 0 || dims.cols == 0) return absl::OkStatus();
  return DoLayerNorm(x, weight, bias, eps, y, dims);
}

absl::Status Backend::WriteRows(const Tensor& src, Tensor& dst, StepPosition offset) {
  constexpr absl::string_view kOp = "WriteRows";
  RETURN_IF_ERROR(CheckOwned(kOp, "src", src));
  RETURN_IF_ERROR(CheckOwned(kOp, "dst", dst));
  RETURN_IF_ERROR(CheckStepPosition(kOp, "row_offset", offset));
  const std::int64_t row_offset = offset.bound();
  RETURN_IF_ERROR(CheckDType(kOp, "src", src, DType::kF32));
  RETURN_IF_ERROR(CheckDTypeIn(kOp, "dst", dst, {DType::kF32, DType::kBF16, DType::kU8}));
  RETURN_IF_ERROR(CheckRank(kOp, "src", src, 2));
  RETURN_IF_ERROR(CheckRank(kOp, "dst", dst, 2));
  // A U8 dst holds packed FP8 rows (kernels/kv_fp8.h): codes and tile scales.
  const std::int64_t dst_width =
      dst.dtype() == DType::kU8 ? KvFp8RowBytes(src.shape().dim(1)) : src.shape().dim(1);
  if (dst.shape().dim(1) != dst_width) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": src ", src.DebugString(), " and dst ", dst.DebugString(), " disagree on the row width (",
        dst.dtype() == DType::kU8
            ? absl::StrCat("packed FP8 rows of ", src.shape().dim(1), " values need ", dst_width, ", dst has ",
                           dst.shape().dim(1))
            : absl::StrCat(src.shape().dim(1), " vs ", dst.shape().dim(1)),
        ")"));
  }
  const std::int64_t rows = src.shape().dim(0);
  if (row_offset < 0 || row_offset > dst.shape().dim(0) - rows) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": rows [", row_offset, ", ", row_offset, " + ", rows, ") of src ",
                     src.DebugString(), " do not fit in dst ", dst.DebugString()));
  }
  RETURN_IF_ERROR(CheckDistinct(kOp, src, "src", dst, "dst"));
  if (src.NumElements() == 0) return absl::OkStatus();
  return DoWriteRows(src, dst, offset);
}

absl::Status Backend::GatherRows(const Tensor& x, std::span<const std::int32_t> rows,
                                 Tensor& out) {
  constexpr absl::string_view kOp = "GatherRows";
  RETURN_IF_ERROR(RefuseOnSide(kOp));
  RETURN_IF_ERROR(CheckOwned(kOp, "x", x));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  RETURN_IF_ERROR(CheckDType(kOp, "x", x, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "out", out, DType::kF32));
  RETURN_IF_ERROR(CheckRank(kOp, "x", x, 2));
  RETURN_IF_ERROR(CheckShape(kOp, "out", out,
                             Shape{static_cast<std::int64_t>(rows.size()), x.shape().dim(1)},
                             absl::StrCat(rows.size(), " rows of x ", x.DebugString())));
  RETURN_IF_ERROR(
      CheckIndices(kOp, "rows", rows, x.shape().dim(0), absl::StrCat("x ", x.DebugString())));
  RETURN_IF_ERROR(CheckDistinct(kOp, x, "x", out, "out"));
  if (out.NumElements() == 0) return absl::OkStatus();
  return DoGatherRows(x, rows, out);
}

absl::Status Backend::ScatterAddRows(const Tensor& src, std::span<const std::int32_t> rows,
                                     std::span<const float> weights, Tensor& out) {
  constexpr absl::string_view kOp = "ScatterAddRows";
  RETURN_IF_ERROR(RefuseOnSide(kOp));
  RETURN_IF_ERROR(CheckOwned(kOp, "src", src));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  RETURN_IF_ERROR(CheckDType(kOp, "src", src, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "out", out, DType::kF32));
  RETURN_IF_ERROR(CheckRank(kOp, "src", src, 2));
  RETURN_IF_ERROR(CheckRank(kOp, "out", out, 2));
  RETURN_IF_ERROR(CheckSpanLength(kOp, "rows", rows.size(), "src", src));
  RETURN_IF_ERROR(CheckSpanLength(kOp, "weights", weights.size(), "src", src));
  if (src.shape().dim(1) != out.shape().dim(1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        kOp, ": src ", src.DebugString(), " and out ", out.DebugString(),
        " disagree on the row width (", src.shape().dim(1), " vs ", out.shape().dim(1), ")"));
  }
  RETURN_IF_ERROR(CheckIndices(kOp, "rows", rows, out.shape().dim(0),
                               absl::StrCat("out ", out.DebugString())));
  RETURN_IF_ERROR(CheckDistinct(kOp, src, "src", out, "out"));
  if (src.NumElements() == 0) return absl::OkStatus();
  return DoScatterAddRows(src, rows, weights, out);
}

absl::Status Backend::MlaAttention(const Tensor& q_nope, const Tensor& q_pe,
                                   const Tensor& kv_latent, const Tensor& k_pe,
                                   const Tensor& w_uk, const Tensor& w_uv, const Tensor* selected,
                                   StepPosition start, float scale, Tensor& out) {
  constexpr absl::string_view kOp = "MlaAttention";
  RETURN_IF_ERROR(RefuseOnSide(kOp));
  RETURN_IF_ERROR(CheckStepPosition(kOp, "start_pos", start));
  const std::int64_t start_pos = start.bound();
  const std::pair<absl::string_view, const Tensor*> f32_inputs[] = {{"q_nope", &q_nope}, {"q_pe", &q_pe}};
  for (const auto& [name, t] : f32_inputs) {
    RETURN_IF_ERROR(CheckOwned(kOp, name, *t));
    RETURN_IF_ERROR(CheckDType(kOp, name, *t, DType::kF32));
  }
  // The latent cache: F32, BF16 (half the bytes every decode step reads), or packed FP8 rows (U8,
  // kernels/kv_fp8.h) with a BF16 rope key.
  RETURN_IF_ERROR(CheckOwned(kOp, "kv_latent", kv_latent));
  RETURN_IF_ERROR(CheckOwned(kOp, "k_pe", k_pe));
  RETURN_IF_ERROR(CheckDTypeIn(kOp, "kv_latent", kv_latent, {DType::kF32, DType::kBF16, DType::kU8}));
  const bool fp8_rows = kv_latent.dtype() == DType::kU8;
  RETURN_IF_ERROR(CheckDType(kOp, "k_pe", k_pe, fp8_rows ? DType::kBF16 : kv_latent.dtype()));
  RETURN_IF_ERROR(CheckOwned(kOp, "w_uk", w_uk));
  RETURN_IF_ERROR(CheckOwned(kOp, "w_uv", w_uv));
  RETURN_IF_ERROR(CheckOwned(kOp, "out", out));
  RETURN_IF_ERROR(CheckDTypeIn(kOp, "w_uk", w_uk, {DType::kF32, DType::kBF16}));
  RETURN_IF_ERROR(CheckDTypeIn(kOp, "w_uv", w_uv, {DType::kF32, DType::kBF16}));
  RETURN_IF_ERROR(CheckDType(kOp, "out", out, DType::kF32));
  RETURN_IF_ERROR(CheckRank(kOp, "q_nope", q_nope, 3));
  RETURN_IF_ERROR(CheckRank(kOp, "q_pe", q_pe, 3));
  RETURN_IF_ERROR(CheckRank(kOp, "kv_latent", kv_latent, 2));
  RETURN_IF_ERROR(CheckRank(kOp, "k_pe", k_pe, 2));
  RETURN_IF_ERROR(CheckRank(kOp, "w_uk", w_uk, 3));
  RETURN_IF_ERROR(CheckRank(kOp, "w_uv", w_uv, 3));
  const std::int64_t tokens = q_nope.shape().dim(0);
  const std::int64_t heads = q_nope.shape().dim(1);
  const std::int64_t dn = q_nope.shape().dim(2);
  const std::int64_t dr = q_pe.shape().dim(2);
  const std::int64_t keys = kv_latent.shape().dim(0);
  // Packed FP8 rows carry their tile scales after the codes: the latent width is w_uk's.
  const std::int64_t c = fp8_rows ? w_uk.shape().dim(2) : kv_latent.shape().dim(1);
  const std::int64_t dv = w_uv.shape().dim(1);
  if (fp8_rows && kv_latent.shape().dim(1) != KvFp8RowBytes(c)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": kv_latent ", kv_latent.DebugString(),
                                                   " is not packed FP8 rows of w_uk ", w_uk.DebugString(), "'s ", c,
                                                   " latent values (", KvFp8RowBytes(c), " bytes a row)"));
  }
  RETURN_IF_ERROR(CheckShape(kOp, "q_pe", q_pe, Shape{tokens, heads, dr},
                             absl::StrCat("q_nope ", q_nope.DebugString())));
  RETURN_IF_ERROR(CheckShape(kOp, "k_pe", k_pe, Shape{keys, dr},
                             absl::StrCat("kv_latent ", kv_latent.DebugString(), " and q_pe ",
                                          q_pe.DebugString())));
  RETURN_IF_ERROR(CheckShape(kOp, "w_uk", w_uk, Shape{heads, dn, c},
                             absl::StrCat("q_nope ", q_nope.DebugString(), " and kv_latent ",
                                          kv_latent.DebugString())));
  RETURN_IF_ERROR(CheckShape(kOp, "w_uv", w_uv, Shape{heads, dv, c},
                             absl::StrCat("q_nope ", q_nope.DebugString(), " and kv_latent ",
                                          kv_latent.DebugString())));
  std::int64_t out_cols = 0;
  if (__builtin_mul_overflow(heads, dv, &out_cols)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": heads * dv overflows for w_uv ", w_uv.DebugString()));
  }
  RETURN_IF_ERROR(CheckShape(kOp, "out", out, Shape{tokens, out_cols},
                             absl::StrCat("q_nope ", q_nope.DebugString(), " and w_uv ",
                                          w_uv.DebugString())));
  if (selected != nullptr) {
    RETURN_IF_ERROR(CheckOwned(kOp, "selected", *selected));
    RETURN_IF_ERROR(CheckDType(kOp, "selected", *selected, DType::kI32));
    RETURN_IF_ERROR(CheckRank(kOp, "selected", *selected, 2));
    if (selected->shape().dim(0) != tokens || selected->shape().dim(1) < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          kOp, ": selected ", selected->DebugString(), " must be [", tokens,
          ", K] with K >= 1 (one row of key indices per token of q_nope ",
          q_nope.DebugString(), ")"));
    }
  }
  RETURN_IF_ERROR(CheckPositions(kOp, start_pos, tokens, keys,
                                 absl::StrCat("kv_latent ", kv_latent.DebugString())));
  if (!std::isfinite(scale)) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": scale must be finite, got ", scale));
  }
  for (const auto& [name, t] : f32_inputs) {
    RETURN_IF_ERROR(CheckDistinct(kOp, *t, name, out, "out"));
  }
  if (out.NumElements() == 0) return absl::OkStatus();
  return DoMlaAttention(q_nope, q_pe, kv_latent, k_pe, w_uk, w_uv, selected, start, scale, out);
}

absl::Status Backend::ApplySlotMailbox(const SlotMailboxRow& row, Tensor& applied, Tensor& slot_of_expert) {
  constexpr absl::string_view kOp = "ApplySlotMailbox";
  if (row.staged == nullptr || row.seq == nullptr || row.published == nullptr || row.experts <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": a mailbox row without memory or experts"));
  }
  RETURN_IF_ERROR(CheckOwned(kOp, "applied", applied));
  RETURN_IF_ERROR(CheckOwned(kOp, "slot_of_expert", slot_of_expert));
  RETURN_IF_ERROR(CheckDType(kOp, "applied", applied, DType::kI32));
  RETURN_IF_ERROR(CheckDType(kOp, "slot_of_expert", slot_of_expert, DType::kI32));
  const std::string from = absl::StrCat("a row of ", row.experts, " experts");
  RETURN_IF_ERROR(CheckShape(kOp, "applied", applied, Shape{row.experts, 2}, from));
  if (slot_of_expert.NumElements() != row.experts) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": slot_of_expert ", slot_of_expert.DebugString(), " for ",
                                                   from));
  }
  return DoApplySlotMailbox(row, applied, slot_of_expert);
}

absl::Status Backend::MoeRoute(const Tensor& logits, const Tensor* bias, const MoeRouteParams& params,
                               Tensor& ids, Tensor& weights) {
  constexpr absl::string_view kOp = "MoeRoute";
  RETURN_IF_ERROR(CheckOwned(kOp, "logits", logits));
  RETURN_IF_ERROR(CheckOwned(kOp, "ids", ids));
  RETURN_IF_ERROR(CheckOwned(kOp, "weights", weights));
  RETURN_IF_ERROR(CheckDType(kOp, "logits", logits, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "ids", ids, DType::kI32));
  RETURN_IF_ERROR(CheckDType(kOp, "weights", weights, DType::kF32));
  RETURN_IF_ERROR(CheckRank(kOp, "logits", logits, 2));
  if (absl::Status s = CheckMoeRouteParams(params); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": ", s.message()));
  }
  if (params.num_experts > kMaxRoutedExperts) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": ", params.num_experts, " experts; at most ", kMaxRoutedExperts, " are supported"));
  }
  const std::int64_t tokens = logits.shape().dim(0);
  if (logits.shape().dim(1) != params.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": logits ", logits.DebugString(), " for ", params.num_experts, " experts"));
  }
  if (bias != nullptr) {
    RETURN_IF_ERROR(CheckOwned(kOp, "bias", *bias));
    RETURN_IF_ERROR(CheckDType(kOp, "bias", *bias, DType::kF32));
    RETURN_IF_ERROR(CheckShape(kOp, "bias", *bias, Shape{params.num_experts}, "params.num_experts"));
  }
  const std::string from = absl::StrCat("logits ", logits.DebugString(), " and top_k ", params.top_k);
  RETURN_IF_ERROR(CheckShape(kOp, "ids", ids, Shape{tokens, params.top_k}, from));
  RETURN_IF_ERROR(CheckShape(kOp, "weights", weights, Shape{tokens, params.top_k}, from));
  if (tokens == 0) return absl::OkStatus();
  return DoMoeRoute(logits, bias, params, ids, weights);
}

absl::Status Backend::SampleTokens(const Tensor& logits, const Tensor& params, Tensor& ids) {
  constexpr absl::string_view kOp = "SampleTokens";
  RETURN_IF_ERROR(CheckOwned(kOp, "logits", logits));
  RETURN_IF_ERROR(CheckOwned(kOp, "params", params));
  RETURN_IF_ERROR(CheckOwned(kOp, "ids", ids));
  RETURN_IF_ERROR(CheckDType(kOp, "logits", logits, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "params", params, DType::kU8));
  RETURN_IF_ERROR(CheckDType(kOp, "ids", ids, DType::kI32));
  RETURN_IF_ERROR(CheckRank(kOp, "logits", logits, 2));
  const std::int64_t rows = logits.shape().dim(0), vocab = logits.shape().dim(1);
  if (vocab == 0 || vocab >= (std::int64_t{1} << 24)) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": logits ", logits.DebugString(), ": the vocabulary must hold 1 to 2^24 - 1 ids"));
  }
  const std::string from = absl::StrCat("logits ", logits.DebugString());
  RETURN_IF_ERROR(CheckShape(kOp, "params", params,
                             Shape{rows, static_cast<std::int64_t>(sizeof(SampleParams))}, from));
  RETURN_IF_ERROR(CheckShape(kOp, "ids", ids, Shape{rows}, from));
  if (rows == 0) return absl::OkStatus();
  return DoSampleTokens(logits, params, ids);
}

absl::Status Backend::IndexerTopK(const Tensor& q, const Tensor& k, const Tensor& weights,
                                  StepPosition start, Tensor& selected) {
  constexpr absl::string_view kOp = "IndexerTopK";
  RETURN_IF_ERROR(RefuseOnSide(kOp));
  RETURN_IF_ERROR(CheckStepPosition(kOp, "start_pos", start));
  const std::int64_t start_pos = start.bound();
  RETURN_IF_ERROR(CheckOwned(kOp, "q", q));
  RETURN_IF_ERROR(CheckOwned(kOp, "k", k));
  RETURN_IF_ERROR(CheckOwned(kOp, "weights", weights));
  RETURN_IF_ERROR(CheckOwned(kOp, "selected", selected));
  RETURN_IF_ERROR(CheckDType(kOp, "q", q, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "k", k, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "weights", weights, DType::kF32));
  RETURN_IF_ERROR(CheckDType(kOp, "selected", selected, DType::kI32));
  RETURN_IF_ERROR(CheckRank(kOp, "q", q, 3));
  RETURN_IF_ERROR(CheckRank(kOp, "k", k, 2));
  RETURN_IF_ERROR(CheckRank(kOp, "selected", selected, 2));
  const std::int64_t tokens = q.shape().dim(0);
  const std::int64_t heads = q.shape().dim(1);
  const std::int64_t d = q.shape().dim(2);
  if (k.shape().dim(1) != d) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": k ", k.DebugString(), " and q ",
                                                   q.DebugString(), " disagree on the head dim (",
                                                   k.shape().dim(1), " vs ", d, ")"));
  }
  RETURN_IF_ERROR(CheckShape(kOp, "weights", weights, Shape{tokens, heads},
                             absl::StrCat("q ", q.DebugString())));
  if (selected.shape().dim(0) != tokens || selected.shape().dim(1) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": selected ", selected.DebugString(), " must be [", tokens,
                     ", top_k] with top_k >= 1 (one row per token of q ", q.DebugString(), ")"));
  }
  RETURN_IF_ERROR(
      CheckPositions(kOp, start_pos, tokens, k.shape().dim(0), absl::StrCat("k ", k.DebugString())));
  // selected holds I32 key indices: every visible key must have one.
  constexpr std::int64_t kMaxI32Keys = std::int64_t{std::numeric_limits<std::int32_t>::max()} + 1;
  if (start_pos + tokens > kMaxI32Keys) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": start_pos ", start_pos, " + ", tokens,
                                                   " tokens exceeds the ", kMaxI32Keys,
                                                   " keys an I32 index can name"));
  }
  if (tokens == 0) return absl::OkStatus();
  return DoIndexerTopK(q, k, weights, start, selected);
}

// ---- Default model-op hooks: not implemented by this backend ----

namespace {

absl::Status NotImplemented(absl::string_view op, std::string_view backend) {
  return absl::UnimplementedError(
      absl::StrCat(op, " is not implemented by the ", std::string(backend), " backend"));
}

}  // namespace

absl::Status Backend::DoEmbedding(std::span<const std::int32_t>, const Tensor&, Tensor&) {
  return NotImplemented("Embedding", name());
}

absl::Status Backend::DoAdd(const Tensor&, const Tensor&, Tensor&) {
  return NotImplemented("Add", name());
}

absl::Status Backend::DoAddRmsNorm(Tensor& x, std::span<const Tensor* const> deltas, const Tensor& weight,
                                  float eps, Tensor& y, const RowDims& dims) {
  if (deltas.size() == 1) {
    RETURN_IF_ERROR(DoAdd(x, *deltas[0], x));
  } else {
    ASSIGN_OR_RETURN(Tensor sum, Allocate(DType::kF32, x.shape()));
    RETURN_IF_ERROR(DoAdd(*deltas[0], *deltas[1], sum));
    RETURN_IF_ERROR(DoAdd(x, sum, x));
  }
  return DoRmsNorm(x, weight, eps, y, dims);
}

absl::Status Backend::DoEmbeddingDevice(const Tensor&, const Tensor&, Tensor&) {
  return NotImplemented("Embedding (device ids)", name());
}

absl::Status Backend::DoRope(Tensor&, const StepPosition&, std::span<const float>, float, bool) {
  return NotImplemented("Rope", name());
}

absl::Status Backend::DoRopes(std::span<const RopeTarget> targets, const StepPosition& start_pos,
                              std::span<const float> inv_freq, float attention_scaling) {
  for (const RopeTarget& target : targets) {
    if (target.x->NumElements() == 0) continue;
    RETURN_IF_ERROR(DoRope(*target.x, start_pos, inv_freq, attention_scaling, target.interleaved));
  }
  return absl::OkStatus();
}

absl::Status Backend::DoLayerNorm(const Tensor&, const Tensor&, const Tensor&, float, Tensor&,
                                  const RowDims&) {
  return NotImplemented("LayerNorm", name());
}

absl::Status Backend::DoWriteRows(const Tensor&, Tensor&, const StepPosition&) {
  return NotImplemented("WriteRows", name());
}

absl::Status Backend::DoGatherRows(const Tensor&, std::span<const std::int32_t>, Tensor&) {
  return NotImplemented("GatherRows", name());
}

absl::Status Backend::DoScatterAddRows(const Tensor&, std::span<const std::int32_t>,
                                       std::span<const float>, Tensor&) {
  return NotImplemented("ScatterAddRows", name());
}

absl::Status Backend::DoMlaAttention(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor*, const StepPosition&,
                                     float, Tensor&) {
  return NotImplemented("MlaAttention", name());
}

absl::Status Backend::DoApplySlotMailbox(const SlotMailboxRow&, Tensor&, Tensor&) {
  return NotImplemented("ApplySlotMailbox", name());
}

absl::Status Backend::DoSampleTokens(const Tensor&, const Tensor&, Tensor&) {
  return NotImplemented("SampleTokens", name());
}

absl::Status Backend::DoMoeRoute(const Tensor&, const Tensor*, const MoeRouteParams&, Tensor&, Tensor&) {
  return NotImplemented("MoeRoute", name());
}

absl::Status Backend::DoIndexerTopK(const Tensor&, const Tensor&, const Tensor&, const StepPosition&,
                                    Tensor&) {
  return NotImplemented("IndexerTopK", name());
}

}  // namespace nq::kernels

namespace nq::kernels {

absl::Status Backend::BeginCapture() {
  return absl::UnimplementedError(absl::StrCat("the ", std::string(name()), " backend cannot capture graphs"));
}

absl::StatusOr<std::unique_ptr<Backend::Graph>> Backend::EndCapture() {
  return absl::UnimplementedError(absl::StrCat("the ", std::string(name()), " backend cannot capture graphs"));
}

absl::Status Backend::CheckStepPosition(absl::string_view op, absl::string_view arg, const StepPosition& p) const {
  if (p.device() == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(CheckOwned(op, arg, *p.device()));
  if (p.device()->dtype() != DType::kI32 || p.device()->NumElements() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": a device ", arg, " must be I32 [1], got ",
                                                   p.device()->DebugString()));
  }
  if (p.bound() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": the bound of a device ", arg, " must be >= 0, got ", p.bound()));
  }
  return absl::OkStatus();
}

}  // namespace nq::kernels
