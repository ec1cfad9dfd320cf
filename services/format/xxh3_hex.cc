// Xxh3Hex (file_io.h). Debian's libxxhash-dev, compiled inline here (XXH_INLINE_ALL): no
// runtime library to ship in images, and the hash runs at the width this file is built for.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "services/format/file_io.h"

namespace nq::format {

std::string Xxh3Hex(std::span<const std::byte> data) {
  const XXH128_hash_t hash = XXH3_128bits(data.data(), data.size());
  XXH128_canonical_t canonical;
  XXH128_canonicalFromHash(&canonical, hash);
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(2 * sizeof(canonical.digest), '0');
  for (size_t i = 0; i < sizeof(canonical.digest); ++i) {
    hex[2 * i] = kDigits[canonical.digest[i] >> 4];
    hex[2 * i + 1] = kDigits[canonical.digest[i] & 0xf];
  }
  return hex;
}

}  // namespace nq::format
