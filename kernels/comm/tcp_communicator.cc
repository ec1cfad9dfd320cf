#include "kernels/comm/tcp_communicator.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace nq::kernels {

enum class TcpCommunicator::Op : uint32_t {
  kHello = 1,
  kWelcome = 2,
  kAccept = 3,
  kRefuse = 4,
  kAllReduceSum = 10,
  kAllGather = 11,
  kBroadcastBytes = 12,
  kBreak = 20,
};

struct TcpCommunicator::Peer {
  int fd = -1;
  std::string host;
  uint32_t pid = 0;
  // One writer at a time: the collective thread, or Break's reason from another thread.
  std::mutex send_mu;
  ~Peer() {
    if (fd >= 0) close(fd);
  }
};

namespace {

constexpr uint32_t kMagic = 0x5054514Eu;  // "NQTP"
// A joining rank and rank 0 answer each other's hello within this (they are both running).
constexpr absl::Duration kHandshakeWait = absl::Seconds(5);
constexpr absl::Duration kConnectWait = absl::Seconds(2);
// Waits are cut into slices this long to notice `stop`.
constexpr absl::Duration kStopPoll = absl::Milliseconds(100);
// Longest text a refusal or break frame may carry.
constexpr uint64_t kMaxReasonBytes = 64 << 10;

struct FrameHeader {
  uint32_t magic = kMagic;
  uint32_t op = 0;
  uint64_t bytes = 0;
};
static_assert(sizeof(FrameHeader) == 16);

absl::Status Errno(absl::string_view what, int error) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(error)));
}

absl::Time DeadlineAfter(absl::Duration wait) {
  return wait == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + wait;
}

// Waits until `fd` has `events`, the deadline passes (DEADLINE_EXCEEDED) or `stop` is set
// (CANCELLED).
absl::Status PollFor(int fd, short events, absl::Time deadline, const std::atomic<bool>* stop) {
  for (;;) {
    if (stop != nullptr && stop->load()) return absl::CancelledError("stopping");
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return absl::DeadlineExceededError("timed out");
    pollfd p{.fd = fd, .events = events, .revents = 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(std::min(left, kStopPoll))) + 1;
    const int n = poll(&p, 1, ms);
    if (n < 0) {
      if (errno == EINTR) continue;
      return Errno("poll", errno);
    }
    if (n > 0) return absl::OkStatus();  // ready, or an error/hangup the next call reports
  }
}

absl::Status WriteAll(int fd, const void* data, size_t bytes, absl::Time deadline, const std::atomic<bool>* stop) {
  const auto* p = static_cast<const std::byte*>(data);
  while (bytes > 0) {
    const ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (absl::Status s = PollFor(fd, POLLOUT, deadline, stop); !s.ok()) return s;
      continue;
    }
    return Errno("send", n < 0 ? errno : EPIPE);
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, void* data, size_t bytes, absl::Time deadline, const std::atomic<bool>* stop) {
  auto* p = static_cast<std::byte*>(data);
  while (bytes > 0) {
    const ssize_t n = recv(fd, p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return absl::UnavailableError("the connection closed");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (absl::Status s = PollFor(fd, POLLIN, deadline, stop); !s.ok()) return s;
      continue;
    }
    return Errno("recv", errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<std::string, std::string>> SplitAddress(absl::string_view address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || colon == 0 || !absl::SimpleAtoi(address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("'", address, "': want host:port"));
  }
  std::string host(address.substr(0, colon));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  return std::make_pair(host, std::string(address.substr(colon + 1)));
}

// Small frames go at once (step commands are latency); keepalive probes notice a peer whose host
// vanished without closing the connection (a follower idling for a command would wait forever):
// after 10 s of silence, 3 probes 5 s apart.
void SetSocketOptions(int fd) {
  const int one = 1, idle = 10, interval = 5, count = 3;
  (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  (void)setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  (void)setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
}

// Payload helpers: fixed-width integers, then a trailing string.
void PutU32(std::vector<std::byte>& out, uint32_t v) {
  const auto* b = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), b, b + sizeof(v));
}
void PutU64(std::vector<std::byte>& out, uint64_t v) {
  const auto* b = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), b, b + sizeof(v));
}
void PutString(std::vector<std::byte>& out, absl::string_view s) {
  const auto* b = reinterpret_cast<const std::byte*>(s.data());
  out.insert(out.end(), b, b + s.size());
}
template <typename T>
T GetAt(std::span<const std::byte> in, size_t at) {
  T v{};
  std::memcpy(&v, in.data() + at, sizeof(T));
  return v;
}
std::string StringFrom(std::span<const std::byte> in, size_t at) {
  return at >= in.size() ? "" : std::string(reinterpret_cast<const char*>(in.data() + at), in.size() - at);
}

std::string OpName(uint32_t op) {
  switch (op) {
    case 10:
      return "all_reduce_sum";
    case 11:
      return "all_gather";
    case 12:
      return "broadcast";
    default:
      return absl::StrCat("op ", op);
  }
}

// A frame whose payload size is only known from its header (handshake, refusal, break).
absl::StatusOr<std::pair<FrameHeader, std::vector<std::byte>>> ReadFrame(int fd, absl::Time deadline,
                                                                        const std::atomic<bool>* stop,
                                                                        uint64_t max_bytes) {
  FrameHeader header;
  if (absl::Status s = ReadAll(fd, &header, sizeof(header), deadline, stop); !s.ok()) return s;
  if (header.magic != kMagic) return absl::DataLossError("not a tensor-parallel frame (another protocol?)");
  if (header.bytes > max_bytes) {
    return absl::DataLossError(absl::StrCat("a frame of ", header.bytes, " bytes, at most ", max_bytes, " expected"));
  }
  std::vector<std::byte> payload(header.bytes);
  if (absl::Status s = ReadAll(fd, payload.data(), payload.size(), deadline, stop); !s.ok()) return s;
  return std::make_pair(header, std::move(payload));
}

absl::Status WriteFrame(int fd, uint32_t op, std::span<const std::byte> payload, absl::Time deadline,
                        const std::atomic<bool>* stop) {
  const FrameHeader header{.magic = kMagic, .op = op, .bytes = payload.size()};
  if (absl::Status s = WriteAll(fd, &header, sizeof(header), deadline, stop); !s.ok()) return s;
  return WriteAll(fd, payload.data(), payload.size(), deadline, stop);
}

absl::Status CheckF32(absl::string_view op, const Tensor& t) {
  if (t.dtype() != DType::kF32) return absl::InvalidArgumentError(absl::StrCat(op, ": F32 tensors only"));
  return absl::OkStatus();
}

}  // namespace

TcpCommunicator::TcpCommunicator(TcpCommunicatorOptions options, uint64_t generation)
    : options_(std::move(options)), generation_(generation) {}

absl::StatusOr<std::unique_ptr<TcpCommunicator>> TcpCommunicator::Create(const TcpCommunicatorOptions& options,
                                                                         uint64_t generation) {
  if (options.rank != 0 || options.world_size < 1) {
    return absl::InvalidArgumentError("TcpCommunicator::Create is rank 0's, with a world size of at least 1");
  }
  absl::StatusOr<std::pair<std::string, std::string>> hp = SplitAddress(options.address);
  if (!hp.ok()) return absl::InvalidArgumentError(absl::StrCat("tensor-parallel control address ", hp.status().message()));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(hp->first.c_str(), hp->second.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor-parallel control address ", options.address, ": ",
                                                   gai_strerror(rc)));
  }
  absl::Cleanup free_found = [found] { freeaddrinfo(found); };
  auto comm = std::unique_ptr<TcpCommunicator>(new TcpCommunicator(options, generation));
  comm->peers_.resize(static_cast<size_t>(options.world_size));
  const int fd = socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, found->ai_protocol);
  if (fd < 0) return Errno("socket", errno);
  comm->listen_fd_ = fd;
  const int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, found->ai_addr, found->ai_addrlen) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for tensor-parallel ranks on ", options.address, ": ", std::strerror(errno)));
  }
  if (listen(fd, 64) != 0) return Errno("listen", errno);
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
    comm->port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                    : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    comm->options_.address = absl::StrCat(hp->first, ":", comm->port_);  // port 0: the one chosen
  }
  if (options.world_size == 1) comm->ready_ = true;
  return comm;
}

absl::StatusOr<std::unique_ptr<TcpCommunicator>> TcpCommunicator::Attach(
    const TcpCommunicatorOptions& options,
    const std::function<absl::Status(absl::string_view leader_identity)>& check_identity) {
  if (options.rank < 1 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", options.rank, " of world size ", options.world_size, " cannot join a group"));
  }
  absl::StatusOr<std::pair<std::string, std::string>> hp = SplitAddress(options.address);
  if (!hp.ok()) return absl::InvalidArgumentError(absl::StrCat("rank 0's address ", hp.status().message()));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(hp->first.c_str(), hp->second.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, ": ", gai_strerror(rc)));
  }
  absl::Cleanup free_found = [found] { freeaddrinfo(found); };
  auto comm = std::unique_ptr<TcpCommunicator>(new TcpCommunicator(options, 0));
  comm->peers_.push_back(std::make_unique<Peer>());
  const int fd = socket(found->ai_family, found->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, found->ai_protocol);
  if (fd < 0) return Errno("socket", errno);
  comm->peers_[0]->fd = fd;
  if (connect(fd, found->ai_addr, found->ai_addrlen) != 0 && errno != EINPROGRESS) {
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, ": ", std::strerror(errno)));
  }
  if (absl::Status s = PollFor(fd, POLLOUT, absl::Now() + kConnectWait, options.stop); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, ": connect: ", s.message()));
  }
  int error = 0;
  socklen_t len = sizeof(error);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0 || error != 0) {
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, ": ", std::strerror(error)));
  }
  SetSocketOptions(fd);
  char host[256] = {};
  (void)gethostname(host, sizeof(host) - 1);
  std::vector<std::byte> hello;
  PutU32(hello, static_cast<uint32_t>(options.rank));
  PutU32(hello, static_cast<uint32_t>(options.world_size));
  PutU32(hello, static_cast<uint32_t>(getpid()));
  PutString(hello, host);
  const absl::Time deadline = absl::Now() + kHandshakeWait;
  if (absl::Status s = WriteFrame(fd, static_cast<uint32_t>(Op::kHello), hello, deadline, options.stop); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, ": ", s.message()));
  }
  absl::StatusOr<std::pair<FrameHeader, std::vector<std::byte>>> answer =
      ReadFrame(fd, deadline, options.stop, kMaxReasonBytes);
  if (!answer.ok()) {
    // No answer: rank 0 is busy with a formed group (it takes no more ranks), or going away.
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, " did not take this rank (",
                                               answer.status().message(), "); its group may be formed already"));
  }
  const auto& [header, payload] = *answer;
  if (header.op == static_cast<uint32_t>(Op::kRefuse)) {
    return absl::FailedPreconditionError(StringFrom(payload, 0));
  }
  if (header.op != static_cast<uint32_t>(Op::kWelcome) || payload.size() < sizeof(uint64_t)) {
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, " answered with ", OpName(header.op)));
  }
  comm->generation_ = GetAt<uint64_t>(payload, 0);
  const std::string identity = StringFrom(payload, sizeof(uint64_t));
  if (absl::Status checked = check_identity(identity); !checked.ok()) {
    std::vector<std::byte> refusal;
    PutString(refusal, checked.message());
    (void)WriteFrame(fd, static_cast<uint32_t>(Op::kRefuse), refusal, absl::Now() + kHandshakeWait, options.stop);
    return absl::FailedPreconditionError(checked.message());
  }
  if (absl::Status s = WriteFrame(fd, static_cast<uint32_t>(Op::kAccept), {}, absl::Now() + kHandshakeWait,
                                  options.stop);
      !s.ok()) {
    return absl::UnavailableError(absl::StrCat("rank 0 at ", options.address, ": ", s.message()));
  }
  comm->ready_ = true;
  return comm;
}

TcpCommunicator::~TcpCommunicator() {
  Break(absl::StrCat("rank ", options_.rank, " left the group"));
  if (listen_fd_ >= 0) close(listen_fd_);
}

int TcpCommunicator::Fd(int rank) const {
  const Peer* peer = options_.rank == 0 ? peers_[static_cast<size_t>(rank)].get() : peers_[0].get();
  return peer == nullptr ? -1 : peer->fd;
}

absl::Status TcpCommunicator::BrokenStatus() const {
  std::lock_guard<std::mutex> lock(broken_mu_);
  return broken_;
}

void TcpCommunicator::Break(absl::string_view reason) { BreakWith(absl::UnavailableError(reason)); }

void TcpCommunicator::BreakWith(const absl::Status& status) {
  const absl::string_view reason = status.message();
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.ok()) return;
    broken_ = status;
  }
  std::vector<std::byte> payload;
  PutU32(payload, static_cast<uint32_t>(status.code()));
  PutString(payload, reason);
  for (const std::unique_ptr<Peer>& peer : peers_) {
    if (peer == nullptr || peer->fd < 0) continue;
    // Best effort, never blocking: a collective mid-send on this connection keeps it (the peer
    // then learns of the break from the closed connection instead).
    if (std::unique_lock<std::mutex> sending(peer->send_mu, std::try_to_lock); sending.owns_lock()) {
      const FrameHeader header{.magic = kMagic, .op = static_cast<uint32_t>(Op::kBreak), .bytes = payload.size()};
      if (send(peer->fd, &header, sizeof(header), MSG_NOSIGNAL | MSG_DONTWAIT) == sizeof(header)) {
        (void)send(peer->fd, payload.data(), payload.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
    // Wakes a thread polling this connection; the descriptor stays open until destruction.
    (void)shutdown(peer->fd, SHUT_RDWR);
  }
}

absl::Status TcpCommunicator::Fail(const absl::Status& status) {
  if (status.ok()) return status;
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.ok()) return broken_;
  }
  if (absl::IsCancelled(status)) return status;  // shutting down: the destructor says so to the peers
  // Keeps the code (DEADLINE_EXCEEDED, FAILED_PRECONDITION, UNAVAILABLE) for this rank and the peers.
  BreakWith(status);
  return BrokenStatus();
}

absl::Status TcpCommunicator::Send(int to, Op op, std::span<const std::byte> payload) {
  Peer* peer = options_.rank == 0 ? peers_[static_cast<size_t>(to)].get() : peers_[0].get();
  if (peer == nullptr || peer->fd < 0) return absl::UnavailableError(absl::StrCat("rank ", to, " left the group"));
  std::lock_guard<std::mutex> lock(peer->send_mu);
  absl::Status sent =
      WriteFrame(peer->fd, static_cast<uint32_t>(op), payload, DeadlineAfter(options_.timeout), options_.stop);
  if (absl::IsDeadlineExceeded(sent)) {
    return absl::DeadlineExceededError(absl::StrCat("rank ", to, " did not take ", OpName(static_cast<uint32_t>(op)),
                                                    " within ", absl::FormatDuration(options_.timeout)));
  }
  if (absl::IsUnavailable(sent)) {
    return absl::UnavailableError(absl::StrCat("rank ", to, " left the group (", sent.message(), ")"));
  }
  return sent;
}

absl::Status TcpCommunicator::Receive(int fd, int from, Op op, std::span<std::byte> out, absl::Duration wait) {
  FrameHeader header;
  absl::Status read = ReadAll(fd, &header, sizeof(header), DeadlineAfter(wait), options_.stop);
  if (absl::IsDeadlineExceeded(read)) {
    return absl::DeadlineExceededError(absl::StrCat("rank ", from, " did not arrive at ", OpName(static_cast<uint32_t>(op)),
                                                    " within ", absl::FormatDuration(wait)));
  }
  if (absl::IsUnavailable(read)) {
    return absl::UnavailableError(absl::StrCat("rank ", from, " left the group (", read.message(), ")"));
  }
  if (!read.ok()) return read;
  if (header.magic != kMagic) return absl::DataLossError(absl::StrCat("rank ", from, " sent a malformed frame"));
  if (header.op == static_cast<uint32_t>(Op::kBreak)) {
    std::vector<std::byte> payload(std::min(header.bytes, kMaxReasonBytes));
    (void)ReadAll(fd, payload.data(), payload.size(), DeadlineAfter(kHandshakeWait), options_.stop);
    const auto code = payload.size() >= 4 ? static_cast<absl::StatusCode>(GetAt<uint32_t>(payload, 0))
                                          : absl::StatusCode::kUnavailable;
    return absl::Status(code == absl::StatusCode::kOk ? absl::StatusCode::kUnavailable : code, StringFrom(payload, 4));
  }
  if (header.op != static_cast<uint32_t>(op) || header.bytes != out.size()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", from, " posted ", OpName(header.op), " of ",
                                                      header.bytes, " bytes; rank ", options_.rank, " ",
                                                      OpName(static_cast<uint32_t>(op)), " of ", out.size(), " bytes"));
  }
  absl::Status payload = ReadAll(fd, out.data(), out.size(), DeadlineAfter(options_.timeout), options_.stop);
  if (absl::IsUnavailable(payload)) {
    return absl::UnavailableError(absl::StrCat("rank ", from, " left the group (", payload.message(), ")"));
  }
  return payload;
}

void TcpCommunicator::Admit(int fd) {
  auto peer = std::make_unique<Peer>();
  peer->fd = fd;
  SetSocketOptions(fd);
  const absl::Time deadline = absl::Now() + kHandshakeWait;
  absl::StatusOr<std::pair<FrameHeader, std::vector<std::byte>>> hello = ReadFrame(fd, deadline, options_.stop, 4096);
  if (!hello.ok() || hello->first.op != static_cast<uint32_t>(Op::kHello) || hello->second.size() < 12) return;
  const std::span<const std::byte> h = hello->second;
  const uint32_t rank = GetAt<uint32_t>(h, 0);
  const uint32_t world = GetAt<uint32_t>(h, 4);
  peer->pid = GetAt<uint32_t>(h, 8);
  peer->host = StringFrom(h, 12);
  const std::string who = absl::StrCat("rank ", rank, " (", peer->host, " pid ", peer->pid, ")");
  std::string refusal;
  if (world != static_cast<uint32_t>(options_.world_size)) {
    refusal = absl::StrCat("world size mismatch: rank 0's group has world size ", options_.world_size, ", ", who,
                           " was started with world size ", world);
  } else if (rank < 1 || rank >= world) {
    refusal = absl::StrCat(who, " is not a rank of a group of ", world);
  } else if (const Peer* holder = peers_[rank].get(); holder != nullptr) {
    refusal = absl::StrCat("rank ", rank, " is held by ", holder->host, " pid ", holder->pid);
  }
  if (!refusal.empty()) {
    std::vector<std::byte> payload;
    PutString(payload, refusal);
    (void)WriteFrame(fd, static_cast<uint32_t>(Op::kRefuse), payload, deadline, options_.stop);
    refusals_.push_back(absl::StrCat(who, ": ", refusal));
    return;
  }
  std::vector<std::byte> welcome;
  PutU64(welcome, generation_);
  PutString(welcome, options_.identity);
  if (!WriteFrame(fd, static_cast<uint32_t>(Op::kWelcome), welcome, deadline, options_.stop).ok()) return;
  absl::StatusOr<std::pair<FrameHeader, std::vector<std::byte>>> answer =
      ReadFrame(fd, deadline, options_.stop, kMaxReasonBytes);
  if (!answer.ok()) return;
  if (answer->first.op == static_cast<uint32_t>(Op::kRefuse)) {
    refusals_.push_back(absl::StrCat(who, ": ", StringFrom(answer->second, 0)));
    return;
  }
  if (answer->first.op != static_cast<uint32_t>(Op::kAccept)) return;
  peers_[rank] = std::move(peer);
}

absl::Status TcpCommunicator::WaitForPeers(absl::Duration timeout) {
  if (options_.rank != 0) return absl::InvalidArgumentError("only rank 0 waits for the group to form");
  if (absl::Status broken = BrokenStatus(); !broken.ok()) return broken;
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    // A rank that died while the others joined frees its place.
    std::vector<int> missing;
    for (int r = 1; r < options_.world_size; ++r) {
      std::unique_ptr<Peer>& peer = peers_[static_cast<size_t>(r)];
      if (peer != nullptr) {
        pollfd p{.fd = peer->fd, .events = POLLRDHUP, .revents = 0};
        if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) peer.reset();
      }
      if (peer == nullptr) missing.push_back(r);
    }
    if (missing.empty()) {
      ready_ = true;
      return absl::OkStatus();
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("waiting for ranks ", absl::StrJoin(missing, ", "),
                                                      " to join rank 0 at ", options_.address));
    }
    absl::Status ready = PollFor(listen_fd_, POLLIN, std::min(deadline, absl::Now() + absl::Milliseconds(50)),
                                 options_.stop);
    if (absl::IsCancelled(ready)) return ready;
    if (!ready.ok()) continue;
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd >= 0) Admit(fd);
  }
}

std::vector<std::string> TcpCommunicator::TakeRefusals() { return std::exchange(refusals_, {}); }

absl::Status TcpCommunicator::PeersAlive() {
  if (absl::Status broken = BrokenStatus(); !broken.ok()) return broken;
  for (size_t i = 0; i < peers_.size(); ++i) {
    const Peer* peer = peers_[i].get();
    if (peer == nullptr || peer->fd < 0) continue;
    pollfd p{.fd = peer->fd, .events = POLLRDHUP, .revents = 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      const int rank = options_.rank == 0 ? static_cast<int>(i) : 0;
      Break(absl::StrCat("rank ", rank, " (", options_.rank == 0 ? peer->host : options_.address,
                         options_.rank == 0 ? absl::StrCat(" pid ", peer->pid) : "", ") left the group"));
      return BrokenStatus();
    }
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::AllReduceSum(Tensor& data) {
  if (absl::Status s = CheckF32("AllReduceSum", data); !s.ok()) return s;
  if (world_size() == 1) return absl::OkStatus();
  if (absl::Status broken = BrokenStatus(); !broken.ok()) return broken;
  float* d = data.data_as<float>();
  const int64_t n = data.NumElements();
  const int64_t per_part = std::max<int64_t>(1, static_cast<int64_t>(options_.part_bytes / sizeof(float)));
  std::vector<float> acc, in;
  for (int64_t off = 0; off < n; off += per_part) {
    const int64_t c = std::min(per_part, n - off);
    const auto part = std::as_writable_bytes(std::span<float>(d + off, static_cast<size_t>(c)));
    if (rank() != 0) {
      if (absl::Status s = Send(0, Op::kAllReduceSum, part); !s.ok()) return Fail(s);
      if (absl::Status s = Receive(Fd(0), 0, Op::kAllReduceSum, part, options_.timeout); !s.ok()) return Fail(s);
      continue;
    }
    // 0 + rank 0 + rank 1 + ... per element: CpuCommunicator's order, so the same bits.
    acc.assign(static_cast<size_t>(c), 0.0f);
    for (int64_t i = 0; i < c; ++i) acc[i] += d[off + i];
    in.resize(static_cast<size_t>(c));
    for (int r = 1; r < world_size(); ++r) {
      if (absl::Status s = Receive(Fd(r), r, Op::kAllReduceSum, std::as_writable_bytes(std::span<float>(in)),
                                   options_.timeout);
          !s.ok()) {
        return Fail(s);
      }
      for (int64_t i = 0; i < c; ++i) acc[i] += in[i];
    }
    std::copy(acc.begin(), acc.end(), d + off);
    for (int r = 1; r < world_size(); ++r) {
      if (absl::Status s = Send(r, Op::kAllReduceSum, part); !s.ok()) return Fail(s);
    }
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::AllGather(const Tensor& in, Tensor& out) {
  if (absl::Status s = CheckF32("AllGather", in); !s.ok()) return s;
  if (absl::Status s = CheckF32("AllGather", out); !s.ok()) return s;
  const int64_t n = in.NumElements();
  const int world = world_size();
  if (out.NumElements() != n * world) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllGather: out has ", out.NumElements(), " elements, want ", n * world));
  }
  const float* src = in.data_as<float>();
  float* dst = out.data_as<float>();
  std::copy(src, src + n, dst + static_cast<int64_t>(rank()) * n);
  if (world == 1) return absl::OkStatus();
  if (absl::Status broken = BrokenStatus(); !broken.ok()) return broken;
  const int64_t per_part = std::max<int64_t>(1, static_cast<int64_t>(options_.part_bytes / sizeof(float)));
  std::vector<float> gathered;
  for (int64_t off = 0; off < n; off += per_part) {
    const int64_t c = std::min(per_part, n - off);
    gathered.resize(static_cast<size_t>(c * world));
    const auto all = std::as_writable_bytes(std::span<float>(gathered));
    if (rank() != 0) {
      const auto mine = std::as_bytes(std::span<const float>(src + off, static_cast<size_t>(c)));
      if (absl::Status s = Send(0, Op::kAllGather, mine); !s.ok()) return Fail(s);
      if (absl::Status s = Receive(Fd(0), 0, Op::kAllGather, all, options_.timeout); !s.ok()) return Fail(s);
    } else {
      std::copy(src + off, src + off + c, gathered.begin());
      for (int r = 1; r < world; ++r) {
        const auto theirs = std::as_writable_bytes(std::span<float>(gathered.data() + r * c, static_cast<size_t>(c)));
        if (absl::Status s = Receive(Fd(r), r, Op::kAllGather, theirs, options_.timeout); !s.ok()) return Fail(s);
      }
      for (int r = 1; r < world; ++r) {
        if (absl::Status s = Send(r, Op::kAllGather, all); !s.ok()) return Fail(s);
      }
    }
    for (int r = 0; r < world; ++r) {
      std::copy(gathered.begin() + r * c, gathered.begin() + (r + 1) * c, dst + r * n + off);
    }
  }
  return absl::OkStatus();
}

absl::Status TcpCommunicator::Broadcast(Tensor& data, int root) {
  if (absl::Status s = CheckF32("Broadcast", data); !s.ok()) return s;
  return BroadcastBytes(std::span<std::byte>(static_cast<std::byte*>(data.data()),
                                             static_cast<size_t>(data.NumElements()) * sizeof(float)),
                        root, options_.timeout);
}

absl::Status TcpCommunicator::BroadcastBytes(std::span<std::byte> data, int root, absl::Duration first_wait) {
  if (root < 0 || root >= world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("Broadcast: root ", root, " out of range"));
  }
  if (world_size() == 1) return absl::OkStatus();
  if (absl::Status broken = BrokenStatus(); !broken.ok()) return broken;
  size_t off = 0;
  do {
    const size_t c = std::min(options_.part_bytes, data.size() - off);
    const std::span<std::byte> part = data.subspan(off, c);
    const absl::Duration wait = off == 0 ? first_wait : options_.timeout;
    if (rank() == 0) {
      if (root != 0) {
        if (absl::Status s = Receive(Fd(root), root, Op::kBroadcastBytes, part, wait); !s.ok()) return Fail(s);
      }
      for (int r = 1; r < world_size(); ++r) {
        if (r == root) continue;
        if (absl::Status s = Send(r, Op::kBroadcastBytes, part); !s.ok()) return Fail(s);
      }
    } else if (rank() == root) {
      if (absl::Status s = Send(0, Op::kBroadcastBytes, part); !s.ok()) return Fail(s);
    } else {
      if (absl::Status s = Receive(Fd(0), 0, Op::kBroadcastBytes, part, wait); !s.ok()) return Fail(s);
    }
    off += c;
  } while (off < data.size());
  return absl::OkStatus();
}

}  // namespace nq::kernels
