#include "services/streamer/record_files.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "spdlog/spdlog.h"

namespace nq::streamer {
namespace {

absl::Status OpenError(const std::string& path) {
  const int err = errno;
  return absl::ErrnoToStatus(err, absl::StrCat("open ", path, ": ", std::strerror(err)));
}

// True when `fd` (opened with O_DIRECT) can really read with it: some filesystems accept
// the flag at open and refuse the read with EINVAL.
bool DirectReadWorks(int fd, uint64_t offset) {
  void* probe = std::aligned_alloc(kDirectIoAlign, kDirectIoAlign);
  if (probe == nullptr) return false;
  ssize_t n = ::pread(fd, probe, kDirectIoAlign, static_cast<off_t>(offset));
  int err = errno;
  std::free(probe);
  return n >= 0 || err != EINVAL;
}

}  // namespace

absl::StatusOr<std::shared_ptr<RecordFiles>> RecordFiles::Open(std::vector<std::string> dirs,
                                                               DirectIo mode) {
  if (dirs.empty()) return absl::InvalidArgumentError("record store: no release directory");
  std::vector<Copy> copies;
  for (std::string& dir : dirs) {
    ASSIGN_OR_RETURN(format::Release release, format::Release::Open(dir));
    // Every read is checked against the index's record checksums: the index itself must be
    // the one COMPLETE lists (Open only parses it).
    if (const format::VerifyReport listed = release.VerifyListedFiles(); !listed.ok()) {
      return absl::DataLossError(absl::StrCat("record store: ", dir, ": ", listed.ToString()));
    }
    if (!copies.empty() && release.indexes() != copies.front().release.indexes()) {
      return absl::FailedPreconditionError(
          absl::StrCat("record store: mirror ", dir, " does not hold the same release as ",
                       copies.front().release.dir(), " (rank indexes differ)"));
    }
    copies.push_back(Copy{.release = std::move(release), .files = {}});
  }
  std::shared_ptr<RecordFiles> files(new RecordFiles(std::move(copies)));
  RETURN_IF_ERROR(files->OpenFiles(mode));
  return files;
}

RecordFiles::~RecordFiles() {
  for (Copy& copy : copies_) {
    for (auto& [key, file] : copy.files) {
      if (file->fd >= 0 && ::close(file->fd) != 0) {
        spdlog::warn("record store: close {}: {}", file->path, std::strerror(errno));
      }
    }
  }
}

absl::Status RecordFiles::OpenFiles(DirectIo mode) {
  for (Copy& copy : copies_) {
    for (const format::RankIndex& index : copy.release.indexes()) {
      for (const format::LayerEntry& entry : index.layers) {
        ASSIGN_OR_RETURN(std::string path, copy.release.RecordPath(index.rank, entry.layer));
        auto file = std::make_unique<File>();
        file->path = path;
        file->rank = index.rank;
        file->layer = entry.layer;
        file->base_offset = entry.records.offset;
        file->range_bytes = entry.records.bytes;
        file->rec_bytes = entry.layout.rec_bytes;
        file->sha256 = entry.records.sha256;
        file->entry = &entry;
        max_rec_bytes_ = std::max(max_rec_bytes_, file->rec_bytes);
        if (mode == DirectIo::kAuto) {
          file->fd = ::open(path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
          if (file->fd < 0 && errno != EINVAL) return OpenError(path);
          if (file->fd >= 0 && !DirectReadWorks(file->fd, file->base_offset)) {
            if (::close(file->fd) != 0) return OpenError(path);
            file->fd = -1;
          }
          if (file->fd >= 0) {
            file->direct = true;
          } else {
            spdlog::warn("record store: O_DIRECT refused for {}; reading it buffered", path);
          }
        }
        if (file->fd < 0) {
          file->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
          if (file->fd < 0) return OpenError(path);
        }
        copy.files.emplace(std::make_pair(index.rank, entry.layer), std::move(file));
      }
    }
  }
  return absl::OkStatus();
}

size_t RecordFiles::direct_files() const {
  size_t n = 0;
  for (const Copy& copy : copies_) {
    for (const auto& [key, file] : copy.files) n += file->direct ? 1 : 0;
  }
  return n;
}

bool RecordFiles::all_have_record_xxh3() const {
  for (const Copy& copy : copies_) {
    for (const auto& [key, file] : copy.files) {
      if (file->entry->record_xxh3.empty()) return false;
    }
  }
  return true;
}

size_t RecordFiles::buffered_files() const {
  size_t n = 0;
  for (const Copy& copy : copies_) n += copy.files.size();
  return n - direct_files();
}

absl::StatusOr<uint64_t> RecordFiles::RecordBytes(uint32_t rank, uint32_t layer) const {
  ASSIGN_OR_RETURN(const format::LayerEntry* entry, release().Layer(rank, layer));
  return entry->layout.rec_bytes;
}

const RecordFiles::File* RecordFiles::Find(size_t copy, uint32_t rank, uint32_t layer) const {
  if (copy >= copies_.size()) return nullptr;
  auto it = copies_[copy].files.find({rank, layer});
  return it == copies_[copy].files.end() ? nullptr : it->second.get();
}

absl::Status RecordFiles::Verify(const File& file) const {
  // Held while hashing: a second session wanting the same file waits for this hash rather
  // than reading the whole file again.
  absl::MutexLock lock(&file.mu);
  if (file.verified.has_value()) return *file.verified;
  absl::StatusOr<std::string> hash =
      format::Sha256FileRange(file.path, file.base_offset, file.range_bytes);
  files_hashed_.fetch_add(1);
  if (!hash.ok()) {
    file.verified = absl::DataLossError(absl::StrCat("record store: cannot hash ", file.path,
                                                     ": ", hash.status().message()));
  } else if (*hash != file.sha256) {
    file.verified = absl::DataLossError(absl::StrCat(
        "record store: ", file.path, " (rank ", file.rank, " layer ", file.layer,
        ") fails its sha256: index says ", file.sha256, ", file has ", *hash));
  } else {
    file.verified = absl::OkStatus();
  }
  if (!file.verified->ok()) spdlog::error("{}", std::string(file.verified->message()));
  return *file.verified;
}

absl::Status RecordFiles::VerifyLayer(uint32_t rank, uint32_t layer) const {
  RETURN_IF_ERROR(release().Layer(rank, layer).status());
  for (size_t copy = 0; copy < copies_.size(); ++copy) {
    RETURN_IF_ERROR(Verify(*Find(copy, rank, layer)));
  }
  return absl::OkStatus();
}

bool RecordFiles::LayerVerified(uint32_t rank, uint32_t layer) const {
  for (size_t copy = 0; copy < copies_.size(); ++copy) {
    const File* file = Find(copy, rank, layer);
    if (file == nullptr) return false;
    absl::MutexLock lock(&file->mu);
    if (!file->verified.has_value() || !file->verified->ok()) return false;
  }
  return true;
}

}  // namespace nq::streamer
