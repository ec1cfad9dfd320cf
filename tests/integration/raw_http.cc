#include "tests/integration/raw_http.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace nq::testing {

absl::StatusOr<RawHttp> RawHttp::Post(int port, const std::string& path, const std::string& body,
                                      const std::vector<std::string>& extra_headers) {
  return Send(port, "POST", path, body, extra_headers);
}

absl::StatusOr<RawHttp> RawHttp::Get(int port, const std::string& path, const std::vector<std::string>& extra_headers) {
  return Send(port, "GET", path, "", extra_headers);
}

absl::StatusOr<RawHttp> RawHttp::Send(int port, const std::string& method, const std::string& path,
                                      const std::string& body, const std::vector<std::string>& extra_headers) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect :", port, ": ", std::strerror(errno)));
  }
  std::string request = absl::StrCat(method, " ", path, " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n",
                                     "Content-Type: application/json\r\nContent-Length: ", body.size(), "\r\n");
  for (const std::string& h : extra_headers) absl::StrAppend(&request, h, "\r\n");
  absl::StrAppend(&request, "\r\n", body);
  RawHttp http(fd);
  size_t sent = 0;
  while (sent < request.size()) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return absl::UnavailableError("send failed");
    sent += static_cast<size_t>(n);
  }
  return http;
}

RawHttp::RawHttp(RawHttp&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), buffer_(std::move(other.buffer_)), head_read_(other.head_read_),
      status_(other.status_), eof_(other.eof_) {}

RawHttp::~RawHttp() { Close(); }

void RawHttp::Close() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

absl::Status RawHttp::Fill() {
  if (eof_) return absl::NotFoundError("end of stream");
  pollfd p{fd_, POLLIN, 0};
  // Generous: a test fails on a hang instead of waiting forever.
  if (poll(&p, 1, 30'000) <= 0) return absl::DeadlineExceededError("no data for 30 s");
  char chunk[4096];
  const ssize_t n = recv(fd_, chunk, sizeof(chunk), 0);
  if (n <= 0) {
    eof_ = true;
    return absl::NotFoundError("end of stream");
  }
  buffer_.append(chunk, static_cast<size_t>(n));
  return absl::OkStatus();
}

absl::StatusOr<int> RawHttp::Status() {
  while (!head_read_) {
    const size_t end = buffer_.find("\r\n\r\n");
    if (end != std::string::npos) {
      // "HTTP/1.1 200 OK"
      if (buffer_.size() < 12 || !absl::SimpleAtoi(buffer_.substr(9, 3), &status_)) {
        return absl::DataLossError("malformed status line");
      }
      buffer_.erase(0, end + 4);
      head_read_ = true;
      break;
    }
    if (absl::Status s = Fill(); !s.ok()) return s;
  }
  return status_;
}

absl::StatusOr<std::string> RawHttp::NextEvent() {
  if (absl::StatusOr<int> s = Status(); !s.ok()) return s.status();
  while (true) {
    // Events are "data: <payload>\n\n"; chunked-encoding size lines never start with "data: ".
    const size_t start = buffer_.find("data: ");
    if (start != std::string::npos) {
      const size_t end = buffer_.find("\n\n", start);
      if (end != std::string::npos) {
        std::string payload = buffer_.substr(start + 6, end - start - 6);
        buffer_.erase(0, end + 2);
        return payload;
      }
    }
    if (absl::Status s = Fill(); !s.ok()) return s;
  }
}

absl::StatusOr<std::string> RawHttp::Body() {
  if (absl::StatusOr<int> s = Status(); !s.ok()) return s.status();
  while (true) {
    absl::Status s = Fill();
    if (absl::IsNotFound(s)) return buffer_;
    if (!s.ok()) return s;
  }
}

}  // namespace nq::testing
