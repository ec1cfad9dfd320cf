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

std::vector<Backend*> DecodeGemvBackends() {
  if (Backends().cuda == nullptr) return {};
  static std::unique_ptr<Backend>* forced = [] {
    auto* f = new std::unique_ptr<Backend>[2];
    int i = 0;
    for (DecodeGemv gemv : {DecodeGemv::kTensorCores, DecodeGemv::kFp32Fma}) {
      absl::StatusOr<std::unique_ptr<Backend>> cuda = CreateBackend("cuda", BackendOptions{.cuda_decode_gemv = gemv});
      if (cuda.ok()) f[i] = *std::move(cuda);
      ++i;
    }
    return f;
  }();
  std::vector<Backend*> all = {Backends().cuda.get()};
  for (int i = 0; i < 2; ++i) {
    if (forced[i] == nullptr) {
      ADD_FAILURE() << "a CUDA backend with a forced decode GEMV could not be created";
    } else {
      all.push_back(forced[i].get());
    }
  }
  return all;
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
