#include "services/worker/tp_identity.h"

#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

namespace nq::worker {
namespace {

std::vector<std::pair<std::string, std::string>> Fields(const TpIdentity& id) {
  return {{"model", id.model_id},
          {"config.json", id.config_hash},
          {"release", id.release_id},
          {"expert_bits", id.expert_bits},
          {"world_size", absl::StrCat(id.world_size)},
          {"backend", id.backend},
          {"weight_dtype", id.weight_dtype},
          {"kv_cache_dtype", id.kv_cache_dtype},
          {"max_model_len", absl::StrCat(id.max_model_len)}};
}

}  // namespace

std::string TpIdentity::Serialize() const {
  std::string out;
  for (const auto& [key, value] : Fields(*this)) absl::StrAppend(&out, key, "=", value, "\n");
  return out;
}

absl::Status TpIdentity::CheckAgainstLeader(absl::string_view leader) const {
  std::vector<std::pair<std::string, std::string>> theirs;
  for (absl::string_view line : absl::StrSplit(leader, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    theirs.push_back(std::move(kv));
  }
  const auto mine = Fields(*this);
  for (size_t i = 0; i < mine.size(); ++i) {
    const std::string* value = nullptr;
    for (const auto& [key, v] : theirs) {
      if (key == mine[i].first) value = &v;
    }
    if (value == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank 0 publishes no '", mine[i].first, "': another nq-worker build"));
    }
    if (*value != mine[i].second) {
      return absl::FailedPreconditionError(absl::StrCat(mine[i].first, " mismatch: rank 0 serves '", *value,
                                                        "', this rank '", mine[i].second, "'"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ConfigHash(const std::string& model_dir) {
  std::ifstream in(model_dir + "/config.json", std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", model_dir, "/config.json"));
  std::ostringstream bytes;
  bytes << in.rdbuf();
  uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a 64 offset basis and prime
  for (unsigned char c : bytes.str()) h = (h ^ c) * 0x100000001b3ULL;
  return absl::StrFormat("%016x", h);
}

}  // namespace nq::worker
