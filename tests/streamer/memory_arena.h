// An in-memory slot arena for loader tests: host memory, every write logged.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "services/streamer/arena_writer.h"

namespace nq::streamer {

class MemoryArena final : public ArenaWriter {
 public:
  explicit MemoryArena(uint64_t bytes) : memory_(bytes) {}
  uint64_t bytes() const override { return memory_.size(); }
  absl::Status Write(uint64_t offset, std::span<const std::byte> source) override {
    absl::MutexLock lock(&mu_);
    if (offset + source.size() > memory_.size()) return absl::OutOfRangeError("write leaves the arena");
    std::memcpy(memory_.data() + offset, source.data(), source.size());
    writes_.push_back(offset);
    return absl::OkStatus();
  }
  std::string Describe() const override { return "memory"; }
  std::vector<std::byte> Read(uint64_t offset, size_t size) const {
    absl::MutexLock lock(&mu_);
    return {memory_.begin() + static_cast<std::ptrdiff_t>(offset),
            memory_.begin() + static_cast<std::ptrdiff_t>(offset + size)};
  }
  std::vector<uint64_t> writes() const {
    absl::MutexLock lock(&mu_);
    return writes_;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::byte> memory_;
  std::vector<uint64_t> writes_;
};

}  // namespace nq::streamer
