#include "services/worker/session_outbox.h"

#include <algorithm>
#include <utility>

namespace nq::worker {

size_t PushDroppingOldest(std::deque<nq::v1::WorkerMessage>& outbox, size_t& queued, size_t max,
                          nq::v1::WorkerMessage message,
                          const std::function<bool(const nq::v1::WorkerMessage&)>& is_kind) {
  if (max == 0) return 1;  // nothing of this kind may wait: the message itself is the one dropped
  size_t dropped = 0;
  if (queued >= max) {
    auto oldest = std::find_if(outbox.begin(), outbox.end(), is_kind);
    if (oldest != outbox.end()) {
      outbox.erase(oldest);
      --queued;
      dropped = 1;
    }
  }
  outbox.push_back(std::move(message));
  ++queued;
  return dropped;
}

}  // namespace nq::worker
