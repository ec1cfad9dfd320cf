// libFuzzer target for a release's rank index and COMPLETE list (scripts/fuzz.sh rank_index).
//
// The streamer and the worker turn these files' offsets and sizes into reads, so on any bytes
// the parsers must return a Status without crashing or tripping a sanitizer, and what they
// accept must survive serialisation unchanged and keep every byte range inside a file offset
// (offset + bytes without wrap-around). The first input byte picks the parser.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_require.h"
#include "services/format/rank_index.h"

using nq::fuzz::Require;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    const absl::StatusOr<nq::format::RankIndex> index = nq::format::ParseRankIndex(text, "rank0.json");
    if (!index.ok()) {
      Require(!index.status().message().empty());
      return 0;
    }
    for (const nq::format::LayerEntry& e : index->layers) {
      Require(e.record_sha256.size() == index->experts_per_layer);
      for (const nq::format::FileRange* r : {&e.records, &e.resident}) {
        Require(r->offset + r->bytes >= r->offset);
        Require(!r->file.empty() && r->file[0] != '/');
      }
    }
    const absl::StatusOr<nq::format::RankIndex> again =
        nq::format::ParseRankIndex(nq::format::SerializeRankIndex(*index), "rank0.json");
    Require(again.ok() && *again == *index);
  } else {
    const absl::StatusOr<std::vector<nq::format::CompleteEntry>> complete = nq::format::ParseComplete(text);
    if (!complete.ok()) {
      Require(!complete.status().message().empty());
      return 0;
    }
    const absl::StatusOr<std::vector<nq::format::CompleteEntry>> again =
        nq::format::ParseComplete(nq::format::SerializeComplete(*complete));
    Require(again.ok() && again->size() == complete->size());
  }
  return 0;
}
