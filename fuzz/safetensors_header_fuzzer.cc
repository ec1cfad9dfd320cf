// libFuzzer target for the safetensors header parser (scripts/fuzz_safetensors.sh runs it).
//
// ParseSafetensorsHeader reads untrusted files, so on any bytes it must return a Status
// without crashing, leaking, throwing or tripping a sanitizer, and whatever it accepts must
// satisfy the guarantees readers rely on; a broken guarantee traps, so the fuzzer reports it.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "fuzz/fuzz_require.h"
#include "services/model/safetensors_header.h"

using nq::fuzz::Require;

namespace {

using nq::model::DTypeSize;
using nq::model::Header;
using nq::model::TensorInfo;


// What an accepted header promises: the layout adds up, tensors are sorted and unique by
// name, every byte range matches its dtype and shape and lies in the data section, and the
// ranges tile the data section exactly.
void CheckAccepted(const Header& header, uint64_t file_size) {
  Require(header.data_offset == 8 + header.header_bytes);
  Require(header.data_offset <= file_size);
  Require(header.data_bytes == file_size - header.data_offset);
  std::vector<const TensorInfo*> by_offset;
  for (size_t i = 0; i < header.tensors.size(); ++i) {
    const TensorInfo& t = header.tensors[i];
    if (i > 0) Require(header.tensors[i - 1].name < t.name);
    Require(header.Find(t.name) == &t);
    Require(t.begin <= t.end && t.end <= header.data_bytes);
    for (int64_t dim : t.shape) Require(dim >= 0);
    Require(t.byte_size() == t.numel() * DTypeSize(t.dtype));
    by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t cursor = 0;
  for (const TensorInfo* t : by_offset) {
    Require(t->begin == cursor);
    cursor = t->end;
  }
  Require(cursor == header.data_bytes);
}

void Check(absl::string_view bytes, uint64_t file_size) {
  absl::StatusOr<Header> header = nq::model::ParseSafetensorsHeader(bytes, file_size);
  if (header.ok()) {
    CheckAccepted(*header, file_size);
  } else {
    const absl::StatusCode code = header.status().code();
    Require(code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kDataLoss);
    Require(!header.status().message().empty());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  Check(bytes, size);
  // The same bytes as the start of a far larger file: offsets meet a huge data section and
  // the size arithmetic runs near 2^64.
  Check(bytes, std::numeric_limits<uint64_t>::max());
  return 0;
}
