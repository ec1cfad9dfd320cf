// Reading safetensors checkpoints through read-only memory maps: one file
// (SafetensorsFile) or a Hugging Face checkpoint directory (Checkpoint), single-file
// (model.safetensors) or sharded (model.safetensors.index.json + shards).
//
// Every header is validated when the file opens (see ParseSafetensorsHeader), so a
// TensorView's bytes always lie inside the mapping and match its dtype and shape.
//
// Contract: checkpoint files are immutable while open. The mapping is MAP_PRIVATE, but a
// file truncated underneath it still faults (SIGBUS) on access; writers replace files by
// rename (SafetensorsWriter does), which leaves open mappings intact. Const methods are
// safe to call from several threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "services/model/safetensors_header.h"

namespace nq::model {

// A tensor inside a mapped file. Borrows from the SafetensorsFile (or Checkpoint) it came
// from and is valid while that object lives, moves included. `data` has no alignment
// guarantee (safetensors files written by others may place tensors at any offset); read it
// with memcpy or the dtype_convert functions.
struct TensorView {
  absl::string_view name;
  DType dtype = DType::kF32;
  std::span<const int64_t> shape;
  std::span<const std::byte> data;  // numel() * DTypeSize(dtype) bytes, little-endian

  uint64_t numel() const;
};

// One .safetensors file, mapped read-only (MAP_PRIVATE) for its whole lifetime.
class SafetensorsFile {
 public:
  // Maps and validates `path`. NOT_FOUND when it does not exist; otherwise the header's
  // errors (DATA_LOSS / INVALID_ARGUMENT), each prefixed with "safetensors file <path>".
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile() = default;
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  uint64_t file_size() const { return size_; }

  // Tensor names, sorted.
  std::vector<std::string> Names() const;
  // NOT_FOUND naming the tensor and the file.
  absl::StatusOr<TensorView> Find(absl::string_view name) const;
  // The view of `info`, which must be one of header().tensors.
  TensorView View(const TensorInfo& info) const;
  // Starts reading `view`'s pages into the page cache (MADV_WILLNEED) so a later copy does
  // not fault page by page. `view` must come from this file.
  absl::Status Prefetch(const TensorView& view) const;

 private:
  void Reset();

  std::string path_;
  Header header_;
  const std::byte* base_ = nullptr;  // the mapping, size_ bytes
  uint64_t size_ = 0;
};

// A checkpoint directory as Hugging Face writes it.
class Checkpoint {
 public:
  // File names Hugging Face uses (transformers SAFE_WEIGHTS_NAME / SAFE_WEIGHTS_INDEX_NAME).
  static constexpr absl::string_view kSingleFileName = "model.safetensors";
  static constexpr absl::string_view kIndexFileName = "model.safetensors.index.json";

  // `path` is a directory holding model.safetensors (preferred, as transformers does) or
  // model.safetensors.index.json, or one of those files itself (an index is recognised by
  // its ".index.json" suffix). Every shard is opened and validated, and the index must agree
  // with the shards exactly:
  //   NOT_FOUND         no checkpoint in the directory; a shard the index lists is missing.
  //   INVALID_ARGUMENT  malformed index (no "weight_map", a non-string or unsafe shard path);
  //                     a tensor in two shards; a listed tensor its shard does not hold; a
  //                     shard holding a tensor the index does not list.
  //   plus any shard's own header errors.
  static absl::StatusOr<Checkpoint> Open(const std::string& path);

  Checkpoint() = default;
  Checkpoint(Checkpoint&&) noexcept = default;
  Checkpoint& operator=(Checkpoint&&) noexcept = default;

  const std::string& path() const { return path_; }
  bool sharded() const { return sharded_; }
  const std::vector<SafetensorsFile>& shards() const { return shards_; }
  size_t size() const { return tensors_.size(); }

  // Every tensor name, sorted.
  std::vector<std::string> Names() const;
  bool Contains(absl::string_view name) const;
  // NOT_FOUND naming the tensor and the checkpoint.
  absl::StatusOr<TensorView> Find(absl::string_view name) const;

 private:
  struct Location {
    size_t shard;
    size_t tensor;  // index into that shard's header().tensors
  };

  std::string path_;
  bool sharded_ = false;
  std::vector<SafetensorsFile> shards_;
  std::map<std::string, Location, std::less<>> tensors_;
};

}  // namespace nq::model
