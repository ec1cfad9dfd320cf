// End to end: the three real binaries on loopback.
#include <signal.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "nq/v1/inference.grpc.pb.h"
#include "tests/integration/cluster_fixture.h"

namespace nq::testing {
namespace {

using ::testing::HasSubstr;
using HealthStatus = grpc::health::v1::HealthCheckResponse;

constexpr auto kExitTimeout = std::chrono::seconds(15);

TEST_F(ClusterTest, StartsServesMetricsAndStopsCleanlyOnSigterm) {
  const ServicePorts streamer_ports = NewPorts(), worker_ports = NewPorts(), router_ports = NewPorts();
  ChildProcess streamer = StartStreamer(streamer_ports);
  ChildProcess worker = StartWorker(worker_ports, streamer_ports.grpc);
  ChildProcess router = StartRouter(router_ports, worker_ports.grpc);

  ASSERT_TRUE(WaitServing(streamer_ports.grpc)) << streamer.Log();
  ASSERT_TRUE(WaitServing(worker_ports.grpc)) << worker.Log();
  ASSERT_TRUE(WaitServing(router_ports.grpc)) << router.Log();
  EXPECT_EQ(HttpGet(router_ports.http, "/health").status, 200);
  EXPECT_EQ(HttpGet(worker_ports.http, "/health").status, 200);
  EXPECT_EQ(HttpGet(streamer_ports.http, "/health").status, 200);

  // Every service's /metrics passes the real promtool and shows the connections.
  const std::pair<int, const char*> scrapes[] = {
      {streamer_ports.http, "\nnq_streamer_workers_registered 1\n"},
      {worker_ports.http, "\nnq_worker_streamer_connected 1\n"},
      {router_ports.http, "\nnq_router_worker_ready 1\n"},
  };
  for (const auto& [port, expected] : scrapes) {
    HttpReply metrics = HttpGet(port, "/metrics");
    ASSERT_EQ(metrics.status, 200);
    EXPECT_THAT(metrics.body, HasSubstr(expected));
    absl::StatusOr<std::string> lint = PromtoolCheck(metrics.body);
    EXPECT_TRUE(lint.ok()) << lint.status() << "\n" << metrics.body;
  }

  // The router answers model info from the worker over gRPC and HTTP.
  auto channel = grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_ports.grpc),
                                     grpc::InsecureChannelCredentials());
  auto inference = nq::v1::Inference::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
  nq::v1::ModelInfo info;
  ASSERT_TRUE(inference->GetModelInfo(&context, nq::v1::GetModelInfoRequest(), &info).ok());
  EXPECT_EQ(info.tensor_parallel_size(), 1u);
  EXPECT_GT(info.created_unix(), 0);
  HttpReply models = HttpGet(router_ports.http, "/v1/models");
  EXPECT_EQ(models.status, 200);
  EXPECT_THAT(models.body, HasSubstr(R"("object":"list")"));
  HttpReply missing = HttpGet(router_ports.http, "/v1/nothing");
  EXPECT_EQ(missing.status, 404);
  EXPECT_THAT(missing.body, HasSubstr("invalid_request_error"));

  for (ChildProcess* child : {&router, &worker, &streamer}) {
    child->Signal(SIGTERM);
    absl::StatusOr<int> code = child->WaitForExit(kExitTimeout);
    ASSERT_TRUE(code.ok()) << code.status() << "\n" << child->Log();
    EXPECT_EQ(*code, 0) << child->Log();
    EXPECT_THAT(child->Log(), HasSubstr("stopped"));
  }
}

TEST_F(ClusterTest, WorkerRetriesUntilTheStreamerComesUp) {
  const ServicePorts streamer_ports = NewPorts(), worker_ports = NewPorts();
  ChildProcess worker = StartWorker(worker_ports, streamer_ports.grpc);

  // The worker's own servers come up, but it is not ready without the streamer.
  ASSERT_TRUE(WaitFor([&] { return GrpcHealth(worker_ports.grpc).has_value(); }, std::chrono::seconds(20)))
      << worker.Log();
  std::this_thread::sleep_for(std::chrono::seconds(2));
  EXPECT_TRUE(worker.Running()) << worker.Log();
  EXPECT_EQ(GrpcHealth(worker_ports.grpc), HealthStatus::NOT_SERVING);
  EXPECT_EQ(HttpGet(worker_ports.http, "/health").status, 503);
  EXPECT_THAT(HttpGet(worker_ports.http, "/metrics").body, HasSubstr("\nnq_worker_streamer_connected 0\n"));

  ChildProcess streamer = StartStreamer(streamer_ports);
  EXPECT_TRUE(WaitServing(worker_ports.grpc)) << worker.Log() << streamer.Log();

  worker.Signal(SIGTERM);
  streamer.Signal(SIGTERM);
  EXPECT_EQ(worker.WaitForExit(kExitTimeout).value_or(-1), 0) << worker.Log();
  EXPECT_EQ(streamer.WaitForExit(kExitTimeout).value_or(-1), 0) << streamer.Log();
}

TEST_F(ClusterTest, StreamerDrainsThenWorkerKeepsServingAndResyncsWithANewStreamer) {
  const ServicePorts streamer_ports = NewPorts(), worker_ports = NewPorts();
  ChildProcess streamer = StartStreamer(streamer_ports, {"--drain_timeout_s=3"});
  ChildProcess worker = StartWorker(worker_ports, streamer_ports.grpc);
  ASSERT_TRUE(WaitServing(worker_ports.grpc)) << worker.Log() << streamer.Log();

  // The worker's session is an open call on the streamer, so the drain lasts until its
  // deadline, and health says NOT_SERVING all the while.
  streamer.Signal(SIGTERM);
  EXPECT_TRUE(WaitFor([&] { return HttpGet(streamer_ports.http, "/health").status == 503; },
                      std::chrono::seconds(2)))
      << streamer.Log();
  EXPECT_EQ(streamer.WaitForExit(kExitTimeout).value_or(-1), 0) << streamer.Log();

  // The worker stays up and SERVING (every expert at 2 bits) while the streamer is gone.
  EXPECT_TRUE(WaitFor([&] {
    return HttpGet(worker_ports.http, "/metrics").body.find("\nnq_worker_streamer_connected 0\n") != std::string::npos;
  }, std::chrono::seconds(10))) << worker.Log();
  EXPECT_EQ(GrpcHealth(worker_ports.grpc), HealthStatus::SERVING);

  ChildProcess restarted = StartStreamer(streamer_ports);
  EXPECT_TRUE(WaitFor([&] {
    return HttpGet(worker_ports.http, "/metrics").body.find("\nnq_worker_streamer_connected 1\n") != std::string::npos;
  }, std::chrono::seconds(15))) << worker.Log() << restarted.Log();
  EXPECT_THAT(HttpGet(worker_ports.http, "/metrics").body, HasSubstr("\nnq_worker_streamer_registrations_total 2\n"));
  EXPECT_THAT(HttpGet(streamer_ports.http, "/metrics").body, HasSubstr("\nnq_streamer_workers_registered 1\n"));

  worker.Signal(SIGTERM);
  restarted.Signal(SIGTERM);
  EXPECT_EQ(worker.WaitForExit(kExitTimeout).value_or(-1), 0) << worker.Log();
  EXPECT_EQ(restarted.WaitForExit(kExitTimeout).value_or(-1), 0) << restarted.Log();
}

TEST_F(ClusterTest, RouterIsNotServingWithoutAWorkerAndRecoversWhenOneAppears) {
  const ServicePorts streamer_ports = NewPorts(), worker_ports = NewPorts(), router_ports = NewPorts();
  ChildProcess router = StartRouter(router_ports, worker_ports.grpc);
  ASSERT_TRUE(WaitFor([&] { return GrpcHealth(router_ports.grpc).has_value(); }, std::chrono::seconds(20)));
  EXPECT_EQ(GrpcHealth(router_ports.grpc), HealthStatus::NOT_SERVING);
  HttpReply models = HttpGet(router_ports.http, "/v1/models");
  EXPECT_EQ(models.status, 503);
  EXPECT_THAT(models.body, HasSubstr("not ready"));

  ChildProcess streamer = StartStreamer(streamer_ports);
  ChildProcess worker = StartWorker(worker_ports, streamer_ports.grpc);
  EXPECT_TRUE(WaitServing(router_ports.grpc)) << router.Log() << worker.Log();

  // The worker dies: the router notices within a few polls.
  worker.Signal(SIGKILL);
  EXPECT_TRUE(WaitFor([&] { return GrpcHealth(router_ports.grpc) == HealthStatus::NOT_SERVING; },
                      std::chrono::seconds(5)))
      << router.Log();
  router.Signal(SIGTERM);
  streamer.Signal(SIGTERM);
  EXPECT_EQ(router.WaitForExit(kExitTimeout).value_or(-1), 0) << router.Log();
  EXPECT_EQ(streamer.WaitForExit(kExitTimeout).value_or(-1), 0) << streamer.Log();
}

}  // namespace
}  // namespace nq::testing
