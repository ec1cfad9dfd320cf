#include "services/common/http_peer.h"

#include <dirent.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace nq {
namespace {

struct Endpoint {
  std::string address;
  int port = -1;
};

// Formats like httplib does for Request::remote_addr / local_addr (numeric host).
bool Describe(const sockaddr_storage& addr, socklen_t len, Endpoint* out) {
  char host[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), service, sizeof(service),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    return false;
  }
  out->address = host;
  out->port = std::atoi(service);
  return true;
}

bool Matches(int fd, const httplib::Request& request) {
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return false;
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  Endpoint peer, local;
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || !Describe(addr, len, &peer)) return false;
  if (peer.port != request.remote_port || peer.address != request.remote_addr) return false;
  len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 || !Describe(addr, len, &local)) return false;
  return local.port == request.local_port && local.address == request.local_addr;
}

}  // namespace

absl::StatusOr<HttpPeer> HttpPeer::Find(const httplib::Request& request) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return absl::UnavailableError("cannot list /proc/self/fd to find the client's socket");
  int found = -1;
  while (dirent* entry = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(entry->d_name, &end, 10);
    if (end == entry->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    if (Matches(static_cast<int>(fd), request)) {
      found = static_cast<int>(fd);
      break;
    }
  }
  closedir(dir);
  if (found < 0) {
    return absl::NotFoundError(absl::StrCat("no socket connects ", request.local_addr, ":", request.local_port,
                                            " with the client ", request.remote_addr, ":", request.remote_port));
  }
  return HttpPeer(found);
}

bool HttpPeer::Gone() const {
  pollfd p{.fd = fd_, .events = POLLIN | POLLRDHUP, .revents = 0};
  if (poll(&p, 1, 0) < 0) return false;
  if ((p.revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return true;
  if ((p.revents & POLLRDHUP) != 0) return true;
  if ((p.revents & POLLIN) == 0) return false;
  // Readable: either more request bytes (still connected) or the end of the stream.
  char byte;
  const ssize_t n = recv(fd_, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0;
}

}  // namespace nq
