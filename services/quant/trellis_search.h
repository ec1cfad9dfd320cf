// Where trellis_v1 spends its encode time, behind one interface: the Viterbi search of many
// 256-weight tiles at once (trellis_viterbi.h says what one search finds). The codec hands over
// every tile it can search together (all tiles of a matrix without LDLQ feedback, one 16-column
// block's tiles with it), so a searcher with many workers (threads, or the GPU's SMs in
// kernels/cuda/trellis_search.h) keeps them busy.
//
// Every implementation must give the CPU TileSearcher's symbols bit for bit: the release's
// bytes may not depend on where it was encoded.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace nq::quant {

class TrellisTileSearch {
 public:
  virtual ~TrellisTileSearch() = default;

  // Where the search runs, for logs ("cpu, 8 threads", "cuda:0").
  virtual std::string where() const = 0;

  // targets: n tiles of 256 unit-scaled values in tile order (trellis_decode.h), finite;
  // symbols: n * 256 bytes, each written 0..3. n may be 0.
  virtual absl::Status Search(std::span<const float> targets, std::span<uint8_t> symbols) = 0;
};

// The CPU search on `threads` threads (one TileSearcher of ~6.5 MiB each); threads <= 0 means
// one per hardware thread.
std::unique_ptr<TrellisTileSearch> MakeCpuTrellisTileSearch(int threads);

// Whether `search` gives the CPU search's symbols on a fixed set of tiles (Gaussian ones at three
// scales, all-zero, two-valued, and targets past the search's clamp): OK, or FailedPrecondition
// naming the first tile that differs (a release must not depend on where it was encoded). About
// 0.1 s of CPU search; nq encode asks it of every GPU before reading any checkpoint.
absl::Status CheckAgreesWithCpuSearch(TrellisTileSearch& search);

// The argument checks every implementation shares: sizes agree and are whole tiles. (Inline:
// the CUDA search in kernels/ links no service library.)
inline absl::Status CheckTileSearchArguments(std::span<const float> targets, std::span<const uint8_t> symbols) {
  constexpr size_t kTileWeights = 256;  // trellis_decode.h
  if (targets.size() % kTileWeights != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("trellis search: ", targets.size(), " targets are not whole 256-weight tiles"));
  }
  if (symbols.size() != targets.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("trellis search: ", symbols.size(), " symbol bytes for ", targets.size(), " targets"));
  }
  return absl::OkStatus();
}

}  // namespace nq::quant
