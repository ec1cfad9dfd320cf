#include "kernels/cpu/parallel.h"

#include <algorithm>
#include <thread>
#include <vector>

namespace nq::kernels::cpu {

void ParallelFor(std::int64_t n, std::int64_t min_chunk, int max_threads,
                 const std::function<void(std::int64_t, std::int64_t)>& body,
                 std::int64_t align) {
  if (n <= 0) return;
  min_chunk = std::max<std::int64_t>(min_chunk, 1);
  align = std::max<std::int64_t>(align, 1);
  const std::int64_t threads =
      std::clamp<std::int64_t>(n / min_chunk, 1, std::max(max_threads, 1));
  if (threads == 1) {
    body(0, n);
    return;
  }
  std::int64_t chunk = (n + threads - 1) / threads;
  chunk = (chunk + align - 1) / align * align;
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  // The caller's thread takes the first chunk; workers take the rest.
  for (std::int64_t begin = chunk; begin < n; begin += chunk) {
    workers.emplace_back(body, begin, std::min(n, begin + chunk));
  }
  body(0, std::min(n, chunk));
  for (std::thread& t : workers) t.join();
}

}  // namespace nq::kernels::cpu
