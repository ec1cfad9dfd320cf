// Whether the client of an HTTP request is still connected, for handlers that run long
// (a generation) and must stop when nobody waits for the answer.
//
// cpp-httplib 0.11 (Debian 12) gives a handler neither its socket nor a "closed" callback,
// only the connection's addresses. A TCP connection is identified by its address 4-tuple, so
// the handler finds its own socket among the process's descriptors by that tuple, once, and
// then polls it. The descriptor stays valid for the handler's whole run: httplib closes it
// only after the handler has returned.
#pragma once

#include <string>

#include <httplib.h>

#include "absl/status/statusor.h"

namespace nq {

class HttpPeer {
 public:
  // NOT_FOUND when no socket of this process matches the request's addresses (the request
  // did not come over TCP, or the connection is already gone).
  static absl::StatusOr<HttpPeer> Find(const httplib::Request& request);

  // True once the client has closed or reset the connection. Data the client sent after
  // the request (a pipelined request) does not count as closing. Never blocks.
  bool Gone() const;

 private:
  explicit HttpPeer(int fd) : fd_(fd) {}
  int fd_;  // owned by httplib; valid while the handler runs
};

}  // namespace nq
