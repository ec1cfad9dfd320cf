// Runs a shell command line for tests of command-line tools: its exit code and its stdout and
// stderr interleaved.
#pragma once

#include <sys/wait.h>

#include <cstdio>
#include <string>

namespace nq::testing {

struct CommandResult {
  int exit_code = -1;  // -1: not run, or killed by a signal
  std::string output;  // stdout and stderr interleaved
};

inline CommandResult RunShell(const std::string& command) {
  CommandResult result;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[4096];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.output.append(buffer, n);
  const int status = pclose(pipe);
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

}  // namespace nq::testing
