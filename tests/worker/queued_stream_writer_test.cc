#include "services/worker/queued_stream_writer.h"

#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace nq::worker {
namespace {

// A stream whose writes can be held back (a slow client) or fail (a client gone).
class FakeStream : public grpc::internal::WriterInterface<nq::v1::WorkerGenerateResponse> {
 public:
  bool Write(const nq::v1::WorkerGenerateResponse& message, grpc::WriteOptions) override {
    if (hold_first_ && written_count() == 0) release_.WaitForNotification();
    absl::MutexLock lock(&mu_);
    if (fail_) return false;
    written_.push_back(message);
    return true;
  }
  std::vector<nq::v1::WorkerGenerateResponse> written() {
    absl::MutexLock lock(&mu_);
    return written_;
  }
  size_t written_count() {
    absl::MutexLock lock(&mu_);
    return written_.size();
  }
  void Fail() {
    absl::MutexLock lock(&mu_);
    fail_ = true;
  }

  bool hold_first_ = false;
  absl::Notification release_;

 private:
  absl::Mutex mu_;
  bool fail_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<nq::v1::WorkerGenerateResponse> written_ ABSL_GUARDED_BY(mu_);
};

nq::v1::WorkerGenerateResponse Step(uint32_t token, double seconds) {
  nq::v1::WorkerGenerateResponse response;
  response.add_tokens()->set_token_id(token);
  response.set_step_seconds(seconds);
  return response;
}

std::vector<uint32_t> Tokens(const std::vector<nq::v1::WorkerGenerateResponse>& messages) {
  std::vector<uint32_t> ids;
  for (const auto& m : messages) {
    for (const auto& t : m.tokens()) ids.push_back(t.token_id());
  }
  return ids;
}

TEST(QueuedStreamWriter, EveryTokenArrivesInOrder) {
  FakeStream stream;
  QueuedStreamWriter queued(&stream);
  for (uint32_t t = 0; t < 200; ++t) ASSERT_TRUE(queued.Push(Step(t, 0.001)));
  EXPECT_TRUE(queued.Finish());
  std::vector<uint32_t> expected(200);
  for (uint32_t t = 0; t < 200; ++t) expected[t] = t;
  EXPECT_EQ(Tokens(stream.written()), expected);
}

TEST(QueuedStreamWriter, ASlowClientGetsMergedMessagesAndThePrefillAlone) {
  FakeStream stream;
  stream.hold_first_ = true;
  QueuedStreamWriter queued(&stream);
  // The prefill's message is being written (held) while five decode steps arrive.
  ASSERT_TRUE(queued.Push(Step(10, 0.5)));
  for (uint32_t t = 11; t <= 15; ++t) ASSERT_TRUE(queued.Push(Step(t, 0.01)));
  stream.release_.Notify();
  EXPECT_TRUE(queued.Finish());
  const std::vector<nq::v1::WorkerGenerateResponse> written = stream.written();
  EXPECT_EQ(Tokens(written), (std::vector<uint32_t>{10, 11, 12, 13, 14, 15}));
  ASSERT_GE(written.size(), 2u);
  EXPECT_EQ(written[0].tokens_size(), 1) << "the prefill travels alone";
  EXPECT_DOUBLE_EQ(written[0].step_seconds(), 0.5);
  EXPECT_LT(written.size(), 6u) << "the decode steps queued behind the held write were merged";
  double decode_seconds = 0;
  for (size_t i = 1; i < written.size(); ++i) decode_seconds += written[i].step_seconds();
  EXPECT_NEAR(decode_seconds, 0.05, 1e-12);
}

TEST(QueuedStreamWriter, AFailedWriteStopsTheSequence) {
  FakeStream stream;
  QueuedStreamWriter queued(&stream);
  ASSERT_TRUE(queued.Push(Step(1, 0)));
  stream.Fail();
  // Whichever of the two is written after the failure fails; the generation must then stop.
  (void)queued.Push(Step(2, 0));
  EXPECT_FALSE(queued.Finish());
  EXPECT_FALSE(queued.Push(Step(3, 0)));
}

}  // namespace
}  // namespace nq::worker
