#include "kernels/cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace nq::kernels::cpu {
namespace {

// One ParallelFor call: `chunks` pieces of [0, n), claimed by index.
struct Job {
  const std::function<void(std::int64_t, std::int64_t)>* body = nullptr;
  std::int64_t n = 0;
  std::int64_t chunk = 0;
  std::int64_t chunks = 0;
  std::atomic<std::int64_t> next{0};  // next unclaimed chunk
  std::atomic<std::int64_t> done{0};  // chunks finished
  std::atomic<int> helpers{0};        // pool threads holding a pointer to this job
  std::mutex mu;
  std::condition_variable finished;

  bool Unclaimed() const { return next.load(std::memory_order_relaxed) < chunks; }
  // Runs chunks until none is left to claim.
  void Work() {
    for (std::int64_t i = next.fetch_add(1); i < chunks; i = next.fetch_add(1)) {
      const std::int64_t begin = i * chunk;
      (*body)(begin, std::min(n, begin + chunk));
      if (done.fetch_add(1) + 1 == chunks) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

// A process-wide pool of hardware_concurrency - 1 threads, started on first use, so a decode
// step's many small parallel ops do not each create and join threads (tens of microseconds
// apiece, a tenth of a CPU decode step on two cores). The calling thread always works on its
// own job too, so a call completes even when every pool thread is busy: calls from several
// threads at once (tensor-parallel ranks) and calls from inside a body are safe.
//
// Lifetime of a job: the caller queues it, works on it, takes it off the queue, then waits until
// every chunk is done and no pool thread still holds it (helpers == 0), so the job on the
// caller's stack outlives every use. The pool is never destroyed (its threads sleep at exit).
class Pool {
 public:
  static Pool& Get() {
    static Pool* pool = new Pool(std::max(1, static_cast<int>(std::thread::hardware_concurrency())) - 1);
    return *pool;
  }

  void Run(Job& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(&job);
    }
    wake_.notify_all();
    job.Work();
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.erase(std::find(jobs_.begin(), jobs_.end(), &job));
    }
    std::unique_lock<std::mutex> lock(job.mu);
    job.finished.wait(lock, [&] { return job.done.load() == job.chunks && job.helpers.load() == 0; });
  }

 private:
  explicit Pool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Serve(); });
  }

  // The first queued job with chunks left; null when none. Caller holds mu_.
  Job* FindWork() {
    for (Job* job : jobs_) {
      if (job->Unclaimed()) return job;
    }
    return nullptr;
  }

  void Serve() {
    while (true) {
      Job* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return (job = FindWork()) != nullptr; });
        job->helpers.fetch_add(1);  // under mu_: the caller cannot have dequeued it yet
      }
      job->Work();
      std::lock_guard<std::mutex> lock(job->mu);
      job->helpers.fetch_sub(1);
      job->finished.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<Job*> jobs_;
  std::vector<std::thread> threads_;
};

}  // namespace

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
  Job job;
  job.body = &body;
  job.n = n;
  job.chunk = chunk;
  job.chunks = (n + chunk - 1) / chunk;
  Pool::Get().Run(job);
}

}  // namespace nq::kernels::cpu
