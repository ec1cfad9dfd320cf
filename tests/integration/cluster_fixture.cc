#include "tests/integration/cluster_fixture.h"

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <httplib.h>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace nq::testing {

std::optional<grpc::health::v1::HealthCheckResponse::ServingStatus> GrpcHealth(int port) {
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(500));
  grpc::health::v1::HealthCheckResponse response;
  if (!stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response).ok()) return std::nullopt;
  return response.status();
}

HttpReply HttpGet(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(std::chrono::seconds(1));
  client.set_read_timeout(std::chrono::seconds(5));
  httplib::Result result = client.Get(path.c_str());
  if (!result) return HttpReply{};
  return HttpReply{result->status, result->body};
}

bool WaitFor(const std::function<bool()>& condition, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return condition();
}

absl::StatusOr<std::string> PromtoolCheck(const std::string& exposition) {
  char path[] = "/tmp/nq-metrics-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return absl::InternalError("mkstemp failed");
  close(fd);
  std::ofstream(path) << exposition;
  const std::string command = absl::StrCat("promtool check metrics < ", path, " 2>&1");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("popen failed");
  std::string output;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) output.append(buffer, n);
  const int status = pclose(pipe);
  std::filesystem::remove(path);
  if (!WIFEXITED(status) || WEXITSTATUS(status) == 127) {
    return absl::FailedPreconditionError("promtool is not installed (scripts/setup.sh installs it): " + output);
  }
  if (WEXITSTATUS(status) != 0 || !output.empty()) {
    return absl::InvalidArgumentError("promtool check metrics rejected the exposition: " + output);
  }
  return output;
}

ClusterTest::ClusterTest() {
  log_dir_ = std::filesystem::temp_directory_path() /
             absl::StrCat("nq-cluster-test-", getpid(), "-",
                          ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(log_dir_);
}

std::string ClusterTest::LogPath(const std::string& name) {
  return absl::StrCat(log_dir_, "/", log_counter_++, "-", name, ".log");
}

ServicePorts ClusterTest::NewPorts() { return ServicePorts{FreePort(), FreePort()}; }

bool ClusterTest::WaitServing(int grpc_port, std::chrono::milliseconds timeout) {
  return WaitFor([&] { return GrpcHealth(grpc_port) == grpc::health::v1::HealthCheckResponse::SERVING; },
                 timeout);
}

namespace {

ChildProcess MustStart(const std::string& binary, std::vector<std::string> args, const std::string& log) {
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(binary, args, log);
  EXPECT_TRUE(child.ok()) << child.status();
  return *std::move(child);
}

}  // namespace

std::string ClusterTest::ExpectStartupFailure(ChildProcess child, std::chrono::seconds timeout) {
  absl::StatusOr<int> code = child.WaitForExit(timeout);
  EXPECT_TRUE(code.ok()) << "the service kept running:\n" << child.Log();
  EXPECT_NE(code.value_or(0), 0) << child.Log();
  EXPECT_GT(code.value_or(0), 0) << "it crashed instead of exiting:\n" << child.Log();
  return child.Log();
}

ChildProcess ClusterTest::StartStreamer(const ServicePorts& ports, std::vector<std::string> extra) {
  std::vector<std::string> args = {"--host=127.0.0.1", absl::StrCat("--grpc_port=", ports.grpc),
                                   absl::StrCat("--metrics_port=", ports.http), "--drain_timeout_s=2"};
  args.insert(args.end(), extra.begin(), extra.end());
  return MustStart(NQ_STREAMER_BIN, args, LogPath("streamer"));
}

ChildProcess ClusterTest::StartWorker(const ServicePorts& ports, int streamer_grpc_port,
                                      std::vector<std::string> extra) {
  std::vector<std::string> args = {"--host=127.0.0.1", absl::StrCat("--grpc_port=", ports.grpc),
                                   absl::StrCat("--metrics_port=", ports.http),
                                   absl::StrCat("--streamer_address=127.0.0.1:", streamer_grpc_port),
                                   "--drain_timeout_s=5"};
  args.insert(args.end(), extra.begin(), extra.end());
  return MustStart(NQ_WORKER_BIN, args, LogPath("worker"));
}

ChildProcess ClusterTest::StartRouter(const ServicePorts& ports, int worker_grpc_port,
                                      std::vector<std::string> extra) {
  std::vector<std::string> args = {"--host=127.0.0.1", absl::StrCat("--grpc_port=", ports.grpc),
                                   absl::StrCat("--http_port=", ports.http),
                                   absl::StrCat("--worker_address=127.0.0.1:", worker_grpc_port),
                                   "--worker_poll_interval_s=0.1", "--drain_timeout_s=5"};
  args.insert(args.end(), extra.begin(), extra.end());
  return MustStart(NQ_ROUTER_BIN, args, LogPath("router"));
}

}  // namespace nq::testing
