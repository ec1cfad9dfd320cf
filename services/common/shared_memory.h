// POSIX shared memory (shm_open + mmap) with RAII: the CPU backend's slot arenas, written by
// the streamer and read by a worker in another process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace nq {

class SharedMemory {
 public:
  // Creates a new object `name` ("/nq-..."; must not exist) of `bytes`, zero-filled, mapped
  // read-write. The creator owns the name: it is unlinked when the creator is destroyed.
  static absl::StatusOr<SharedMemory> Create(const std::string& name, size_t bytes);
  // Maps an existing object read-write. NOT_FOUND if it does not exist, FAILED_PRECONDITION
  // if its size is not `expected_bytes`. The opener never unlinks the name.
  static absl::StatusOr<SharedMemory> Open(const std::string& name, size_t expected_bytes);
  // Removes a name left behind by a process that died (no-op when it is already gone).
  static absl::Status Unlink(const std::string& name);

  SharedMemory() = default;
  SharedMemory(SharedMemory&& other) noexcept;
  SharedMemory& operator=(SharedMemory&& other) noexcept;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;
  ~SharedMemory();

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }
  bool owns_name() const { return owns_name_; }

 private:
  void Reset();

  std::string name_;
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool owns_name_ = false;
};

}  // namespace nq
