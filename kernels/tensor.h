// Shape and Tensor: a row-major, contiguous block of backend memory with a dtype and a shape.
//
// A Tensor owns its memory (RAII): it is move-only and gives the memory back to the backend that
// allocated it when destroyed. Only a Backend creates non-empty tensors (Backend::Allocate).
// Contract: a tensor must not outlive the backend that allocated it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/dtype.h"

namespace nq::kernels {

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) : dims_(dims) {}
  explicit Shape(std::vector<std::int64_t> dims) : dims_(std::move(dims)) {}

  int rank() const { return static_cast<int>(dims_.size()); }
  // dim(i) for 0 <= i < rank(); dim(-1) is the last dimension. Precondition: the index is valid.
  std::int64_t dim(int i) const { return dims_[i < 0 ? i + rank() : i]; }
  const std::vector<std::int64_t>& dims() const { return dims_; }

  // Product of the dimensions (1 for rank 0). Precondition: no dimension is negative.
  std::int64_t NumElements() const;
  // NumElements(), or InvalidArgumentError for a negative dimension or a product that overflows.
  absl::StatusOr<std::int64_t> CheckedNumElements() const;
  // Product of every dimension but the last: the number of rows an op over the last dim sees.
  std::int64_t NumRows() const;

  // The same shape with the last dimension replaced by `last` (rank 0 stays rank 0).
  Shape WithLastDim(std::int64_t last) const;

  // "[4, 7168]"
  std::string ToString() const;

  friend bool operator==(const Shape&, const Shape&) = default;

 private:
  std::vector<std::int64_t> dims_;
};

// Memory a backend handed out. Each backend subclasses it to free its own kind of memory.
class Storage {
 public:
  Storage(void* data, std::size_t bytes) : data_(data), bytes_(bytes) {}
  virtual ~Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_;
  std::size_t bytes_;
};

class Tensor {
 public:
  // An empty handle (valid() == false): what a moved-from tensor becomes.
  Tensor() = default;
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;

  bool valid() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  std::int64_t NumElements() const { return shape_.NumElements(); }
  std::size_t nbytes() const { return storage_ == nullptr ? 0 : storage_->bytes(); }

  // Backend memory: a device pointer on CUDA, a host pointer on CPU. Only kernels of the owning
  // backend may dereference it.
  void* data() { return storage_ == nullptr ? nullptr : storage_->data(); }
  const void* data() const { return storage_ == nullptr ? nullptr : storage_->data(); }
  template <typename T>
  T* data_as() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* data_as() const {
    return static_cast<const T*>(data());
  }

  // Identifies the backend instance that allocated this tensor (0 for an empty tensor).
  std::uint64_t backend_id() const { return backend_id_; }

  // Reinterprets the same memory with another shape of the same element count, e.g.
  // [batch, seq, hidden] -> [batch * seq, hidden]. InvalidArgumentError otherwise.
  absl::Status Reshape(Shape shape);

  // "F32[4, 7168]", or "<empty>".
  std::string DebugString() const;

 private:
  friend class Backend;
  Tensor(std::unique_ptr<Storage> storage, DType dtype, Shape shape, std::uint64_t backend_id)
      : storage_(std::move(storage)), dtype_(dtype), shape_(std::move(shape)),
        backend_id_(backend_id) {}

  std::unique_ptr<Storage> storage_;
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::uint64_t backend_id_ = 0;
};

}  // namespace nq::kernels
