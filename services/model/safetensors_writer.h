// Writing safetensors files and Hugging Face checkpoint directories (used by
// `nq synth-model` to write random checkpoints in the hub layout, and by tests).
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
#include "services/model/dtype_convert.h"
#include "services/model/safetensors_header.h"

namespace nq::model {

// Suffix of the tensor that holds an FP8 weight's block scales in the hub checkpoints:
// "...mlp.experts.0.down_proj.weight" -> "...mlp.experts.0.down_proj.weight_scale_inv".
inline constexpr absl::string_view kScaleInvSuffix = "_scale_inv";

// Collects named tensors in memory, then writes them.
//
// Layout of a written file: the header lists tensors by name (JSON keys sorted) and is padded
// with spaces so the data section starts at a multiple of 8. The format forbids gaps between
// tensors, so tensors are packed back to back, ordered by the alignment their byte size
// allows (multiples of 8 bytes first, then of 4, 2, 1; by name within a class): every tensor
// starts at a multiple of its element size, and every tensor whose size is a multiple of 8
// (all hub shapes) starts 8-aligned. This is the order the reference writer uses too.
class SafetensorsWriter {
 public:
  // Adds a tensor from little-endian bytes. INVALID_ARGUMENT for an empty, reserved
  // ("__metadata__") or repeated name, a negative dim, or bytes.size() != numel * itemsize.
  absl::Status Add(std::string name, DType dtype, std::vector<int64_t> shape,
                   std::vector<std::byte> bytes);
  // Adds fp32 `values` stored as `dtype`: F32, BF16 or F16 (round to nearest even), or
  // F8_E4M3 (RNE, saturating at 448, no scale).
  absl::Status AddFloat32(std::string name, std::vector<int64_t> shape,
                          std::span<const float> values, DType dtype = DType::kF32);
  // Adds a row-major [rows, cols] weight block-quantized as the FP8 hub checkpoints store it:
  // `name` (F8_E4M3, [rows, cols]) and `name + kScaleInvSuffix` (F32,
  // [ceil(rows / block), ceil(cols / block)]); see QuantizeFp8Block.
  absl::Status AddFp8BlockQuantized(std::string name, int64_t rows, int64_t cols,
                                    std::span<const float> values, int64_t block = kFp8BlockSize);
  // File-level "__metadata__" (e.g. {"format": "pt"}, which transformers looks for).
  void SetMetadata(std::string key, std::string value);

  size_t size() const { return tensors_.size(); }
  // Sum of the tensors' byte sizes.
  uint64_t data_bytes() const;

  // The complete file as bytes (header and data), for tests and small in-memory files.
  absl::StatusOr<std::string> Serialize() const;
  // Writes one .safetensors file holding every tensor, atomically: a temporary file in the
  // same directory, fsync, rename over `path`, fsync of the directory.
  absl::Status Write(const std::string& path) const;
  // Writes a checkpoint directory (created if missing) as transformers' save_pretrained does:
  // model.safetensors when max_shard_bytes is 0 or everything fits in one shard; otherwise
  // model-0000i-of-0000n.safetensors shards, filled in name order up to max_shard_bytes of
  // tensor data each (a larger tensor gets a shard of its own), and then
  // model.safetensors.index.json {"metadata": {"total_size"}, "weight_map"}. Each file is
  // written atomically, the index last; then files of an earlier write (the other layout,
  // shards of another count) are removed so the directory holds this checkpoint only.
  absl::Status WriteCheckpoint(const std::string& dir, uint64_t max_shard_bytes = 0) const;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
  };
  using Names = std::vector<const std::string*>;

  // The 8-byte length, the padded JSON, and the data order for the tensors in `names`.
  absl::StatusOr<std::string> BuildHeader(const Names& names, Names* data_order) const;
  absl::Status WriteFile(const std::string& path, const Names& names) const;

  std::map<std::string, Entry> tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace nq::model
