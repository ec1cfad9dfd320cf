// Starting the real service binaries for end-to-end tests, with their output in a log file.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace nq::testing {

class ChildProcess {
 public:
  // Starts `binary` with `args`; stdout and stderr go to `log_path`.
  static absl::StatusOr<ChildProcess> Start(const std::string& binary, const std::vector<std::string>& args,
                                            const std::string& log_path);
  ChildProcess(ChildProcess&& other) noexcept;
  ChildProcess& operator=(ChildProcess&& other) noexcept;
  ~ChildProcess();  // SIGKILLs and reaps a child still running

  bool Running();
  void Signal(int signal_number);
  // The exit code, or -signal when killed by a signal; DEADLINE_EXCEEDED if still running.
  absl::StatusOr<int> WaitForExit(std::chrono::milliseconds timeout);
  std::string Log() const;
  pid_t pid() const { return pid_; }

 private:
  ChildProcess() = default;
  pid_t pid_ = -1;
  std::optional<int> exit_code_;
  std::string log_path_;
};

// A TCP port on 127.0.0.1, free when picked and never picked again by this or another test
// process while this one runs (0 when none was found).
int FreePort();

}  // namespace nq::testing
