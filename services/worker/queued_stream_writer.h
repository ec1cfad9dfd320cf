// Writes a Generate stream's messages from a thread of its own (DESIGN.md section 3: the decode
// loop never waits on the network). A synchronous gRPC Write returns once the message is handed
// to the transport, which costs tens of microseconds on loopback and blocks outright under flow
// control when the client reads slowly; on the GPU that was a measurable share of a step.
// Messages that pile up while a write is in flight are merged into one (their tokens in order),
// so a slow reader receives fewer, larger messages instead of holding up decoding.
#pragma once

#include <deque>
#include <thread>

#include <grpcpp/support/sync_stream.h>

#include "absl/synchronization/mutex.h"
#include "nq/v1/worker.pb.h"

namespace nq::worker {

class QueuedStreamWriter {
 public:
  using Writer = grpc::internal::WriterInterface<nq::v1::WorkerGenerateResponse>;
  explicit QueuedStreamWriter(Writer* writer);
  ~QueuedStreamWriter();  // Finish()
  QueuedStreamWriter(const QueuedStreamWriter&) = delete;
  QueuedStreamWriter& operator=(const QueuedStreamWriter&) = delete;

  // Queues a message; false once a write has failed (the client is gone), when the caller
  // should stop generating. Never blocks on the network.
  bool Push(nq::v1::WorkerGenerateResponse response);
  // Waits until every queued message is written and stops the thread; whether all writes
  // succeeded. The stream is the caller's again afterwards (for the final message).
  bool Finish();

 private:
  void Loop();

  Writer* const writer_;
  absl::Mutex mu_;
  std::deque<nq::v1::WorkerGenerateResponse> queue_ ABSL_GUARDED_BY(mu_);
  bool first_pushed_ ABSL_GUARDED_BY(mu_) = false;
  bool first_taken_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool failed_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace nq::worker
