// Starts nq-streamer, nq-worker and nq-router on loopback ports for end-to-end tests.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "grpc/health/v1/health.pb.h"
#include "tests/integration/child_process.h"

namespace nq::testing {

struct ServicePorts {
  int grpc = 0;
  int http = 0;  // /metrics and /health (the router's API port)
};

struct HttpReply {
  int status = 0;  // 0 when no connection
  std::string body;
};

// grpc.health.v1 Check of the whole server; nullopt when the call fails.
std::optional<grpc::health::v1::HealthCheckResponse::ServingStatus> GrpcHealth(int port);
HttpReply HttpGet(int port, const std::string& path);
// Polls `condition` every 50 ms until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& condition, std::chrono::milliseconds timeout);
// Runs the real `promtool check metrics` on `exposition`; returns its output, or an error
// carrying the output when promtool rejects it or is missing.
absl::StatusOr<std::string> PromtoolCheck(const std::string& exposition);

class ClusterTest : public ::testing::Test {
 protected:
  ClusterTest();

  ChildProcess StartStreamer(const ServicePorts& ports, std::vector<std::string> extra = {});
  ChildProcess StartWorker(const ServicePorts& ports, int streamer_grpc_port,
                           std::vector<std::string> extra = {});
  ChildProcess StartRouter(const ServicePorts& ports, int worker_grpc_port,
                           std::vector<std::string> extra = {});
  static ServicePorts NewPorts();
  // Waits for a service that must refuse to start: it exits with a non-zero code (not a crash)
  // within `timeout`. Returns its log, for the test to check the reason.
  static std::string ExpectStartupFailure(ChildProcess child,
                                          std::chrono::seconds timeout = std::chrono::seconds(15));
  // Waits until the service's gRPC health is SERVING.
  static bool WaitServing(int grpc_port, std::chrono::milliseconds timeout = std::chrono::seconds(20));
  std::string LogPath(const std::string& name);

  std::string log_dir_;
  int log_counter_ = 0;
};

}  // namespace nq::testing
