// A tensor-parallel group's control channel (group_control.h) over TCP, so its ranks may run on
// other hosts: rank 0 listens, every other rank connects to it. The shared-memory transport's
// contract, over a star of connections:
//
//   joining    rank r connects and says hello (rank, world size, host, pid); rank 0 refuses another
//              world size, a rank out of range or one a live connection holds, else answers with
//              its generation and identity, which the joining rank checks (check_identity) and
//              accepts or refuses; refusals reach rank 0's TakeRefusals. A connection that is
//              not a rank (another protocol) is dropped; one that says nothing holds admission
//              up to the handshake wait (5 s), then is dropped. Once every rank joined
//              the group is ready; rank 0 takes no more connections (a late rank gets no answer
//              and retries: UNAVAILABLE).
//   collectives every message is a frame (op, bytes, payload). A broadcast from rank 0 is one
//              frame to each rank; an all-reduce or all-gather sends each rank's part to rank 0,
//              which combines them in rank order (0 + rank 0 + rank 1 + ...: the bits of
//              CpuCommunicator and ShmCommunicator) and sends the result back; a broadcast from
//              rank r > 0 is relayed by rank 0. Large collectives go in parts of `part_bytes`.
//   failure    a connection that closes (a rank died or left) breaks the group; so does a frame of
//              another collective than the one a rank posted, and a wait past `timeout`. Break
//              sends its reason to the peers before closing, so every rank fails with it.
//
// Plain TCP: like the rest of the workers' control traffic it belongs on a private network (the
// model's tensors cross it in the clear on the CPU backend; on GPUs only step commands do).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "kernels/comm/group_control.h"

namespace nq::kernels {

struct TcpCommunicatorOptions {
  // Rank 0: the host:port it listens on ("0.0.0.0:PORT" for every address). Other ranks: rank 0's.
  std::string address;
  int rank = 0;
  int world_size = 1;
  // Bytes of one part of a large collective (bounds what rank 0 holds per rank at once).
  size_t part_bytes = size_t{4} << 20;
  // Longest wait for a peer within a collective: past it the group breaks (a peer is stuck).
  absl::Duration timeout = absl::Seconds(30);
  // Rank 0: its identity, which every joining rank checks.
  std::string identity;
  // Polled while waiting: true makes a wait return CANCELLED (shutdown).
  const std::atomic<bool>* stop = nullptr;
};

class TcpCommunicator final : public GroupControl {
 public:
  // Rank 0: listens on options.address (INVALID_ARGUMENT for a malformed one; the errno of
  // bind(2) otherwise, e.g. the port in use).
  static absl::StatusOr<std::unique_ptr<TcpCommunicator>> Create(const TcpCommunicatorOptions& options,
                                                                 uint64_t generation);
  // Rank > 0: joins rank 0's group. UNAVAILABLE while there is nothing to join (rank 0 not
  // listening, or its group already formed: retry); FAILED_PRECONDITION when this rank does not
  // belong (refused by rank 0, or `check_identity(rank 0's identity)` failing).
  static absl::StatusOr<std::unique_ptr<TcpCommunicator>> Attach(
      const TcpCommunicatorOptions& options,
      const std::function<absl::Status(absl::string_view leader_identity)>& check_identity);
  // Leaves the group: the peers learn it (a departed rank breaks the group).
  ~TcpCommunicator() override;

  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  uint64_t generation() const override { return generation_; }
  absl::Status AllReduceSum(Tensor& data) override;
  absl::Status AllGather(const Tensor& in, Tensor& out) override;
  absl::Status Broadcast(Tensor& data, int root) override;
  absl::Status BroadcastBytes(std::span<std::byte> data, int root, absl::Duration first_wait) override;
  absl::Status WaitForPeers(absl::Duration timeout) override;
  std::vector<std::string> TakeRefusals() override;
  absl::Status PeersAlive() override;
  void Break(absl::string_view reason) override;

  // Rank 0: the port it listens on (the one the OS chose for port 0).
  int port() const { return port_; }

 private:
  enum class Op : uint32_t;
  struct Peer;

  TcpCommunicator(TcpCommunicatorOptions options, uint64_t generation);
  // The connection to `rank` (rank 0: to that follower; a follower: to rank 0 whatever `rank`).
  int Fd(int rank) const;
  // Sends one frame to rank `to` (a follower: to rank 0); reads one from `fd` expecting `op` and
  // exactly out.size() bytes into `out`. Errors name the peer.
  absl::Status Send(int to, Op op, std::span<const std::byte> payload);
  absl::Status Receive(int fd, int from, Op op, std::span<std::byte> out, absl::Duration wait);
  // A failed send or receive: the group breaks with it (unless already broken), and the caller
  // gets the group's reason.
  absl::Status Fail(const absl::Status& status);
  absl::Status BrokenStatus() const;
  // Break with a status whose code every rank gets (the first break wins).
  void BreakWith(const absl::Status& status);
  // Rank 0: takes one connection's hello, and answers it.
  void Admit(int fd);

  TcpCommunicatorOptions options_;
  uint64_t generation_;
  int listen_fd_ = -1;
  int port_ = 0;
  // Rank 0: by rank (index 0 unused); a follower: [0] is rank 0.
  std::vector<std::unique_ptr<Peer>> peers_;
  bool ready_ = false;
  std::vector<std::string> refusals_;
  mutable std::mutex broken_mu_;
  absl::Status broken_;  // OK until the group breaks
};

}  // namespace nq::kernels
