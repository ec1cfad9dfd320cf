// A minimal fork-join helper for the CPU backend: splits [0, n) into contiguous chunks run by a
// process-wide pool of hardware_concurrency - 1 threads and the caller (parallel.cc says how a
// call stays safe when called from several threads or from inside a body).
#pragma once

#include <cstdint>
#include <functional>

namespace nq::kernels::cpu {

// Calls body(begin, end) over disjoint chunks covering [0, n), on up to `max_threads` threads
// (the caller's included). Runs inline when `max_threads` <= 1 or n < 2 * min_chunk. Chunk bounds
// are multiples of `align` (except the last end), so callers can keep blocked loops whole.
void ParallelFor(std::int64_t n, std::int64_t min_chunk, int max_threads,
                 const std::function<void(std::int64_t begin, std::int64_t end)>& body,
                 std::int64_t align = 1);

}  // namespace nq::kernels::cpu
