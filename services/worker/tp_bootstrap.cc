#include "services/worker/tp_bootstrap.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::worker {
namespace {

constexpr uint64_t kMagic = 0x4e51'5450'424f'4f54ULL;  // "NQTPBOOT"
// Bumped whenever the record's fields change: another build's record is refused by this number.
constexpr uint32_t kLayout = 1;
constexpr size_t kChecksumAt = kTpBootstrapBytes - 8;

// FNV-1a 64 (the same hash tp_identity.cc uses for config.json): catches a torn or foreign
// record, which is all it is for (the channel is a private shm segment, not an adversary).
uint64_t Fnv1a(std::span<const std::byte> bytes) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (std::byte b : bytes) h = (h ^ static_cast<uint8_t>(b)) * 0x100000001b3ULL;
  return h;
}

class Writer {
 public:
  explicit Writer(std::vector<std::byte>& out) : out_(out) {}
  template <typename T>
  void Put(const T& v) {
    const size_t at = out_.size();
    out_.resize(at + sizeof(T));
    std::memcpy(out_.data() + at, &v, sizeof(T));
  }

 private:
  std::vector<std::byte>& out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}
  template <typename T>
  T Get() {
    T v;
    std::memcpy(&v, in_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }

 private:
  std::span<const std::byte> in_;
  size_t at_ = 0;
};

}  // namespace

absl::string_view TpTransportName(TpTransport transport) {
  switch (transport) {
    case TpTransport::kSharedMemory: return "shared-memory";
    case TpTransport::kNccl: return "nccl";
  }
  return "unknown";
}

std::vector<std::byte> EncodeTpBootstrap(const TpBootstrap& b) {
  std::vector<std::byte> out;
  out.reserve(kTpBootstrapBytes);
  Writer w(out);
  w.Put(kMagic);
  w.Put(kLayout);
  w.Put(static_cast<uint32_t>(b.transport));
  w.Put(b.world_size);
  w.Put(b.nccl_version);
  w.Put(b.generation);
  w.Put(b.id);
  w.Put(Fnv1a(out));
  return out;
}

absl::StatusOr<TpBootstrap> DecodeTpBootstrap(std::span<const std::byte> bytes) {
  if (bytes.size() != kTpBootstrapBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor-parallel bootstrap of ", bytes.size(), " bytes, want ", kTpBootstrapBytes));
  }
  Reader r(bytes);
  if (r.Get<uint64_t>() != kMagic) return absl::InvalidArgumentError("tensor-parallel bootstrap: bad magic");
  if (const uint32_t layout = r.Get<uint32_t>(); layout != kLayout) {
    return absl::InvalidArgumentError(absl::StrCat("tensor-parallel bootstrap layout ", layout, ", this build reads ",
                                                   kLayout, " (another nq-worker build)"));
  }
  TpBootstrap b;
  b.transport = static_cast<TpTransport>(r.Get<uint32_t>());
  b.world_size = r.Get<uint32_t>();
  b.nccl_version = r.Get<int32_t>();
  b.generation = r.Get<uint64_t>();
  b.id = r.Get<kernels::NcclUniqueId>();
  if (r.Get<uint64_t>() != Fnv1a(bytes.first(kChecksumAt))) {
    return absl::InvalidArgumentError("tensor-parallel bootstrap: checksum mismatch (a torn or foreign record)");
  }
  return b;
}

absl::Status CheckTpBootstrap(const TpBootstrap& got, const TpBootstrapExpectation& want) {
  if (got.transport != want.transport) {
    return absl::FailedPreconditionError(absl::StrCat("transport mismatch: rank 0 runs its collectives over ",
                                                      TpTransportName(got.transport), ", this rank over ",
                                                      TpTransportName(want.transport)));
  }
  if (got.world_size != want.world_size) {
    return absl::FailedPreconditionError(absl::StrCat("world_size mismatch: rank 0 sent ", got.world_size,
                                                      ", this rank was started with ", want.world_size));
  }
  if (got.generation != want.generation) {
    return absl::FailedPreconditionError(absl::StrCat("generation mismatch: rank 0 sent the id of group generation ",
                                                      got.generation, ", this rank joined generation ",
                                                      want.generation));
  }
  if (got.transport == TpTransport::kNccl && got.nccl_version != want.nccl_version) {
    return absl::FailedPreconditionError(absl::StrCat("nccl_version mismatch: rank 0 runs NCCL ", got.nccl_version,
                                                      ", this rank ", want.nccl_version,
                                                      " (ranks of one communicator need one NCCL build)"));
  }
  return absl::OkStatus();
}

absl::Status SendTpBootstrap(kernels::GroupControl& control, const TpBootstrap& bootstrap, absl::Duration timeout) {
  if (control.rank() != 0) return absl::InvalidArgumentError("only rank 0 sends the bootstrap");
  std::vector<std::byte> bytes = EncodeTpBootstrap(bootstrap);
  return control.BroadcastBytes(bytes, 0, timeout);
}

absl::StatusOr<TpBootstrap> ReceiveTpBootstrap(kernels::GroupControl& control, TpBootstrapExpectation want,
                                               absl::Duration timeout) {
  if (control.rank() == 0) return absl::InvalidArgumentError("rank 0 sends the bootstrap; it does not receive one");
  std::vector<std::byte> bytes(kTpBootstrapBytes);
  RETURN_IF_ERROR(control.BroadcastBytes(bytes, 0, timeout));
  absl::StatusOr<TpBootstrap> got = DecodeTpBootstrap(bytes);
  absl::Status checked = got.ok() ? CheckTpBootstrap(*got, want) : got.status();
  if (!checked.ok()) {
    const std::string reason = absl::StrCat("rank ", control.rank(), " refused rank 0's bootstrap: ", checked.message());
    control.Break(reason);
    return absl::FailedPreconditionError(reason);
  }
  return got;
}

}  // namespace nq::worker
