#include "kernels/comm/cpu_communicator.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace nq::kernels {
namespace {

absl::Status CheckF32(const char* op, const Tensor& t) {
  if (!t.valid() || t.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": want an F32 tensor, got ", t.DebugString()));
  }
  return absl::OkStatus();
}

}  // namespace

CpuCommunicatorGroup::CpuCommunicatorGroup(int world_size)
    : world_size_(world_size), posted_(world_size), barrier_(world_size) {}

absl::StatusOr<std::vector<std::unique_ptr<CpuCommunicator>>> CpuCommunicatorGroup::Create(int world_size) {
  if (world_size < 1) return absl::InvalidArgumentError(absl::StrCat("world size ", world_size, " < 1"));
  auto group = std::make_shared<CpuCommunicatorGroup>(world_size);
  std::vector<std::unique_ptr<CpuCommunicator>> comms;
  for (int r = 0; r < world_size; ++r) {
    comms.push_back(std::unique_ptr<CpuCommunicator>(new CpuCommunicator(group, r)));
  }
  return comms;
}

int CpuCommunicator::world_size() const { return group_->world_size_; }

absl::Status CpuCommunicator::AllReduceSum(Tensor& data) {
  if (absl::Status s = CheckF32("AllReduceSum", data); !s.ok()) return s;
  CpuCommunicatorGroup& g = *group_;
  if (g.world_size_ == 1) return absl::OkStatus();
  const int64_t n = data.NumElements();
  g.posted_[rank_] = {data.data_as<float>(), data.data_as<float>(), n};
  g.barrier_.arrive_and_wait();
  for (int r = 0; r < g.world_size_; ++r) {
    if (g.posted_[r].n != n) {
      // A size mismatch is a programming error on some rank; every rank sees it and fails.
      g.barrier_.arrive_and_wait();
      return absl::FailedPreconditionError(
          absl::StrCat("AllReduceSum: rank ", r, " posted ", g.posted_[r].n, " elements, rank ",
                       rank_, " posted ", n));
    }
  }
  // Each rank sums a contiguous chunk over all ranks in rank order, so every rank ends with
  // the same bits; the chunks are written in place after the second barrier.
  const int64_t chunk = (n + g.world_size_ - 1) / g.world_size_;
  const int64_t begin = std::min(n, chunk * rank_);
  const int64_t end = std::min(n, begin + chunk);
  std::vector<float> sum(static_cast<size_t>(end - begin), 0.0f);
  for (int r = 0; r < g.world_size_; ++r) {
    const float* in = g.posted_[r].in;
    for (int64_t i = begin; i < end; ++i) sum[i - begin] += in[i];
  }
  g.barrier_.arrive_and_wait();  // everyone has read the inputs
  for (int r = 0; r < g.world_size_; ++r) {
    std::memcpy(g.posted_[r].out + begin, sum.data(), sum.size() * sizeof(float));
  }
  g.barrier_.arrive_and_wait();  // every chunk has landed everywhere
  return absl::OkStatus();
}

absl::Status CpuCommunicator::AllGather(const Tensor& in, Tensor& out) {
  if (absl::Status s = CheckF32("AllGather", in); !s.ok()) return s;
  if (absl::Status s = CheckF32("AllGather", out); !s.ok()) return s;
  CpuCommunicatorGroup& g = *group_;
  const int64_t n = in.NumElements();
  if (out.NumElements() != n * g.world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("AllGather: out has ", out.NumElements(),
                                                   " elements, want ", n * g.world_size_));
  }
  g.posted_[rank_] = {in.data_as<float>(), nullptr, n};
  g.barrier_.arrive_and_wait();
  for (int r = 0; r < g.world_size_; ++r) {
    std::memcpy(out.data_as<float>() + r * n, g.posted_[r].in, static_cast<size_t>(n) * sizeof(float));
  }
  g.barrier_.arrive_and_wait();
  return absl::OkStatus();
}

absl::Status CpuCommunicator::Broadcast(Tensor& data, int root) {
  if (absl::Status s = CheckF32("Broadcast", data); !s.ok()) return s;
  CpuCommunicatorGroup& g = *group_;
  if (root < 0 || root >= g.world_size_) {
    return absl::InvalidArgumentError(absl::StrCat("Broadcast: root ", root, " out of range"));
  }
  g.posted_[rank_] = {data.data_as<float>(), data.data_as<float>(), data.NumElements()};
  g.barrier_.arrive_and_wait();
  if (rank_ != root) {
    std::memcpy(data.data_as<float>(), g.posted_[root].in,
                static_cast<size_t>(std::min(data.NumElements(), g.posted_[root].n)) * sizeof(float));
  }
  g.barrier_.arrive_and_wait();
  return absl::OkStatus();
}

}  // namespace nq::kernels
