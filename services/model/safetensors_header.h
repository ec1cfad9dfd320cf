// The safetensors header: dtypes, tensor records, and a pure parser that validates them.
//
// File layout (https://github.com/huggingface/safetensors, "Format"):
//   [0, 8)        N, the header length, unsigned 64-bit little-endian
//   [8, 8 + N)    a UTF-8 JSON object: {"__metadata__": {str: str}?,
//                   "<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...}
//                 padded at the end with spaces (writers pad so the data section is 8-aligned)
//   [8 + N, EOF)  the data section; data_offsets are relative to its start, end exclusive,
//                 and the tensors tile it exactly: no overlap, no gap, nothing left over.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace nq::model {

// Element types of the safetensors format. F8_E4M3 is the "fn" variant (no infinities), the
// one FP8 hub checkpoints (DeepSeek-V3, GLM) store their weights in.
enum class DType : uint8_t {
  kF64,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI64,
  kI32,
  kI16,
  kI8,
  kU64,
  kU32,
  kU16,
  kU8,
  kBool,
};

// The name the header uses ("F8_E4M3").
absl::string_view DTypeName(DType dtype);
// INVALID_ARGUMENT naming `name` when it is not a dtype of the format.
absl::StatusOr<DType> ParseDType(absl::string_view name);
// Bytes per element.
uint64_t DTypeSize(DType dtype);

// Safetensors readers refuse headers larger than this (the reference implementation's
// MAX_HEADER_SIZE): a bound on memory before a single byte of JSON is trusted.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// The length prefix in front of the JSON.
inline constexpr uint64_t kHeaderLengthBytes = 8;
// The key under which the header carries free-form string metadata.
inline constexpr absl::string_view kMetadataKey = "__metadata__";

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;  // every dim >= 0; empty for a scalar
  uint64_t begin = 0;          // byte offsets into the data section, [begin, end)
  uint64_t end = 0;

  // Product of the dims (1 for a scalar); the parser guarantees it does not overflow.
  uint64_t numel() const;
  uint64_t byte_size() const { return end - begin; }
};

struct Header {
  uint64_t header_bytes = 0;  // N: the JSON length, padding included
  uint64_t data_offset = 0;   // 8 + N: where the data section starts in the file
  uint64_t data_bytes = 0;    // file size - 8 - N
  std::map<std::string, std::string> metadata;
  std::vector<TensorInfo> tensors;  // sorted by name; names are unique

  // nullptr when no tensor is called `name`.
  const TensorInfo* Find(absl::string_view name) const;
};

// Parses and validates the header of a safetensors file of `file_size` bytes. `bytes` holds
// the start of the file: at least the 8-byte length and the N header bytes (the whole file
// will do). Pure: no I/O, never throws, safe on arbitrary bytes (it is fuzzed).
//
// Errors (messages name the tensor and the rule):
//   DATA_LOSS         fewer than 8 bytes; N beyond the end of the file (truncated file);
//                     a tensor ending beyond the data section (truncated data).
//   INVALID_ARGUMENT  N > kMaxHeaderBytes; JSON that is malformed, not an object, nested
//                     too deep, or has a duplicate key; a bad "__metadata__"; a tensor
//                     entry without a known dtype, a shape of non-negative integers whose
//                     element count fits in 64 bits, or data_offsets [begin <= end] whose
//                     length is numel * itemsize; two tensors overlapping; a gap between
//                     tensors or bytes after the last one.
// `bytes` shorter than 8 + N (while the file is not) is INVALID_ARGUMENT: a caller error.
absl::StatusOr<Header> ParseSafetensorsHeader(absl::string_view bytes, uint64_t file_size);

}  // namespace nq::model
