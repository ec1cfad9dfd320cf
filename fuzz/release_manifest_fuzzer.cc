// libFuzzer target for a release's manifest.json (scripts/fuzz.sh release_manifest).
//
// ParseManifest reads a file anyone may hand the worker, the streamer or `nq`, so on any bytes it
// must return a Status without crashing or tripping a sanitizer; and what it accepts must be a
// fixed point of serialisation (writing it and parsing that back gives the same manifest), the
// property `nq assemble` and the readers rely on. A broken property traps.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_require.h"
#include "services/format/manifest.h"

using nq::fuzz::Require;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const absl::StatusOr<nq::format::Manifest> manifest = nq::format::ParseManifest(text);
  if (!manifest.ok()) {
    Require(!manifest.status().message().empty());  // errors must say what is wrong
    return 0;
  }
  const absl::StatusOr<nq::format::Manifest> again = nq::format::ParseManifest(nq::format::SerializeManifest(*manifest));
  Require(again.ok() && *again == *manifest);
  return 0;
}
