#include "services/streamer/record_verifier.h"

#include <utility>

#include "absl/status/status.h"
#include "services/format/file_io.h"

namespace nq::streamer {

absl::StatusOr<std::shared_ptr<RecordVerifier>> RecordVerifier::Create(unsigned threads) {
  if (threads == 0) return absl::InvalidArgumentError("record verifier: 0 threads");
  std::shared_ptr<RecordVerifier> verifier(new RecordVerifier());
  for (unsigned t = 0; t < threads; ++t) verifier->threads_.emplace_back([v = verifier.get()] { v->Run(); });
  return verifier;
}

RecordVerifier::~RecordVerifier() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void RecordVerifier::Submit(std::span<const std::byte> bytes, RecordDigest expected, Done done) {
  absl::MutexLock lock(&mu_);
  jobs_.push_back(Job{.bytes = bytes, .expected = std::move(expected), .done = std::move(done)});
}

void RecordVerifier::Run() {
  while (true) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](RecordVerifier* v) ABSL_EXCLUSIVE_LOCKS_REQUIRED(v->mu_) { return v->stop_ || !v->jobs_.empty(); },
          this));
      // Queued jobs run even while stopping: each owner waits for its `done` calls.
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job.done(RecordMatches(job.bytes, job.expected));
  }
}

}  // namespace nq::streamer
