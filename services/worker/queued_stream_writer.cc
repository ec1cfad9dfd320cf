#include "services/worker/queued_stream_writer.h"

namespace nq::worker {

QueuedStreamWriter::QueuedStreamWriter(Writer* writer) : writer_(writer), thread_([this] { Loop(); }) {}

QueuedStreamWriter::~QueuedStreamWriter() { Finish(); }

bool QueuedStreamWriter::Push(nq::v1::WorkerGenerateResponse response) {
  absl::MutexLock lock(&mu_);
  if (failed_) return false;
  // The first message (the prefill's token and its step time) always travels alone; later ones
  // may be merged with the message queued before them.
  if (first_pushed_ && !queue_.empty() && (first_taken_ || queue_.size() > 1)) {
    nq::v1::WorkerGenerateResponse& back = queue_.back();
    for (nq::v1::TokenLogprob& token : *response.mutable_tokens()) *back.add_tokens() = std::move(token);
    back.set_step_seconds(back.step_seconds() + response.step_seconds());
    return true;
  }
  first_pushed_ = true;
  queue_.push_back(std::move(response));
  return true;
}

void QueuedStreamWriter::Loop() {
  for (;;) {
    nq::v1::WorkerGenerateResponse next;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](QueuedStreamWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return !w->queue_.empty() || w->finishing_; },
          this));
      if (queue_.empty()) return;  // finishing, and everything is written
      next = std::move(queue_.front());
      queue_.pop_front();
      first_taken_ = true;
    }
    if (!writer_->Write(next)) {
      absl::MutexLock lock(&mu_);
      failed_ = true;
      queue_.clear();
    }
  }
}

bool QueuedStreamWriter::Finish() {
  {
    absl::MutexLock lock(&mu_);
    finishing_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  return !failed_;
}

}  // namespace nq::worker
