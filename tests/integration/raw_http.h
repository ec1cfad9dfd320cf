// A minimal HTTP/1.1 client on a raw socket for the serving tests: it can read a streamed
// (SSE) response event by event and hang up in the middle, which the library clients hide.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::testing {

class RawHttp {
 public:
  // Connects to 127.0.0.1:port and sends a POST with a JSON body.
  static absl::StatusOr<RawHttp> Post(int port, const std::string& path, const std::string& body,
                                      const std::vector<std::string>& extra_headers = {});
  // The same with a GET and no body.
  static absl::StatusOr<RawHttp> Get(int port, const std::string& path,
                                     const std::vector<std::string>& extra_headers = {});
  RawHttp(RawHttp&& other) noexcept;
  RawHttp& operator=(RawHttp&&) = delete;
  ~RawHttp();

  // The status code (reads the response head on first call).
  absl::StatusOr<int> Status();
  // The next "data: ..." payload of an SSE stream (without the prefix), or NOT_FOUND at the
  // end of the stream.
  absl::StatusOr<std::string> NextEvent();
  // Everything after the head (the non-streamed body).
  absl::StatusOr<std::string> Body();
  // Hangs up now.
  void Close();

 private:
  explicit RawHttp(int fd) : fd_(fd) {}
  static absl::StatusOr<RawHttp> Send(int port, const std::string& method, const std::string& path,
                                      const std::string& body, const std::vector<std::string>& extra_headers);
  absl::Status Fill();

  int fd_ = -1;
  std::string buffer_;
  bool head_read_ = false;
  int status_ = 0;
  bool eof_ = false;
};

}  // namespace nq::testing
