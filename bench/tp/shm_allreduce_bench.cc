// All-reduce latency per call of the shared-memory transport (kernels/comm/shm_communicator.h)
// between real processes, the CPU backend's tensor-parallel path (issue #18's measurement rows).
//
// Forks W rank processes that form one group, then for each hidden size runs `warmup` untimed and
// `calls` timed AllReduceSum calls on a [hidden] F32 tensor (a decode step's activation: one
// token). Each rank times every call on its own clock; the table gives rank 0's median and p99
// and the largest median over the ranks. A call's time includes waiting for the slowest rank to
// arrive: here the ranks do nothing else between calls, so that is the transport's own cost.
//
//   shm_allreduce_bench [--world=2,4] [--hidden=256,6144,7168] [--calls=20000] [--warmup=2000]
//
// Only F32: the communicator's collectives take F32 tensors (a BF16 activation would travel as
// F32; its latency is the F32 row at the same element count).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "kernels/comm/shm_communicator.h"

namespace {

using nq::kernels::ShmCommunicator;
using nq::kernels::ShmCommunicatorOptions;

struct Args {
  std::vector<int> worlds = {2, 4};
  std::vector<int64_t> hidden = {256, 6144, 7168};  // glm5_nano, GLM-5, DeepSeek-V3
  int calls = 20000;
  int warmup = 2000;
};

bool ParseList(const char* text, std::vector<int64_t>& out) {
  out.clear();
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(part, &v) || v <= 0) return false;
    out.push_back(v);
  }
  return !out.empty();
}

bool ParseArgs(int argc, char** argv, Args& args) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      const size_t n = std::strlen(flag);
      return a.compare(0, n, flag) == 0 ? argv[i] + n : nullptr;
    };
    std::vector<int64_t> list;
    if (const char* v = value("--world=")) {
      if (!ParseList(v, list)) return false;
      args.worlds.assign(list.begin(), list.end());
    } else if (const char* v = value("--hidden=")) {
      if (!ParseList(v, args.hidden)) return false;
    } else if (const char* v = value("--calls=")) {
      if (!absl::SimpleAtoi(v, &args.calls) || args.calls <= 0) return false;
    } else if (const char* v = value("--warmup=")) {
      if (!absl::SimpleAtoi(v, &args.warmup) || args.warmup < 0) return false;
    } else {
      return false;
    }
  }
  return true;
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())));
  return v[i];
}

// One rank's medians and p99s per hidden size, in microseconds, written to `fd`.
struct RankResult {
  double median_us;
  double p99_us;
};

absl::StatusOr<std::unique_ptr<ShmCommunicator>> Join(const ShmCommunicatorOptions& options) {
  if (options.rank == 0) {
    auto comm = ShmCommunicator::Create(options, 1);
    if (!comm.ok()) return comm.status();
    if (absl::Status s = (*comm)->WaitForPeers(absl::Seconds(60)); !s.ok()) return s;
    return comm;
  }
  for (int i = 0; i < 20000; ++i) {
    auto comm = ShmCommunicator::Attach(options, [](absl::string_view) { return absl::OkStatus(); });
    if (comm.ok() || comm.status().code() != absl::StatusCode::kUnavailable) return comm;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return absl::DeadlineExceededError("rank 0 never formed the group");
}

// Runs one rank: joins, measures every size, writes one RankResult per size to `fd`.
int RunRank(const std::string& name, int rank, int world, const Args& args, int fd) {
  const ShmCommunicatorOptions options{.name = name, .rank = rank, .world_size = world,
                                       .timeout = absl::Seconds(60), .identity = "bench"};
  absl::StatusOr<std::unique_ptr<ShmCommunicator>> comm = Join(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, comm.status().ToString().c_str());
    return 1;
  }
  auto backend = nq::kernels::CreateBackend("cpu", {.cpu_threads = 1});
  if (!backend.ok()) return 2;
  for (int64_t hidden : args.hidden) {
    auto t = (*backend)->Allocate(nq::kernels::DType::kF32, nq::kernels::Shape{hidden});
    if (!t.ok()) return 3;
    std::vector<double> us;
    us.reserve(static_cast<size_t>(args.calls));
    for (int i = 0; i < args.warmup + args.calls; ++i) {
      // Values that stay finite however many sums run over them.
      std::fill(t->data_as<float>(), t->data_as<float>() + hidden, 1.0f / static_cast<float>(world));
      const auto start = std::chrono::steady_clock::now();
      if (absl::Status s = (*comm)->AllReduceSum(*t); !s.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, s.ToString().c_str());
        return 4;
      }
      const auto end = std::chrono::steady_clock::now();
      if (i >= args.warmup) us.push_back(std::chrono::duration<double, std::micro>(end - start).count());
    }
    const RankResult r{Percentile(us, 0.5), Percentile(us, 0.99)};
    if (write(fd, &r, sizeof(r)) != static_cast<ssize_t>(sizeof(r))) return 5;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, args)) {
    std::fprintf(stderr,
                 "usage: %s [--world=2,4] [--hidden=256,6144,7168] [--calls=20000] [--warmup=2000]\n", argv[0]);
    return 2;
  }
  std::printf("# shared-memory all-reduce, F32, one [hidden] row per call; %u hardware threads\n",
              std::thread::hardware_concurrency());
  std::printf("%-6s %-8s %-8s %-12s %-12s %-18s\n", "W", "hidden", "calls", "median_us", "p99_us",
              "max_rank_median_us");
  for (int world : args.worlds) {
    const std::string name = absl::StrCat("/nq-tp-bench-", getpid(), "-", world);
    std::vector<pid_t> pids;
    std::vector<int> fds;
    std::fflush(stdout);  // else every child inherits, and prints, what is buffered
    for (int r = 0; r < world; ++r) {
      int p[2];
      if (pipe(p) != 0) return 1;
      const pid_t pid = fork();
      if (pid == 0) {
        close(p[0]);
        _exit(RunRank(name, r, world, args, p[1]));
      }
      close(p[1]);
      pids.push_back(pid);
      fds.push_back(p[0]);
    }
    std::vector<std::vector<RankResult>> results(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      RankResult one;
      while (read(fds[r], &one, sizeof(one)) == static_cast<ssize_t>(sizeof(one))) results[r].push_back(one);
      close(fds[r]);
    }
    int failed = 0;
    for (pid_t pid : pids) {
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
    }
    if (failed > 0) {
      std::fprintf(stderr, "W=%d: %d rank(s) failed\n", world, failed);
      return 1;
    }
    for (size_t h = 0; h < args.hidden.size(); ++h) {
      double worst = 0;
      for (const auto& rank : results) worst = std::max(worst, rank[h].median_us);
      std::printf("%-6d %-8ld %-8d %-12.2f %-12.2f %-18.2f\n", world, static_cast<long>(args.hidden[h]), args.calls,
                  results[0][h].median_us, results[0][h].p99_us, worst);
      std::fflush(stdout);
    }
  }
  return 0;
}
