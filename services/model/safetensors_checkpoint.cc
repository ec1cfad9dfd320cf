// Checkpoint: a Hugging Face checkpoint directory, single-file or sharded.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_json.h"

namespace nq::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// An index lists every tensor once (DeepSeek-V3's is ~10 MB); anything far larger is not one.
constexpr uint64_t kMaxIndexBytes = 256ull << 20;

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

absl::StatusOr<std::string> ReadIndexFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    const std::string message = absl::StrCat("open(", path, "): ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
  }
  std::string text;
  char buffer[1 << 16];
  absl::Status status;
  while (true) {
    const ssize_t n = read(fd, buffer, sizeof(buffer));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      status = absl::InternalError(absl::StrCat("read(", path, "): ", std::strerror(errno)));
      break;
    }
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > kMaxIndexBytes) {
      status = absl::InvalidArgumentError(absl::StrCat("index ", path, " exceeds ",
                                                       kMaxIndexBytes, " bytes"));
      break;
    }
  }
  close(fd);
  if (!status.ok()) return status;
  return text;
}

// Shard paths come from the index; they must stay inside the checkpoint directory.
absl::Status CheckShardPath(const std::string& index_path, const std::string& tensor,
                            const std::string& shard) {
  const fs::path p(shard);
  bool escapes = shard.empty() || p.is_absolute();
  for (const fs::path& part : p) escapes |= (part == "..");
  if (escapes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "index ", index_path, ": tensor ", QuoteForMessage(tensor), " maps to shard ",
        QuoteForMessage(shard), ", which is not a relative path inside the checkpoint"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Checkpoint> Checkpoint::Open(const std::string& path) {
  Checkpoint checkpoint;
  checkpoint.path_ = path;
  std::string single_path;
  std::string index_path;
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, ": ", std::strerror(errno)));
  }
  if (S_ISDIR(st.st_mode)) {
    const std::string single = (fs::path(path) / std::string(kSingleFileName)).string();
    const std::string index = (fs::path(path) / std::string(kIndexFileName)).string();
    if (IsRegularFile(single)) {
      single_path = single;
    } else if (IsRegularFile(index)) {
      index_path = index;
    } else {
      return absl::NotFoundError(absl::StrCat("checkpoint directory ", path, " holds neither ",
                                              kSingleFileName, " nor ", kIndexFileName));
    }
  } else if (absl::EndsWith(path, ".index.json")) {
    index_path = path;
  } else {
    single_path = path;
  }

  if (!single_path.empty()) {
    ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(single_path));
    for (size_t i = 0; i < file.header().tensors.size(); ++i) {
      checkpoint.tensors_.emplace(file.header().tensors[i].name, Location{0, i});
    }
    checkpoint.shards_.push_back(std::move(file));
    return checkpoint;
  }

  checkpoint.sharded_ = true;
  const std::string context = absl::StrCat("index ", index_path);
  ASSIGN_OR_RETURN(std::string text, ReadIndexFile(index_path));
  absl::StatusOr<json> index = ParseJsonStrict(text);
  if (!index.ok()) return Annotate(index.status(), context);
  const auto weight_map = index->is_object() ? index->find("weight_map") : index->end();
  if (!index->is_object() || weight_map == index->end() || !weight_map->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(context, ": expected a JSON object with a \"weight_map\" object"));
  }
  if (weight_map->empty()) return absl::InvalidArgumentError(context + ": \"weight_map\" is empty");

  // shard file -> the tensors the index puts there.
  std::map<std::string, std::vector<std::string>> listed;
  for (const auto& [tensor, shard] : weight_map->items()) {
    if (!shard.is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(context, ": tensor ", QuoteForMessage(tensor),
                                                     " maps to a JSON ", shard.type_name(),
                                                     ", expected a shard file name"));
    }
    const std::string& shard_name = shard.get_ref<const std::string&>();
    RETURN_IF_ERROR(CheckShardPath(index_path, tensor, shard_name));
    listed[shard_name].push_back(tensor);
  }

  const fs::path dir = fs::path(index_path).parent_path();
  std::vector<std::string> shard_names;
  for (auto& [shard_name, tensors] : listed) {
    const std::string shard_path = (dir / shard_name).string();
    if (!IsRegularFile(shard_path)) {
      return absl::NotFoundError(absl::StrCat(
          context, ": shard ", QuoteForMessage(shard_name), " (listed for tensor ",
          QuoteForMessage(tensors.front()), tensors.size() > 1 ? " and others" : "",
          ") does not exist as ", shard_path));
    }
    ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(shard_path));
    checkpoint.shards_.push_back(std::move(file));
    shard_names.push_back(shard_name);
  }

  // Every tensor any shard holds, once; then the index must name exactly those.
  for (size_t s = 0; s < checkpoint.shards_.size(); ++s) {
    const std::vector<TensorInfo>& tensors = checkpoint.shards_[s].header().tensors;
    for (size_t i = 0; i < tensors.size(); ++i) {
      auto [it, inserted] = checkpoint.tensors_.emplace(tensors[i].name, Location{s, i});
      if (!inserted) {
        return absl::InvalidArgumentError(absl::StrCat(
            context, ": tensor ", QuoteForMessage(tensors[i].name), " is stored in two shards, ",
            QuoteForMessage(shard_names[it->second.shard]), " and ",
            QuoteForMessage(shard_names[s])));
      }
    }
  }
  for (size_t s = 0; s < shard_names.size(); ++s) {
    for (const std::string& tensor : listed[shard_names[s]]) {
      auto it = checkpoint.tensors_.find(tensor);
      if (it == checkpoint.tensors_.end() || it->second.shard != s) {
        return absl::InvalidArgumentError(absl::StrCat(
            context, ": maps tensor ", QuoteForMessage(tensor), " to shard ",
            QuoteForMessage(shard_names[s]), ", which does not hold it",
            it == checkpoint.tensors_.end()
                ? std::string(" (no shard does)")
                : absl::StrCat(" (shard ", QuoteForMessage(shard_names[it->second.shard]),
                               " does)")));
      }
    }
  }
  for (const auto& [tensor, location] : checkpoint.tensors_) {
    if (!weight_map->contains(tensor)) {
      return absl::InvalidArgumentError(absl::StrCat(
          context, ": shard ", QuoteForMessage(shard_names[location.shard]), " holds tensor ",
          QuoteForMessage(tensor), ", which the index does not list"));
    }
  }
  return checkpoint;
}

std::vector<std::string> Checkpoint::Names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, location] : tensors_) names.push_back(name);
  return names;
}

bool Checkpoint::Contains(absl::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

absl::StatusOr<TensorView> Checkpoint::Find(absl::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor ", QuoteForMessage(name),
                                            " not found in checkpoint ", path_, " (",
                                            tensors_.size(), " tensors)"));
  }
  const SafetensorsFile& shard = shards_[it->second.shard];
  return shard.View(shard.header().tensors[it->second.tensor]);
}

}  // namespace nq::model
