// The internal services on the real binaries (services/common/internal_tls.h): a worker or a
// streamer asked to listen beyond loopback in plain text refuses to start, and a cluster whose
// three services hold certificates from scripts/make_cluster_certs.sh serves a completion over
// mutual TLS while a plain-text caller is turned away.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/raw_http.h"
#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

using ::testing::HasSubstr;

class InternalTlsClusterTest : public ClusterTest {};

TEST_F(InternalTlsClusterTest, PlainTextBeyondLoopbackNeedsTheExplicitFlag) {
  const std::string streamer_log =
      ExpectStartupFailure(StartStreamer(NewPorts(), {"--host=0.0.0.0"}), std::chrono::seconds(30));
  EXPECT_THAT(streamer_log, HasSubstr("--allow_plaintext_internal"));
  EXPECT_THAT(streamer_log, HasSubstr("--tls_ca"));
  const std::string worker_log =
      ExpectStartupFailure(StartWorker(NewPorts(), FreePort(), {"--host=0.0.0.0"}), std::chrono::seconds(30));
  EXPECT_THAT(worker_log, HasSubstr("nq-worker: --host=0.0.0.0 is not a loopback address"));

  // With the flag it starts, and says what it exposes.
  const ServicePorts ports = NewPorts();
  ChildProcess streamer = StartStreamer(ports, {"--host=0.0.0.0", "--allow_plaintext_internal"});
  ASSERT_TRUE(WaitServing(ports.grpc)) << streamer.Log();
  EXPECT_THAT(streamer.Log(), HasSubstr("internal gRPC in plain text on 0.0.0.0"));
}

// The embedded model served by the three services, each with its own certificate.
TEST_F(ServingTest, TheClusterServesOverMutualTlsAndRefusesPlainTextCallers) {
  const std::filesystem::path certs =
      std::filesystem::path(::testing::TempDir()) / absl::StrCat("nq_cluster_certs_", getpid());
  const std::string make = absl::StrCat("bash ", NQ_SOURCE_DIR, "/scripts/make_cluster_certs.sh ", certs.string(),
                                        " >/dev/null");
  ASSERT_EQ(std::system(make.c_str()), 0) << make << " (needs openssl)";
  auto tls = [&](const std::string& service, std::vector<std::string> flags = {}) {
    flags.push_back(absl::StrCat("--tls_ca=", (certs / "ca.crt").string()));
    flags.push_back(absl::StrCat("--tls_cert=", (certs / (service + ".crt")).string()));
    flags.push_back(absl::StrCat("--tls_key=", (certs / (service + ".key")).string()));
    return flags;
  };
  streamer_ports_ = NewPorts();
  worker_ports_ = NewPorts();
  router_ports_ = NewPorts();
  streamer_.emplace(StartStreamer(streamer_ports_, tls("streamer")));
  worker_.emplace(StartWorker(worker_ports_, streamer_ports_.grpc,
                              tls("worker", {"--model=" + *model_dir_, "--served_model_name=embedded",
                                             "--max_model_len=512"})));
  router_.emplace(
      StartRouter(router_ports_, worker_ports_.grpc, tls("router", {"--tokenizer=" + *model_dir_ + "/tokenizer.json"})));

  // The router's own API stays as it was (plain gRPC, HTTP): it is SERVING once it reaches the
  // worker, which it can only do over mutual TLS.
  ASSERT_TRUE(WaitServing(router_ports_.grpc, std::chrono::seconds(60))) << router_->Log() << worker_->Log();
  ASSERT_TRUE(WaitFor(
      [&] {
        return HttpGet(streamer_ports_.http, "/metrics").body.find("\nnq_streamer_workers_registered 1\n") !=
               std::string::npos;
      },
      std::chrono::seconds(20)))
      << "the worker did not register with the streamer over mutual TLS\n"
      << worker_->Log() << streamer_->Log();

  absl::StatusOr<std::pair<int, Json>> reply =
      PostJson("/v1/completions", {{"model", "embedded"}, {"prompt", "def"}, {"max_tokens", 4}, {"temperature", 0}});
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->first, 200) << reply->second.dump();
  EXPECT_EQ(reply->second["usage"]["completion_tokens"], 4) << reply->second.dump();

  // A caller without the cluster's certificate gets nothing from the worker or the streamer.
  EXPECT_FALSE(GrpcHealth(worker_ports_.grpc).has_value());
  EXPECT_FALSE(GrpcHealth(streamer_ports_.grpc).has_value());
  std::error_code ignored;
  std::filesystem::remove_all(certs, ignored);
}

}  // namespace
}  // namespace nq::testing
