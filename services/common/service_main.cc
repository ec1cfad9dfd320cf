#include "services/common/service_main.h"

#include <cstdio>
#include <string>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "services/common/logging.h"

ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");

namespace nq {

int ServiceMain(int argc, char** argv, std::string_view service, const char* usage,
                absl::FunctionRef<absl::Status(ShutdownSignal&)> run) {
  const std::string binary = "nq-" + std::string(service);
  if (absl::Status s = ShutdownSignal::BlockTerminationSignals(); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", binary.c_str(), s.ToString().c_str());
    return 1;
  }
  absl::SetProgramUsageMessage(usage);
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = InitLogging(service, absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", binary.c_str(), s.ToString().c_str());
    return 2;
  }
  ShutdownSignal shutdown;
  if (absl::Status s = run(shutdown); !s.ok()) {
    spdlog::critical("{} failed: {}", binary, s.ToString());
    return 1;
  }
  return 0;
}

}  // namespace nq
