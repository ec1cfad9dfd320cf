// The cap on advice waiting for the streamer session's writer (services/worker/session_outbox.h):
// per kind, the oldest of the kind dropped for the newest, acknowledgements never touched.
#include "services/worker/session_outbox.h"

#include <gtest/gtest.h>

#include <deque>

namespace nq::worker {
namespace {

nq::v1::WorkerMessage HintFor(uint64_t token) {
  nq::v1::WorkerMessage m;
  m.mutable_lookahead()->set_token(token);
  return m;
}
nq::v1::WorkerMessage Ack(uint64_t generation) {
  nq::v1::WorkerMessage m;
  m.mutable_unmap_ack()->set_generation(generation);
  return m;
}
bool IsHint(const nq::v1::WorkerMessage& m) { return m.has_lookahead(); }

TEST(SessionOutboxTest, AFullKindDropsItsOldestAndKeepsEverythingElse) {
  std::deque<nq::v1::WorkerMessage> outbox;
  size_t hints = 0;
  outbox.push_back(Ack(7));  // acknowledgements are not hints: never dropped for one
  EXPECT_EQ(PushDroppingOldest(outbox, hints, 2, HintFor(0), IsHint), 0u);
  EXPECT_EQ(PushDroppingOldest(outbox, hints, 2, HintFor(1), IsHint), 0u);
  EXPECT_EQ(hints, 2u);
  // Full: token 0's hint goes, token 2's is queued.
  EXPECT_EQ(PushDroppingOldest(outbox, hints, 2, HintFor(2), IsHint), 1u);
  EXPECT_EQ(hints, 2u);
  ASSERT_EQ(outbox.size(), 3u);
  EXPECT_EQ(outbox[0].unmap_ack().generation(), 7u);
  EXPECT_EQ(outbox[1].lookahead().token(), 1u);
  EXPECT_EQ(outbox[2].lookahead().token(), 2u);
}

TEST(SessionOutboxTest, ACapOfZeroDropsTheMessageItself) {
  std::deque<nq::v1::WorkerMessage> outbox;
  size_t hints = 0;
  EXPECT_EQ(PushDroppingOldest(outbox, hints, 0, HintFor(0), IsHint), 1u);
  EXPECT_TRUE(outbox.empty());
  EXPECT_EQ(hints, 0u);
}

}  // namespace
}  // namespace nq::worker
