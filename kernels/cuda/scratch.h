// Per-op device scratch layout of the CUDA backend. Host spans an op needs on the device (token
// ids, row lists, weights, inv_freq) are packed into one staging buffer and copied with a single
// cudaMemcpyAsync on the backend's stream; device-only intermediates (the indexer's scores) get
// space after them. The backend owns one scratch block, reused by every op: ops are stream-ordered,
// so an op's copy into scratch runs only after the previous op's kernels are done with it.
#pragma once

#include <cstddef>
#include <cstring>
#include <span>
#include <vector>

namespace nq::kernels::cuda {

// Every region starts 16-byte aligned (float4 / uint4 loads).
inline constexpr std::size_t kScratchAlign = 16;

class ScratchLayout {
 public:
  // Appends a copy of `values`; returns its byte offset in scratch.
  template <typename T>
  std::size_t AddHost(std::span<const T> values) {
    const std::size_t offset = AlignedEnd(staging_.size());
    staging_.resize(offset + values.size_bytes());
    if (!values.empty()) std::memcpy(staging_.data() + offset, values.data(), values.size_bytes());
    device_end_ = staging_.size();
    return offset;
  }

  // Reserves `bytes` of device-only space after everything added so far; returns its offset.
  // Call after the last AddHost.
  std::size_t AddDevice(std::size_t bytes) {
    const std::size_t offset = AlignedEnd(device_end_);
    device_end_ = offset + bytes;
    return offset;
  }

  // The bytes to copy to the start of scratch.
  const std::vector<std::byte>& staging() const { return staging_; }
  // Scratch bytes the op needs in all.
  std::size_t total_bytes() const { return device_end_; }

 private:
  static std::size_t AlignedEnd(std::size_t end) {
    return (end + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
  }

  std::vector<std::byte> staging_;
  std::size_t device_end_ = 0;
};

}  // namespace nq::kernels::cuda
