#include "services/model/safetensors_header.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors_json.h"

namespace nq::model {
namespace {

using nlohmann::json;

struct DTypeEntry {
  DType dtype;
  absl::string_view name;
  uint64_t size;
};

// Names as the safetensors format spells them (its Rust `Dtype` enum).
constexpr std::array<DTypeEntry, 15> kDTypes = {{
    {DType::kF64, "F64", 8},
    {DType::kF32, "F32", 4},
    {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},
    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
    {DType::kI64, "I64", 8},
    {DType::kI32, "I32", 4},
    {DType::kI16, "I16", 2},
    {DType::kI8, "I8", 1},
    {DType::kU64, "U64", 8},
    {DType::kU32, "U32", 4},
    {DType::kU16, "U16", 2},
    {DType::kU8, "U8", 1},
    {DType::kBool, "BOOL", 1},
}};

const DTypeEntry& Entry(DType dtype) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.dtype == dtype) return entry;
  }
  return kDTypes[1];  // unreachable: every enumerator has an entry
}

// Shapes in messages; hostile headers may carry millions of dims.
std::string ShapeString(const std::vector<int64_t>& shape) {
  constexpr size_t kMaxDims = 8;
  if (shape.size() <= kMaxDims) return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
  std::vector<int64_t> head(shape.begin(), shape.begin() + kMaxDims);
  return absl::StrCat("[", absl::StrJoin(head, ", "), ", ... (", shape.size(), " dims)]");
}

std::string DescribeNonInteger(const json& value) {
  if (value.is_number_float()) return absl::StrCat("the number ", value.get<double>());
  return absl::StrCat("a JSON ", value.type_name());
}

absl::Status TensorError(absl::string_view name, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteForMessage(name), ": ", what));
}

// Reads a JSON integer in [0, 2^63) into `out`; `what` names the field for the message.
absl::Status ReadIndex(absl::string_view name, const json& value, const std::string& what,
                       uint64_t* out) {
  if (value.is_number_integer() && !value.is_number_unsigned()) {
    return TensorError(name, absl::StrCat(what, " is negative (", value.get<int64_t>(), ")"));
  }
  if (!value.is_number_unsigned()) {
    return TensorError(name, absl::StrCat(what, " must be a non-negative integer, got ",
                                          DescribeNonInteger(value)));
  }
  const uint64_t v = value.get<uint64_t>();
  if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return TensorError(name, absl::StrCat(what, " (", v, ") exceeds 2^63 - 1"));
  }
  *out = v;
  return absl::OkStatus();
}

absl::StatusOr<const json*> Field(absl::string_view name, const json& entry, const char* key) {
  auto it = entry.find(key);
  if (it == entry.end()) return TensorError(name, absl::StrCat("missing \"", key, "\""));
  return &*it;
}

absl::StatusOr<TensorInfo> ParseTensor(const std::string& name, const json& entry,
                                       uint64_t data_bytes) {
  if (!entry.is_object()) {
    return TensorError(name, absl::StrCat("entry must be a JSON object with dtype, shape and "
                                          "data_offsets, got a JSON ",
                                          entry.type_name()));
  }
  TensorInfo info;
  info.name = name;

  ASSIGN_OR_RETURN(const json* dtype, Field(name, entry, "dtype"));
  if (!dtype->is_string()) {
    return TensorError(name, absl::StrCat("\"dtype\" must be a string, got a JSON ",
                                          dtype->type_name()));
  }
  absl::StatusOr<DType> parsed = ParseDType(dtype->get_ref<const std::string&>());
  if (!parsed.ok()) return TensorError(name, parsed.status().message());
  info.dtype = *parsed;

  ASSIGN_OR_RETURN(const json* shape, Field(name, entry, "shape"));
  if (!shape->is_array()) {
    return TensorError(name, absl::StrCat("\"shape\" must be an array, got a JSON ",
                                          shape->type_name()));
  }
  uint64_t numel = 1;
  bool overflow = false;
  info.shape.reserve(shape->size());
  for (size_t i = 0; i < shape->size(); ++i) {
    uint64_t dim = 0;
    RETURN_IF_ERROR(ReadIndex(name, (*shape)[i], absl::StrCat("shape[", i, "]"), &dim));
    info.shape.push_back(static_cast<int64_t>(dim));
    overflow |= __builtin_mul_overflow(numel, dim, &numel);
  }
  uint64_t expected_bytes = 0;
  overflow |= __builtin_mul_overflow(numel, DTypeSize(info.dtype), &expected_bytes);
  if (overflow) {
    return TensorError(name, absl::StrCat("shape ", ShapeString(info.shape), " of ",
                                          DTypeName(info.dtype),
                                          " has a byte size that overflows 64 bits"));
  }

  ASSIGN_OR_RETURN(const json* offsets, Field(name, entry, "data_offsets"));
  if (!offsets->is_array() || offsets->size() != 2) {
    return TensorError(name, "\"data_offsets\" must be an array [begin, end]");
  }
  RETURN_IF_ERROR(ReadIndex(name, (*offsets)[0], "data_offsets[0]", &info.begin));
  RETURN_IF_ERROR(ReadIndex(name, (*offsets)[1], "data_offsets[1]", &info.end));
  const std::string offsets_text = absl::StrCat("data_offsets [", info.begin, ", ", info.end, "]");
  if (info.begin > info.end) {
    return TensorError(name, absl::StrCat(offsets_text, " end before they begin"));
  }
  if (info.end - info.begin != expected_bytes) {
    return TensorError(
        name, absl::StrCat(offsets_text, " span ", info.end - info.begin, " bytes, but ",
                           DTypeName(info.dtype), " with shape ", ShapeString(info.shape),
                           " needs ", expected_bytes));
  }
  if (info.end > data_bytes) {
    return absl::DataLossError(absl::StrCat(
        "tensor ", QuoteForMessage(name), ": ", offsets_text, " end past the data section (",
        data_bytes, " bytes): the file is truncated or the offsets are wrong"));
  }
  return info;
}

absl::Status ParseMetadata(const json& value, std::map<std::string, std::string>* out) {
  if (!value.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat("\"", kMetadataKey,
                                                   "\" must be an object of strings, got a JSON ",
                                                   value.type_name()));
  }
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("\"", kMetadataKey, "\" value for key ",
                                                     QuoteForMessage(key),
                                                     " must be a string, got a JSON ",
                                                     item.type_name()));
    }
    out->emplace(key, item.get<std::string>());
  }
  return absl::OkStatus();
}

// The tensors must tile [0, data_bytes) exactly, as the format requires: sorted by offset,
// each begins where the previous ends. Empty tensors may sit at any boundary.
absl::Status CheckCoverage(const std::vector<TensorInfo>& tensors, uint64_t data_bytes) {
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors.size());
  for (const TensorInfo& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  uint64_t cursor = 0;
  const TensorInfo* previous = nullptr;  // the tensor that ends at `cursor`
  for (const TensorInfo* t : by_offset) {
    if (t->begin < cursor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensors ", QuoteForMessage(previous->name), " [", previous->begin, ", ",
          previous->end, ") and ", QuoteForMessage(t->name), " [", t->begin, ", ", t->end,
          ") overlap in the data section"));
    }
    if (t->begin > cursor) {
      return absl::InvalidArgumentError(absl::StrCat(
          "gap in the data section: bytes [", cursor, ", ", t->begin, ") before tensor ",
          QuoteForMessage(t->name), " belong to no tensor"));
    }
    if (t->end > cursor || previous == nullptr) {
      cursor = t->end;
      previous = t;
    }
  }
  if (cursor != data_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the data section holds ", data_bytes, " bytes but its tensors cover only [0, ", cursor,
        "): bytes [", cursor, ", ", data_bytes, ") belong to no tensor"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::string_view DTypeName(DType dtype) { return Entry(dtype).name; }

uint64_t DTypeSize(DType dtype) { return Entry(dtype).size; }

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", QuoteForMessage(name)));
}

uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t dim : shape) n *= static_cast<uint64_t>(dim);
  return n;
}

const TensorInfo* Header::Find(absl::string_view name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, absl::string_view n) { return t.name < n; });
  if (it == tensors.end() || it->name != name) return nullptr;
  return &*it;
}

absl::StatusOr<Header> ParseSafetensorsHeader(absl::string_view bytes, uint64_t file_size) {
  if (bytes.size() > file_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "given ", bytes.size(), " bytes of a file said to hold only ", file_size));
  }
  if (file_size < kHeaderLengthBytes) {
    return absl::DataLossError(absl::StrCat("file holds ", file_size,
                                            " bytes, fewer than the 8-byte header length: "
                                            "truncated or not a safetensors file"));
  }
  if (bytes.size() < kHeaderLengthBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("given ", bytes.size(), " bytes, fewer than the 8-byte header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);  // little-endian
  if (n > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("header length ", n, " exceeds the limit of ",
                                                   kMaxHeaderBytes, " bytes"));
  }
  if (n > file_size - kHeaderLengthBytes) {
    return absl::DataLossError(absl::StrCat("header length ", n, " runs past the end of the file (",
                                            file_size, " bytes): truncated file"));
  }
  if (bytes.size() - kHeaderLengthBytes < n) {
    return absl::InvalidArgumentError(absl::StrCat("given ", bytes.size(),
                                                   " bytes, but the header ends at byte ",
                                                   kHeaderLengthBytes + n));
  }
  const absl::string_view text = bytes.substr(kHeaderLengthBytes, n);
  if (text.empty() || text.front() != '{') {
    return absl::InvalidArgumentError("header JSON must start with '{'");
  }
  absl::StatusOr<json> parsed = ParseJsonStrict(text);
  if (!parsed.ok()) return Annotate(parsed.status(), "header JSON");
  if (!parsed->is_object()) return absl::InvalidArgumentError("header JSON is not an object");

  Header header;
  header.header_bytes = n;
  header.data_offset = kHeaderLengthBytes + n;
  header.data_bytes = file_size - header.data_offset;
  // nlohmann objects iterate in key order, so tensors come out sorted by name.
  for (const auto& [key, value] : parsed->items()) {
    if (key == kMetadataKey) {
      RETURN_IF_ERROR(ParseMetadata(value, &header.metadata));
      continue;
    }
    ASSIGN_OR_RETURN(TensorInfo info, ParseTensor(key, value, header.data_bytes));
    header.tensors.push_back(std::move(info));
  }
  RETURN_IF_ERROR(CheckCoverage(header.tensors, header.data_bytes));
  return header;
}

}  // namespace nq::model
