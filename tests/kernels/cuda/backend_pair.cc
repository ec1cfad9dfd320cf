#include "tests/kernels/cuda/backend_pair.h"

#include <algorithm>
#include <cstdio>

#include "gtest/gtest.h"
#include "tests/kernels/test_util.h"

namespace nq::kernels::testing {

BackendPair& Backends() {
  static BackendPair* pair = [] {
    auto* p = new BackendPair;
    // All cores: the CPU reference runs large shapes here. MlaAttention in float64, the oracle.
    p->cpu = MakeCpuReferenceBackend(0);
    absl::StatusOr<std::unique_ptr<Backend>> cuda = CreateBackend("cuda");
    if (cuda.ok()) {
      p->cuda = *std::move(cuda);
      std::printf("[  DEVICE  ] %s; CPU oracle: %s\n", p->cuda->DeviceDescription().c_str(),
                  p->cpu->DeviceDescription().c_str());
    } else {
      std::printf("[  DEVICE  ] no CUDA backend: %s\n", cuda.status().ToString().c_str());
    }
    std::fflush(stdout);
    return p;
  }();
  if (pair->cuda == nullptr) ADD_FAILURE() << "the CUDA backend could not be created";
  return *pair;
}

ErrorSummary::~ErrorSummary() {
  std::printf("[ compare  ] %s: %d cases, worst normalised error %.3g (tolerance %.0e)\n",
              op_.c_str(), cases_, worst_, tolerance_);
  std::fflush(stdout);
}

void ErrorSummary::Add(double error) {
  ++cases_;
  worst_ = std::max(worst_, error);
  EXPECT_LT(error, tolerance_) << op_;
}

}  // namespace nq::kernels::testing
