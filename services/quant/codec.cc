#include "services/quant/codec.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"
#include "services/quant/nested_scalar_codec.h"
#include "services/quant/trellis_codec.h"

namespace nq::quant {

int64_t PlaneBytes(int64_t rows, int64_t cols, int bits) {
  const int64_t per_byte = 8 / bits;
  return (rows * cols + per_byte - 1) / per_byte;
}

int64_t BasePlaneBytes(const EncodedMatrix& m) {
  return PlaneBytes(m.rows, m.cols, m.params.base_bits);
}

int64_t ResidualPlaneBytes(const EncodedMatrix& m) {
  return PlaneBytes(m.rows, m.cols, m.params.residual_bits);
}

std::vector<uint8_t> PackCodes(std::span<const uint8_t> codes, int bits) {
  const int per_byte = 8 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  std::vector<uint8_t> plane(static_cast<size_t>(PlaneBytes(1, static_cast<int64_t>(codes.size()), bits)), 0);
  for (size_t k = 0; k < codes.size(); ++k) {
    plane[k / per_byte] |= static_cast<uint8_t>((codes[k] & mask) << (bits * (k % per_byte)));
  }
  return plane;
}

absl::Status AttachResidual(EncodedMatrix& m, std::vector<uint8_t> residual_plane) {
  const int64_t expected = ResidualPlaneBytes(m);
  if (static_cast<int64_t>(residual_plane.size()) != expected) {
    return absl::InvalidArgumentError(absl::StrCat("residual plane has ", residual_plane.size(),
                                                   " bytes, expected ", expected, " for ",
                                                   m.rows, " x ", m.cols));
  }
  m.residual_codes = std::move(residual_plane);
  return absl::OkStatus();
}

void DropResidual(EncodedMatrix& m) {
  m.residual_codes.clear();
  m.residual_codes.shrink_to_fit();
}

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, CodecFactory> factories;
};

Registry& GetRegistry() {
  static Registry* registry = [] {
    auto* r = new Registry();
    r->factories[std::string(kNestedScalarV1)] = [] {
      return std::make_unique<NestedScalarCodec>();
    };
    r->factories[std::string(kTrellisV1)] = [] { return std::make_unique<TrellisCodec>(); };
    return r;
  }();
  return *registry;
}

}  // namespace

absl::Status RegisterCodec(const std::string& name, CodecFactory factory) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.factories.count(name) != 0) {
    return absl::AlreadyExistsError(absl::StrCat("codec '", name, "' is already registered"));
  }
  r.factories[name] = std::move(factory);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Codec>> MakeCodec(absl::string_view name) {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.factories.find(std::string(name));
  if (it == r.factories.end()) {
    std::vector<std::string> names;
    for (const auto& [n, f] : r.factories) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("unknown codec '", name, "' (known: ",
                                            absl::StrJoin(names, ", "), ")"));
  }
  return it->second();
}

absl::StatusOr<std::string> ResolveCodecName(absl::string_view name) {
  if (name == "scalar") return std::string(kNestedScalarV1);
  if (name == "trellis") return std::string(kTrellisV1);
  ASSIGN_OR_RETURN(std::unique_ptr<Codec> codec, MakeCodec(name));
  return codec->name();
}

std::vector<std::string> RegisteredCodecNames() {
  Registry& r = GetRegistry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> names;
  for (const auto& [n, f] : r.factories) names.push_back(n);
  return names;
}

}  // namespace nq::quant
