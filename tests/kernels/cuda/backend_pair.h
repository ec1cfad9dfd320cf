// The CPU (oracle) and CUDA backends every CUDA test compares, created once per process, and the
// comparison bookkeeping: each op's worst normalised error is printed at the end of its test.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"

namespace nq::kernels::testing {

struct BackendPair {
  std::unique_ptr<Backend> cpu;
  std::unique_ptr<Backend> cuda;  // null, with a test failure, when no CUDA backend could start
};

// Both backends; the first call prints the CUDA device.
BackendPair& Backends();

// CUDA backends whose decode GEMV runs every BF16 matrix on one kernel (BackendOptions::
// cuda_decode_gemv), beside Backends().cuda's automatic choice: {automatic, tensor cores, fp32
// FMAs}, so a test covers both kernels at every shape. Empty when no CUDA backend could start.
std::vector<Backend*> DecodeGemvBackends();

// Tracks the worst normalised error of one op across cases and prints
// "[ compare  ] <op>: <n> cases, worst normalised error <e> (tolerance <t>)" when destroyed.
class ErrorSummary {
 public:
  ErrorSummary(std::string op, double tolerance) : op_(std::move(op)), tolerance_(tolerance) {}
  ~ErrorSummary();
  ErrorSummary(const ErrorSummary&) = delete;
  ErrorSummary& operator=(const ErrorSummary&) = delete;

  // Records one case and EXPECTs error < tolerance.
  void Add(double error);

 private:
  std::string op_;
  double tolerance_;
  int cases_ = 0;
  double worst_ = 0.0;
};

}  // namespace nq::kernels::testing
