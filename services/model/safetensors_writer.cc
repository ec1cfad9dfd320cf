#include "services/model/safetensors_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_json.h"

namespace nq::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

static_assert(std::endian::native == std::endian::little, "safetensors is little-endian");

// The data section starts at a multiple of this (the reference writer pads to 8 too).
constexpr uint64_t kDataAlign = 8;

absl::Status ErrnoError(const char* what, const std::string& path, int err) {
  return absl::InternalError(absl::StrCat(what, "(", path, "): ", std::strerror(err)));
}

// Writes a file under a temporary name next to `path` and renames it over `path` on
// Commit(); a writer dropped before Commit() removes the temporary file.
class AtomicFile {
 public:
  static absl::StatusOr<AtomicFile> Create(const std::string& path) {
    static std::atomic<uint64_t> counter{0};
    AtomicFile file;
    file.path_ = path;
    file.tmp_path_ = absl::StrCat(path, ".tmp.", getpid(), ".", counter.fetch_add(1));
    file.fd_ = open(file.tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (file.fd_ < 0) return ErrnoError("open", file.tmp_path_, errno);
    return file;
  }

  AtomicFile(AtomicFile&& other) noexcept
      : path_(std::move(other.path_)),
        tmp_path_(std::move(other.tmp_path_)),
        fd_(std::exchange(other.fd_, -1)) {}
  AtomicFile& operator=(AtomicFile&&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) {
      close(fd_);
      unlink(tmp_path_.c_str());
    }
  }

  absl::Status Append(const void* data, size_t size) {
    const char* p = static_cast<const char*>(data);
    while (size > 0) {
      const ssize_t n = write(fd_, p, size);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) return ErrnoError("write", tmp_path_, errno);
      p += n;
      size -= static_cast<size_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Commit() {
    if (fsync(fd_) != 0) return ErrnoError("fsync", tmp_path_, errno);
    const int fd = std::exchange(fd_, -1);
    if (close(fd) != 0) {
      const int err = errno;
      unlink(tmp_path_.c_str());
      return ErrnoError("close", tmp_path_, err);
    }
    if (rename(tmp_path_.c_str(), path_.c_str()) != 0) {
      const int err = errno;
      unlink(tmp_path_.c_str());
      return ErrnoError("rename", path_, err);
    }
    // The rename is durable once the directory is.
    std::string dir = fs::path(path_).parent_path().string();
    if (dir.empty()) dir = ".";
    const int dir_fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd < 0) return ErrnoError("open", dir, errno);
    const int rc = fsync(dir_fd);
    const int err = errno;
    close(dir_fd);
    if (rc != 0) return ErrnoError("fsync", dir, err);
    return absl::OkStatus();
  }

 private:
  AtomicFile() = default;

  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
};

// Alignment class of a tensor's byte size: 3 for multiples of 8 (and empty tensors), 2 for
// multiples of 4, 1 for 2, 0 for odd sizes. Packing higher classes first keeps each start
// a multiple of 2^class.
int AlignmentClass(size_t bytes) {
  return bytes == 0 ? 3 : std::min(3, std::countr_zero(bytes));
}

absl::Status RemoveIfExists(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return ErrnoError("unlink", path, errno);
  return absl::OkStatus();
}

// transformers' shard naming: model-00001-of-00003.safetensors.
std::string ShardName(size_t index, size_t count) {
  return absl::StrFormat("model-%05d-of-%05d.safetensors", index + 1, count);
}

bool IsShardName(const std::string& name) {
  constexpr absl::string_view kPrefix = "model-";
  constexpr absl::string_view kSuffix = ".safetensors";
  return absl::StartsWith(name, kPrefix) && absl::EndsWith(name, kSuffix) &&
         name.find("-of-") != std::string::npos;
}

// Removes shards of an earlier write (another shard count leaves other names behind), as
// save_pretrained does, so the directory holds one checkpoint only.
absl::Status RemoveStaleShards(const std::string& dir, const std::set<std::string>& keep) {
  std::error_code ec;
  std::vector<std::string> stale;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (IsShardName(name) && !keep.contains(name)) stale.push_back(it->path().string());
  }
  if (ec) return absl::InternalError(absl::StrCat("listing ", dir, ": ", ec.message()));
  for (const std::string& path : stale) RETURN_IF_ERROR(RemoveIfExists(path));
  return absl::OkStatus();
}

}  // namespace

absl::Status SafetensorsWriter::Add(std::string name, DType dtype, std::vector<int64_t> shape,
                                    std::vector<std::byte> bytes) {
  if (name.empty() || name == kMetadataKey) {
    return absl::InvalidArgumentError(absl::StrCat("tensor name ", QuoteForMessage(name),
                                                   " is empty or reserved"));
  }
  if (tensors_.contains(name)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteForMessage(name),
                                                   " added twice"));
  }
  uint64_t numel = 1;
  bool overflow = false;
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteForMessage(name),
                                                     ": negative dim ", dim));
    }
    overflow |= __builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel);
  }
  uint64_t expected = 0;
  overflow |= __builtin_mul_overflow(numel, DTypeSize(dtype), &expected);
  if (overflow || expected != bytes.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", QuoteForMessage(name), ": ", DTypeName(dtype), " of ", numel,
        " elements needs ", overflow ? std::string("over 2^64") : absl::StrCat(expected),
        " bytes, got ", bytes.size()));
  }
  tensors_.emplace(std::move(name), Entry{dtype, std::move(shape), std::move(bytes)});
  return absl::OkStatus();
}

absl::Status SafetensorsWriter::AddFloat32(std::string name, std::vector<int64_t> shape,
                                           std::span<const float> values, DType dtype) {
  absl::StatusOr<std::vector<std::byte>> bytes = ConvertFromFloat32(values, dtype);
  if (!bytes.ok()) return Annotate(bytes.status(), absl::StrCat("tensor ", QuoteForMessage(name)));
  return Add(std::move(name), dtype, std::move(shape), *std::move(bytes));
}

absl::Status SafetensorsWriter::AddFp8BlockQuantized(std::string name, int64_t rows, int64_t cols,
                                                     std::span<const float> values,
                                                     int64_t block) {
  const std::string context = absl::StrCat("tensor ", QuoteForMessage(name));
  absl::StatusOr<Fp8BlockQuantized> q = QuantizeFp8Block(values, rows, cols, block);
  if (!q.ok()) return Annotate(q.status(), context);
  std::string scale_name = name + std::string(kScaleInvSuffix);
  if (tensors_.contains(scale_name)) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", QuoteForMessage(scale_name),
                                                   " added twice"));
  }
  RETURN_IF_ERROR(Add(std::move(name), DType::kF8E4M3, {rows, cols}, std::move(q->codes)));
  return AddFloat32(std::move(scale_name), {q->scale_rows, q->scale_cols}, q->scale_inv,
                    DType::kF32);
}

void SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

uint64_t SafetensorsWriter::data_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, entry] : tensors_) total += entry.bytes.size();
  return total;
}

absl::StatusOr<std::string> SafetensorsWriter::BuildHeader(const Names& names,
                                                           Names* data_order) const {
  *data_order = names;
  std::stable_sort(data_order->begin(), data_order->end(),
                   [this](const std::string* a, const std::string* b) {
                     return AlignmentClass(tensors_.at(*a).bytes.size()) >
                            AlignmentClass(tensors_.at(*b).bytes.size());
                   });
  json header = json::object();
  if (!metadata_.empty()) header[std::string(kMetadataKey)] = metadata_;
  uint64_t offset = 0;
  for (const std::string* name : *data_order) {
    const Entry& entry = tensors_.at(*name);
    header[*name] = {{"dtype", std::string(DTypeName(entry.dtype))},
                     {"shape", entry.shape},
                     {"data_offsets", {offset, offset + entry.bytes.size()}}};
    offset += entry.bytes.size();
  }
  std::string text;
  try {
    text = header.dump();  // throws only on invalid UTF-8 in a name or metadata
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot write the header: ", e.what()));
  }
  const uint64_t padded = (kHeaderLengthBytes + text.size() + kDataAlign - 1) / kDataAlign *
                          kDataAlign;
  text.resize(padded - kHeaderLengthBytes, ' ');
  std::string out(kHeaderLengthBytes, '\0');
  const uint64_t n = text.size();
  for (size_t i = 0; i < kHeaderLengthBytes; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + text;
}

absl::StatusOr<std::string> SafetensorsWriter::Serialize() const {
  Names names;
  for (const auto& [name, entry] : tensors_) names.push_back(&name);
  Names order;
  ASSIGN_OR_RETURN(std::string out, BuildHeader(names, &order));
  for (const std::string* name : order) {
    const std::vector<std::byte>& bytes = tensors_.at(*name).bytes;
    out.append(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  }
  return out;
}

absl::Status SafetensorsWriter::WriteFile(const std::string& path, const Names& names) const {
  Names order;
  ASSIGN_OR_RETURN(const std::string header, BuildHeader(names, &order));
  ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(path));
  RETURN_IF_ERROR(file.Append(header.data(), header.size()));
  for (const std::string* name : order) {
    const std::vector<std::byte>& bytes = tensors_.at(*name).bytes;
    RETURN_IF_ERROR(file.Append(bytes.data(), bytes.size()));
  }
  return file.Commit();
}

absl::Status SafetensorsWriter::Write(const std::string& path) const {
  Names names;
  for (const auto& [name, entry] : tensors_) names.push_back(&name);
  return WriteFile(path, names);
}

absl::Status SafetensorsWriter::WriteCheckpoint(const std::string& dir,
                                                uint64_t max_shard_bytes) const {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create_directories(", dir, "): ", ec.message()));
  const std::string single_path = (fs::path(dir) / std::string(Checkpoint::kSingleFileName)).string();
  const std::string index_path = (fs::path(dir) / std::string(Checkpoint::kIndexFileName)).string();

  std::vector<Names> shards(1);
  uint64_t shard_bytes = 0;
  for (const auto& [name, entry] : tensors_) {
    if (max_shard_bytes != 0 && !shards.back().empty() &&
        shard_bytes + entry.bytes.size() > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&name);
    shard_bytes += entry.bytes.size();
  }
  if (shards.size() == 1) {
    RETURN_IF_ERROR(WriteFile(single_path, shards[0]));
    RETURN_IF_ERROR(RemoveIfExists(index_path));
    return RemoveStaleShards(dir, {});
  }

  json weight_map = json::object();
  std::set<std::string> shard_names;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string shard_name = ShardName(i, shards.size());
    RETURN_IF_ERROR(WriteFile((fs::path(dir) / shard_name).string(), shards[i]));
    for (const std::string* name : shards[i]) weight_map[*name] = shard_name;
    shard_names.insert(shard_name);
  }
  const json index = {{"metadata", {{"total_size", data_bytes()}}}, {"weight_map", weight_map}};
  const std::string text = index.dump(2) + "\n";  // names were checked by the shard writes
  ASSIGN_OR_RETURN(AtomicFile file, AtomicFile::Create(index_path));
  RETURN_IF_ERROR(file.Append(text.data(), text.size()));
  RETURN_IF_ERROR(file.Commit());
  RETURN_IF_ERROR(RemoveIfExists(single_path));
  return RemoveStaleShards(dir, shard_names);
}

}  // namespace nq::model
