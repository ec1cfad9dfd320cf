#include "services/router/api_key.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

namespace nq::router {
namespace {

std::array<unsigned char, 32> Sha256(const std::string& text) {
  std::array<unsigned char, 32> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(text.data()), text.size(), digest.data());
  return digest;
}

}  // namespace

ApiKeyCheck::ApiKeyCheck(const std::string& key) : enabled_(!key.empty()), digest_(Sha256(key)) {}

absl::Status ApiKeyCheck::Check(const std::string& authorization) const {
  if (!enabled_) return absl::OkStatus();
  constexpr char kBearer[] = "Bearer ";
  if (authorization.rfind(kBearer, 0) != 0) {
    return absl::UnauthenticatedError("missing API key: send 'Authorization: Bearer <key>'");
  }
  const std::array<unsigned char, 32> offered = Sha256(authorization.substr(sizeof(kBearer) - 1));
  if (CRYPTO_memcmp(offered.data(), digest_.data(), digest_.size()) != 0) {
    return absl::UnauthenticatedError("incorrect API key");
  }
  return absl::OkStatus();
}

}  // namespace nq::router
