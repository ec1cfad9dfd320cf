// Seconds since a steady-clock instant: the one conversion every timed path here needs (read
// latencies, refresh and prefill timings).
#pragma once

#include <chrono>

namespace nq {

inline double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace nq
