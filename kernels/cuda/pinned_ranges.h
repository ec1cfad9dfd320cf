// The page-locked host ranges a backend handed out (Backend::AllocateHostStaging), so a copy to the
// host can tell whether its destination may be written by a kernel: under unified addressing a
// page-locked address is also a device address, while a kernel storing to pageable memory would
// fault the whole context. Thread-safe: staging is allocated and freed from the serving threads
// while a model's thread issues copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace nq::kernels::cuda {

class PinnedRanges {
 public:
  void Add(const void* begin, std::size_t bytes) {
    absl::MutexLock lock(&mu_);
    ranges_[Address(begin)] = bytes;
  }
  void Remove(const void* begin) {
    absl::MutexLock lock(&mu_);
    ranges_.erase(Address(begin));
  }
  // Whether [p, p + bytes) lies inside one range.
  bool Contains(const void* p, std::size_t bytes) const {
    const std::uintptr_t at = Address(p);
    absl::MutexLock lock(&mu_);
    auto it = ranges_.upper_bound(at);  // the first range starting after p
    if (it == ranges_.begin()) return false;
    --it;
    const std::uintptr_t offset = at - it->first;
    return offset <= it->second && bytes <= it->second - offset;
  }

 private:
  static std::uintptr_t Address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

  mutable absl::Mutex mu_;
  std::map<std::uintptr_t, std::size_t> ranges_ ABSL_GUARDED_BY(mu_);
};

}  // namespace nq::kernels::cuda
