#include "tests/integration/child_process.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"

namespace nq::testing {

absl::StatusOr<ChildProcess> ChildProcess::Start(const std::string& binary,
                                                 const std::vector<std::string>& args,
                                                 const std::string& log_path) {
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0) return absl::InternalError(absl::StrCat("open ", log_path, ": ", std::strerror(errno)));
  std::vector<std::string> argv_storage = {binary};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& arg : argv_storage) argv.push_back(arg.data());
  argv.push_back(nullptr);

  const pid_t pid = fork();
  if (pid < 0) {
    close(log_fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // The test runner may block signals; the service must start with a clean mask.
    sigset_t empty;
    sigemptyset(&empty);
    sigprocmask(SIG_SETMASK, &empty, nullptr);
    dup2(log_fd, STDOUT_FILENO);
    dup2(log_fd, STDERR_FILENO);
    execv(binary.c_str(), argv.data());
    _exit(127);
  }
  close(log_fd);
  ChildProcess child;
  child.pid_ = pid;
  child.log_path_ = log_path;
  return child;
}

ChildProcess::ChildProcess(ChildProcess&& other) noexcept { *this = std::move(other); }

ChildProcess& ChildProcess::operator=(ChildProcess&& other) noexcept {
  pid_ = std::exchange(other.pid_, -1);
  exit_code_ = other.exit_code_;
  log_path_ = std::move(other.log_path_);
  return *this;
}

ChildProcess::~ChildProcess() {
  if (pid_ > 0 && Running()) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

bool ChildProcess::Running() {
  if (exit_code_.has_value()) return false;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == 0) return true;
  if (r == pid_) exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
  return false;
}

void ChildProcess::Signal(int signal_number) {
  if (Running()) kill(pid_, signal_number);
}

absl::StatusOr<int> ChildProcess::WaitForExit(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (Running()) {
    if (std::chrono::steady_clock::now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("pid ", pid_, " still running"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return *exit_code_;
}

std::string ChildProcess::Log() const {
  std::ifstream in(log_path_);
  std::stringstream content;
  content << in.rdbuf();
  return content.str();
}

int FreePort() {
  // Ports below Linux's ephemeral range (32768-60999), which the kernel never hands to outgoing
  // connections or to a bind of port 0; and each one claimed for this process's life by binding
  // an abstract Unix socket named after it, so test binaries running side by side (ctest -j)
  // never pick the same port. (Binding port 0 and closing it, as this did, let another test's
  // service take the same port a moment later: a router once answered 404 on another test's
  // metrics port.)
  static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(getpid()));
  for (int attempt = 0; attempt < 2000; ++attempt) {
    const int port = 20000 + static_cast<int>(rng() % 12000);
    const int claim = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (claim < 0) continue;
    sockaddr_un name{};
    name.sun_family = AF_UNIX;
    const std::string tag = absl::StrCat("nq-test-port-", port);
    std::memcpy(name.sun_path + 1, tag.data(), tag.size());  // sun_path[0] == 0: the abstract namespace
    const auto name_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + tag.size());
    if (bind(claim, reinterpret_cast<sockaddr*>(&name), name_len) != 0) {
      close(claim);  // another test process holds this port
      continue;
    }
    const int probe = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = probe >= 0 && bind(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (probe >= 0) close(probe);
    if (free) return port;  // `claim` stays open (and bound) until the process exits
    close(claim);
  }
  return 0;
}

}  // namespace nq::testing
