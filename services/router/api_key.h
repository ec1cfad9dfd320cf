// Bearer API-key check. The comparison takes the same time whatever the key offered (both
// sides are hashed to SHA-256 and compared with CRYPTO_memcmp), and the key is never logged.
#pragma once

#include <array>
#include <string>

#include "absl/status/status.h"

namespace nq::router {

class ApiKeyCheck {
 public:
  // An empty key disables the check.
  explicit ApiKeyCheck(const std::string& key);

  bool enabled() const { return enabled_; }
  // `authorization` is the Authorization header ("Bearer <key>"). UNAUTHENTICATED when the
  // header is missing, malformed or carries another key.
  absl::Status Check(const std::string& authorization) const;

 private:
  bool enabled_ = false;
  std::array<unsigned char, 32> digest_{};
};

}  // namespace nq::router
