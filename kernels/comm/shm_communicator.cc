#include "kernels/comm/shm_communicator.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <future>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"

namespace nq::kernels {
namespace {

// Spins (yielding) this many times before sleeping on the futex: a peer usually arrives within
// microseconds of the others, and a futex round trip costs tens of them.
constexpr int kSpinsBeforeSleep = 64;
// Longest single futex sleep: peers' liveness and the stop flag are re-checked this often.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(20);
constexpr absl::Duration kJoinPoll = absl::Milliseconds(10);
// A rank slot's alive lock found held is re-tried this often before the holder counts as a live
// process: rank 0 holds a dead rank's lock for the microseconds it takes to free its slot.
constexpr int kBusyRetries = 20;
constexpr auto kBusyRetryPause = std::chrono::milliseconds(1);

absl::Status Errno(absl::string_view what, int err) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  return err == ENOENT ? absl::NotFoundError(message) : absl::InternalError(message);
}

absl::Status CheckF32(const char* op, const Tensor& t) {
  if (!t.valid() || t.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": want an F32 tensor, got ", t.DebugString()));
  }
  return absl::OkStatus();
}

void CopyText(char (&dst)[shm::kTextBytes], absl::string_view text) {
  const size_t n = std::min(text.size(), shm::kTextBytes - 1);
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

std::string ReadText(const char (&src)[shm::kTextBytes]) { return std::string(src, strnlen(src, shm::kTextBytes)); }

uint32_t* FutexWord(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

void FutexWakeAll(std::atomic<uint32_t>& word) {
  // Cannot fail on a valid mapped address; a failure would only delay waiters to their slice.
  syscall(SYS_futex, FutexWord(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

absl::Status FutexWait(std::atomic<uint32_t>& word, uint32_t expected, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  if (syscall(SYS_futex, FutexWord(word), FUTEX_WAIT, expected, &ts, nullptr, 0) == 0) return absl::OkStatus();
  if (errno == EAGAIN || errno == ETIMEDOUT || errno == EINTR) return absl::OkStatus();
  return Errno("futex wait", errno);
}

absl::Status CheckOptions(const ShmCommunicatorOptions& o) {
  if (o.name.size() < 2 || o.name[0] != '/' || o.name.find('/', 1) != std::string::npos || o.name.size() > 200) {
    return absl::InvalidArgumentError(absl::StrCat("shm group name '", o.name, "': want '/name' without other '/'"));
  }
  if (o.world_size < 1 || o.world_size > shm::kMaxWorld || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", o.rank, " of world size ", o.world_size,
                                                   ": want 0 <= rank < world size <= ", shm::kMaxWorld));
  }
  if (o.round_bytes == 0 || o.round_bytes % 64 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("round_bytes ", o.round_bytes, ": want a positive multiple of 64"));
  }
  if (o.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("the collective timeout must be positive");
  return absl::OkStatus();
}

// Writes why a process refused to join as `rank` where rank 0 will find it (best effort: two
// processes refusing as the same rank at once may interleave their texts).
void WriteRefusal(shm::Header& h, int rank, absl::string_view why) {
  if (rank < 0 || rank >= shm::kMaxWorld) return;
  CopyText(h.ranks[rank].refusal, absl::StrCat("pid ", getpid(), ": ", why));
  h.ranks[rank].refusal_seq.fetch_add(1, std::memory_order_release);
}

}  // namespace

ShmCommunicator::ShmCommunicator(ShmCommunicatorOptions options, int fd, void* base, size_t bytes)
    : options_(std::move(options)), fd_(fd), base_(base), bytes_(bytes), refusal_seen_(shm::kMaxWorld, 0) {}

ShmCommunicator::~ShmCommunicator() {
  const bool joined = alive_thread_.joinable();
  if (joined) {
    shm::RankSlot& slot = header().ranks[rank()];
    if (rank() == 0) {
      Break("rank 0 closed the group");
    } else if (header().state.load(std::memory_order_acquire) == shm::kForming) {
      slot.pid.store(0, std::memory_order_relaxed);
      slot.state.store(shm::kSlotEmpty, std::memory_order_release);  // may join again
    } else {
      slot.state.store(shm::kSlotLeft, std::memory_order_release);
      Break(absl::StrCat("rank ", rank(), " (pid ", getpid(), ") left the group"));
    }
    {
      std::lock_guard<std::mutex> lock(release_mu_);
      release_alive_ = true;
    }
    release_cv_.notify_all();
    alive_thread_.join();
  }
  // Destructors report nothing; munmap/close cannot leave the peers in a worse state.
  if (base_ != nullptr) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
  if (owns_name_) shm_unlink(options_.name.c_str());
}

std::byte* ShmCommunicator::Area(int parity, int r) const {
  return static_cast<std::byte*>(base_) + shm::kDataOffset +
         (static_cast<size_t>(parity) * static_cast<size_t>(world_size()) + static_cast<size_t>(r)) *
             options_.round_bytes;
}

uint64_t ShmCommunicator::generation() const { return header().generation; }

absl::Status ShmCommunicator::HoldAliveLock() {
  // Shared: the thread may still be inside set_value when this function returns.
  auto locked = std::make_shared<std::promise<absl::Status>>();
  std::future<absl::Status> result = locked->get_future();
  pthread_mutex_t* mutex = &header().ranks[rank()].alive;
  std::atomic<int32_t>* pid = &header().ranks[rank()].pid;
  alive_thread_ = std::thread([this, mutex, pid, locked] {
    int rc = pthread_mutex_trylock(mutex);
    // Held: by a live process of this rank, or by rank 0 for the moment it frees the slot of one
    // that died (PeersAlive clears the pid under the lock). A restart must not be refused as a
    // duplicate then: it is told to retry.
    for (int tries = 0; rc == EBUSY && tries < kBusyRetries && pid->load(std::memory_order_acquire) != 0; ++tries) {
      std::this_thread::sleep_for(kBusyRetryPause);
      rc = pthread_mutex_trylock(mutex);
    }
    // A process that held this rank before died: its lock is ours now.
    if (rc == EOWNERDEAD) rc = pthread_mutex_consistent(mutex);
    if (rc != 0) {
      const int32_t holder = pid->load(std::memory_order_acquire);
      locked->set_value(rc != EBUSY  ? Errno("locking the rank's alive lock", rc)
                        : holder == 0 ? absl::UnavailableError(absl::StrCat(
                                            "rank ", rank(), "'s slot is being freed after its process died; retry"))
                                      : absl::FailedPreconditionError(absl::StrCat(
                                            "rank ", rank(), " is already held by a live process (pid ", holder, ")")));
      return;
    }
    locked->set_value(absl::OkStatus());
    std::unique_lock<std::mutex> lock(release_mu_);
    release_cv_.wait(lock, [this] { return release_alive_; });
    pthread_mutex_unlock(mutex);
  });
  absl::Status status = result.get();
  if (!status.ok()) alive_thread_.join();
  return status;
}

absl::StatusOr<std::unique_ptr<ShmCommunicator>> ShmCommunicator::Create(const ShmCommunicatorOptions& options,
                                                                         uint64_t generation) {
  RETURN_IF_ERROR(CheckOptions(options));
  if (options.rank != 0) return absl::InvalidArgumentError("only rank 0 creates the group");
  if (shm_unlink(options.name.c_str()) != 0 && errno != ENOENT) {
    return Errno(absl::StrCat("shm_unlink(", options.name, ")"), errno);
  }
  const int fd = shm_open(options.name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return Errno(absl::StrCat("shm_open(", options.name, ")"), errno);
  const size_t bytes = shm::SegmentBytes(options.world_size, options.round_bytes);
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    shm_unlink(options.name.c_str());
    return Errno("ftruncate", err);
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    shm_unlink(options.name.c_str());
    return Errno("mmap", err);
  }
  auto comm = std::unique_ptr<ShmCommunicator>(new ShmCommunicator(options, fd, base, bytes));
  comm->owns_name_ = true;
  // The object is zero-filled: every atomic starts at 0 (kForming, kSlotEmpty). The mutexes
  // need their attributes.
  shm::Header& h = *new (base) shm::Header();
  pthread_mutexattr_t attr;
  if (int rc = pthread_mutexattr_init(&attr); rc != 0) return Errno("pthread_mutexattr_init", rc);
  int rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  if (rc == 0) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  for (int r = 0; rc == 0 && r < shm::kMaxWorld; ++r) rc = pthread_mutex_init(&h.ranks[r].alive, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) return Errno("initialising the rank locks", rc);
  h.layout_version = shm::kLayoutVersion;
  h.world_size = static_cast<uint32_t>(options.world_size);
  h.generation = generation;
  h.round_bytes = options.round_bytes;
  CopyText(h.identity, options.identity);
  RETURN_IF_ERROR(comm->HoldAliveLock());
  h.ranks[0].pid.store(getpid(), std::memory_order_relaxed);
  h.ranks[0].state.store(shm::kSlotJoined, std::memory_order_relaxed);
  h.magic.store(shm::kMagic, std::memory_order_release);
  if (options.world_size == 1) h.state.store(shm::kReady, std::memory_order_release);
  return comm;
}

absl::StatusOr<std::unique_ptr<ShmCommunicator>> ShmCommunicator::Attach(
    const ShmCommunicatorOptions& options,
    const std::function<absl::Status(absl::string_view leader_identity)>& check_identity) {
  RETURN_IF_ERROR(CheckOptions(options));
  if (options.rank == 0) return absl::InvalidArgumentError("rank 0 creates the group; it does not attach");
  const int fd = shm_open(options.name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    if (errno == ENOENT) return absl::UnavailableError(absl::StrCat("no group ", options.name, " yet"));
    return Errno(absl::StrCat("shm_open(", options.name, ")"), errno);
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return Errno("fstat", err);
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes < shm::kDataOffset) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("group ", options.name, " is being created"));
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return Errno("mmap", err);
  }
  // From here the destructor unmaps; it leaves the group only once the alive lock is held.
  auto comm = std::unique_ptr<ShmCommunicator>(new ShmCommunicator(options, fd, base, bytes));
  shm::Header& h = comm->header();
  if (h.magic.load(std::memory_order_acquire) != shm::kMagic) {
    return absl::UnavailableError(absl::StrCat("group ", options.name, " is being created"));
  }
  auto refuse = [&](std::string why) {
    WriteRefusal(h, options.rank, why);
    return absl::FailedPreconditionError(why);
  };
  if (h.layout_version != shm::kLayoutVersion) {
    return refuse(absl::StrCat("group ", options.name, " uses shared-memory layout ", h.layout_version,
                               ", this process layout ", shm::kLayoutVersion, " (another nq-worker build)"));
  }
  if (static_cast<int>(h.world_size) != options.world_size) {
    return refuse(absl::StrCat("world size mismatch: rank 0 formed group ", options.name, " with world size ",
                               h.world_size, ", this rank was started with world size ", options.world_size));
  }
  if (bytes != shm::SegmentBytes(options.world_size, h.round_bytes)) {
    return absl::UnavailableError(absl::StrCat("group ", options.name, " is being created"));
  }
  comm->options_.round_bytes = h.round_bytes;
  // Rank 0 must be alive: a segment left by a dead rank 0 is waiting to be replaced.
  pthread_mutex_t* leader = &h.ranks[0].alive;
  if (int rc = pthread_mutex_trylock(leader); rc != EBUSY) {
    if (rc == EOWNERDEAD) pthread_mutex_consistent(leader);
    if (rc == 0 || rc == EOWNERDEAD) pthread_mutex_unlock(leader);
    return absl::UnavailableError(absl::StrCat("rank 0 of group ", options.name, " is gone"));
  }
  if (const uint32_t state = h.state.load(std::memory_order_acquire); state != shm::kForming) {
    return absl::UnavailableError(absl::StrCat("group ", options.name, " (generation ", h.generation, ") is ",
                                               state == shm::kReady ? "already formed" : "broken",
                                               "; waiting for rank 0 to form a new one"));
  }
  if (absl::Status s = check_identity(ReadText(h.identity)); !s.ok()) return refuse(std::string(s.message()));
  if (absl::Status s = comm->HoldAliveLock(); !s.ok()) {
    if (s.code() == absl::StatusCode::kFailedPrecondition) return refuse(std::string(s.message()));
    return s;
  }
  shm::RankSlot& slot = h.ranks[options.rank];
  slot.pid.store(getpid(), std::memory_order_relaxed);
  slot.round.store(0, std::memory_order_relaxed);
  slot.state.store(shm::kSlotJoined, std::memory_order_release);
  return comm;
}

void ShmCommunicator::Break(absl::string_view reason) {
  shm::Header& h = header();
  uint32_t expected = 0;
  if (h.broken_once.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
    CopyText(h.broken_reason, reason);
    h.state.store(shm::kBroken, std::memory_order_release);
  }
  FutexWakeAll(h.arrived);
}

absl::Status ShmCommunicator::BrokenStatus() const {
  const shm::Header& h = header();
  if (h.state.load(std::memory_order_acquire) != shm::kBroken) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("tensor-parallel group broken: ", ReadText(h.broken_reason)));
}

absl::Status ShmCommunicator::PeersAlive() {
  RETURN_IF_ERROR(BrokenStatus());
  shm::Header& h = header();
  const bool forming = h.state.load(std::memory_order_acquire) == shm::kForming;
  for (int r = 0; r < world_size(); ++r) {
    if (r == rank()) continue;
    // While the group forms, rank 0 admits and frees the others; they watch rank 0 only.
    if (forming && rank() != 0 && r != 0) continue;
    shm::RankSlot& slot = h.ranks[r];
    const uint32_t state = slot.state.load(std::memory_order_acquire);
    if (state == shm::kSlotEmpty && forming) continue;  // not joined yet
    const int32_t pid = slot.pid.load(std::memory_order_relaxed);
    // While the group forms, rank 0 frees the slot of a rank that joined and died, for its restart.
    // Under the slot's alive lock when it can take it: a restart writes its slot only once it holds
    // that lock, so the two writes never interleave (freeing after the unlock could overwrite a
    // restart that joined in between, leaving it joined to a group that waits for it).
    const bool free_slot = forming && rank() == 0;
    auto free_the_slot = [&] {
      slot.pid.store(0, std::memory_order_release);
      slot.state.store(shm::kSlotEmpty, std::memory_order_release);
    };
    std::string gone;
    if (state == shm::kSlotLeft) {
      gone = "left the group";
      if (free_slot) {
        const int rc = pthread_mutex_trylock(&slot.alive);
        if (rc == EBUSY) continue;  // a restart holds it and is joining
        if (rc == EOWNERDEAD) pthread_mutex_consistent(&slot.alive);
        free_the_slot();
        if (rc == 0 || rc == EOWNERDEAD) pthread_mutex_unlock(&slot.alive);
      }
    } else {
      int rc = pthread_mutex_trylock(&slot.alive);
      if (rc == EBUSY) continue;  // held: the rank lives
      if (rc == EOWNERDEAD) {
        pthread_mutex_consistent(&slot.alive);
        if (free_slot) free_the_slot();
        pthread_mutex_unlock(&slot.alive);
        gone = "died";
      } else if (rc == 0) {
        if (free_slot) free_the_slot();
        pthread_mutex_unlock(&slot.alive);
        gone = state == shm::kSlotJoined ? "died" : "left the group";
      } else if (rc == ENOTRECOVERABLE) {
        if (free_slot) free_the_slot();
        gone = "died";
      } else {
        return Errno("checking a peer's alive lock", rc);
      }
    }
    if (free_slot) continue;
    const std::string reason = absl::StrCat("rank ", r, " (pid ", pid, ") ", gone);
    Break(reason);
    return BrokenStatus();
  }
  return absl::OkStatus();
}

std::vector<std::string> ShmCommunicator::TakeRefusals() {
  std::vector<std::string> out;
  shm::Header& h = header();
  for (int r = 0; r < shm::kMaxWorld; ++r) {
    const uint32_t seq = h.ranks[r].refusal_seq.load(std::memory_order_acquire);
    if (seq == refusal_seen_[r]) continue;
    refusal_seen_[r] = seq;
    out.push_back(absl::StrCat("rank ", r, " (", ReadText(h.ranks[r].refusal), ")"));
  }
  return out;
}

absl::Status ShmCommunicator::WaitForPeers(absl::Duration timeout) {
  if (rank() != 0) return absl::InvalidArgumentError("only rank 0 waits for its peers");
  shm::Header& h = header();
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    RETURN_IF_ERROR(PeersAlive());
    std::vector<int> missing;
    for (int r = 1; r < world_size(); ++r) {
      if (h.ranks[r].state.load(std::memory_order_acquire) != shm::kSlotJoined) missing.push_back(r);
    }
    if (missing.empty()) {
      h.state.store(shm::kReady, std::memory_order_release);
      return absl::OkStatus();
    }
    if (options_.stop != nullptr && options_.stop->load()) return absl::CancelledError("stopping");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("rank(s) ", absl::StrJoin(missing, ", "), " of ", world_size(),
                                                      " have not joined group ", options_.name));
    }
    absl::SleepFor(kJoinPoll);
  }
}

std::string ShmCommunicator::MissingRanks(uint64_t round) const {
  std::vector<int> missing;
  for (int r = 0; r < world_size(); ++r) {
    if (header().ranks[r].round.load(std::memory_order_relaxed) < round) missing.push_back(r);
  }
  return absl::StrJoin(missing, ", ");
}

absl::Status ShmCommunicator::WaitArrived(uint32_t target, absl::Duration wait) {
  shm::Header& h = header();
  const absl::Time deadline = wait == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + wait;
  for (int spin = 0;; ++spin) {
    const uint32_t seen = h.arrived.load(std::memory_order_acquire);
    // Arrivals wrap; ranks are never more than a round apart, so the signed distance is exact.
    if (static_cast<int32_t>(seen - target) >= 0) return absl::OkStatus();
    RETURN_IF_ERROR(BrokenStatus());
    if (spin < kSpinsBeforeSleep) {
      std::this_thread::yield();
      continue;
    }
    RETURN_IF_ERROR(PeersAlive());
    if (options_.stop != nullptr && options_.stop->load()) return absl::CancelledError("stopping");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      const std::string reason =
          absl::StrCat("collective round ", rounds_, ": rank(s) ", MissingRanks(rounds_), " did not arrive within ",
                       absl::FormatDuration(wait));
      Break(reason);
      return absl::DeadlineExceededError(reason);
    }
    RETURN_IF_ERROR(FutexWait(h.arrived, seen, std::min(kWaitSlice, deadline - now)));
  }
}

absl::StatusOr<int> ShmCommunicator::Round(Op op, const void* in, size_t bytes, absl::Duration wait) {
  // A follower may post its first round while rank 0 is still marking the group ready: rank 0
  // itself starts rounds only once it is, so the arrivals still pair up.
  RETURN_IF_ERROR(BrokenStatus());
  if (bytes > options_.round_bytes) {
    return absl::InternalError(absl::StrCat("a round of ", bytes, " bytes; areas hold ", options_.round_bytes));
  }
  shm::Header& h = header();
  const int parity = static_cast<int>(rounds_ % shm::kParities);
  if (in != nullptr && bytes > 0) std::memcpy(Area(parity, rank()), in, bytes);
  shm::Post& mine = h.posts[parity][rank()];
  mine.op.store(static_cast<uint32_t>(op), std::memory_order_relaxed);
  mine.bytes.store(bytes, std::memory_order_relaxed);
  ++rounds_;
  h.ranks[rank()].round.store(rounds_, std::memory_order_relaxed);
  const uint32_t target = static_cast<uint32_t>(rounds_ * static_cast<uint64_t>(world_size()));
  // acq_rel: publishes this rank's area and post, and (as the last arrival) acquires theirs.
  if (h.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == target) {
    FutexWakeAll(h.arrived);
  } else {
    RETURN_IF_ERROR(WaitArrived(target, wait));
  }
  for (int r = 0; r < world_size(); ++r) {
    const shm::Post& post = h.posts[parity][r];
    const uint32_t their_op = post.op.load(std::memory_order_relaxed);
    const uint64_t their_bytes = post.bytes.load(std::memory_order_relaxed);
    if (their_op != static_cast<uint32_t>(op) || their_bytes != bytes) {
      const std::string reason = absl::StrCat("collective round ", rounds_, ": rank ", r, " posted op ", their_op,
                                              " of ", their_bytes, " bytes, rank ", rank(), " op ",
                                              static_cast<uint32_t>(op), " of ", bytes, " bytes");
      Break(reason);
      return absl::FailedPreconditionError(reason);
    }
  }
  return parity;
}

absl::Status ShmCommunicator::AllReduceSum(Tensor& data) {
  RETURN_IF_ERROR(CheckF32("AllReduceSum", data));
  if (world_size() == 1) return absl::OkStatus();
  float* d = data.data_as<float>();
  const int64_t n = data.NumElements();
  const int64_t per_round = static_cast<int64_t>(options_.round_bytes / sizeof(float));
  for (int64_t off = 0; off < n; off += per_round) {
    const int64_t c = std::min(per_round, n - off);
    ASSIGN_OR_RETURN(const int parity,
                     Round(Op::kAllReduceSum, d + off, static_cast<size_t>(c) * sizeof(float), options_.timeout));
    // 0 + rank 0 + rank 1 + ... per element: CpuCommunicator's order, so the same bits.
    float* out = d + off;
    std::fill(out, out + c, 0.0f);
    for (int r = 0; r < world_size(); ++r) {
      const float* in = reinterpret_cast<const float*>(Area(parity, r));
      for (int64_t i = 0; i < c; ++i) out[i] += in[i];
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::AllGather(const Tensor& in, Tensor& out) {
  RETURN_IF_ERROR(CheckF32("AllGather", in));
  RETURN_IF_ERROR(CheckF32("AllGather", out));
  const int64_t n = in.NumElements();
  if (out.NumElements() != n * world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllGather: out has ", out.NumElements(), " elements, want ", n * world_size()));
  }
  const float* src = in.data_as<float>();
  float* dst = out.data_as<float>();
  if (world_size() == 1) {
    std::copy(src, src + n, dst);
    return absl::OkStatus();
  }
  const int64_t per_round = static_cast<int64_t>(options_.round_bytes / sizeof(float));
  for (int64_t off = 0; off < n; off += per_round) {
    const int64_t c = std::min(per_round, n - off);
    ASSIGN_OR_RETURN(const int parity,
                     Round(Op::kAllGather, src + off, static_cast<size_t>(c) * sizeof(float), options_.timeout));
    for (int r = 0; r < world_size(); ++r) {
      std::memcpy(dst + r * n + off, Area(parity, r), static_cast<size_t>(c) * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status ShmCommunicator::Broadcast(Tensor& data, int root) {
  RETURN_IF_ERROR(CheckF32("Broadcast", data));
  return BroadcastBytes(std::span<std::byte>(static_cast<std::byte*>(data.data()),
                                             static_cast<size_t>(data.NumElements()) * sizeof(float)),
                        root, options_.timeout);
}

absl::Status ShmCommunicator::BroadcastBytes(std::span<std::byte> data, int root, absl::Duration first_wait) {
  if (root < 0 || root >= world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("Broadcast: root ", root, " out of range"));
  }
  if (world_size() == 1) return absl::OkStatus();
  const size_t per_round = options_.round_bytes;
  size_t off = 0;
  do {
    const size_t c = std::min(per_round, data.size() - off);
    ASSIGN_OR_RETURN(const int parity, Round(Op::kBroadcastBytes, rank() == root ? data.data() + off : nullptr, c,
                                             off == 0 ? first_wait : options_.timeout));
    if (rank() != root && c > 0) std::memcpy(data.data() + off, Area(parity, root), c);
    off += c;
  } while (off < data.size());
  return absl::OkStatus();
}

}  // namespace nq::kernels
