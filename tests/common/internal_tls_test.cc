// Who may call an internal service (services/common/internal_tls.h): the listening policy, the
// flag checks, and real TLS handshakes against a GrpcServer with the cluster's mutual TLS,
// using certificates that scripts/make_cluster_certs.sh makes with openssl.
#include "services/common/internal_tls.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "services/common/grpc_server.h"

namespace nq {
namespace {

namespace fs = std::filesystem;

TEST(InternalTlsTest, LoopbackHosts) {
  for (const char* host : {"127.0.0.1", "127.8.9.10", "localhost", "LOCALHOST", "::1", "[::1]"}) {
    EXPECT_TRUE(IsLoopbackHost(host)) << host;
  }
  for (const char* host : {"0.0.0.0", "::", "10.0.0.1", "128.0.0.1", "example.com", "", "127.0.0.1.example"}) {
    EXPECT_FALSE(IsLoopbackHost(host)) << host;
  }
}

TEST(InternalTlsTest, PlainTextOffLoopbackNeedsTheExplicitFlag) {
  EXPECT_TRUE(InternalServerCredentials("nq-worker", "127.0.0.1", nullptr, false).ok());
  const absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> refused =
      InternalServerCredentials("nq-worker", "0.0.0.0", nullptr, false);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("--allow_plaintext_internal"), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("--tls_ca"), std::string::npos) << refused.status();
  EXPECT_TRUE(InternalServerCredentials("nq-worker", "0.0.0.0", nullptr, true).ok());
}

class TlsFilesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::path(::testing::TempDir()) / absl::StrCat("nq_tls_", getpid()));
    fs::create_directories(*dir_);
    // Two independent CAs: the cluster's, and a stranger's whose certificates must be refused.
    for (const char* name : {"cluster", "stranger"}) {
      const std::string cmd = absl::StrCat("bash ", NQ_SOURCE_DIR, "/scripts/make_cluster_certs.sh ",
                                           (*dir_ / name).string(), " >/dev/null");
      ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << " (needs openssl)";
    }
  }
  static void TearDownTestSuite() {
    std::error_code ignored;
    fs::remove_all(*dir_, ignored);
    delete dir_;
  }
  static std::string File(const std::string& ca, const std::string& name) { return (*dir_ / ca / name).string(); }
  static std::shared_ptr<const InternalTls> Tls(const std::string& ca, const std::string& service) {
    absl::StatusOr<std::shared_ptr<const InternalTls>> tls =
        LoadInternalTls(File(ca, "ca.crt"), File(ca, service + ".crt"), File(ca, service + ".key"));
    EXPECT_TRUE(tls.ok()) << tls.status();
    return tls.ok() ? *tls : nullptr;
  }

  static fs::path* dir_;
};
fs::path* TlsFilesTest::dir_ = nullptr;

TEST_F(TlsFilesTest, IncompleteOrWrongFilesAreRefusedByName) {
  absl::StatusOr<std::shared_ptr<const InternalTls>> none = LoadInternalTls("", "", "");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, nullptr);

  absl::StatusOr<std::shared_ptr<const InternalTls>> partial = LoadInternalTls(File("cluster", "ca.crt"), "", "");
  ASSERT_FALSE(partial.ok());
  EXPECT_NE(partial.status().message().find("--tls_cert --tls_key"), std::string::npos) << partial.status();

  absl::StatusOr<std::shared_ptr<const InternalTls>> missing =
      LoadInternalTls(File("cluster", "no-such.crt"), File("cluster", "worker.crt"), File("cluster", "worker.key"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("--tls_ca="), std::string::npos) << missing.status();

  // A key where the certificate belongs, and a certificate where the key belongs.
  absl::StatusOr<std::shared_ptr<const InternalTls>> swapped =
      LoadInternalTls(File("cluster", "ca.crt"), File("cluster", "worker.key"), File("cluster", "worker.crt"));
  ASSERT_FALSE(swapped.ok());
  EXPECT_NE(swapped.status().message().find("--tls_cert="), std::string::npos) << swapped.status();
}

// A health Check against `port` over `credentials`; true when it answers.
bool HealthAnswers(int port, const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                   const InternalTls* tls_for_arguments = nullptr) {
  grpc::ChannelArguments args;
  AddInternalChannelArguments(tls_for_arguments, args);
  auto channel = grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port), credentials, args);
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  return stub->Check(&context, request, &response).ok();
}

TEST_F(TlsFilesTest, OnlyClientsWithAClusterCertificateGetIn) {
  const std::shared_ptr<const InternalTls> worker = Tls("cluster", "worker");
  const std::shared_ptr<const InternalTls> router = Tls("cluster", "router");
  const std::shared_ptr<const InternalTls> stranger = Tls("stranger", "router");
  ASSERT_TRUE(worker && router && stranger);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      InternalServerCredentials("nq-worker", "0.0.0.0", worker.get(), false);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({.host = "127.0.0.1", .credentials = *credentials});
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->SetServing(true);
  const int port = (*server)->port();

  EXPECT_TRUE(HealthAnswers(port, InternalChannelCredentials(router.get()))) << "a cluster client";
  EXPECT_FALSE(HealthAnswers(port, grpc::InsecureChannelCredentials())) << "plain text";
  grpc::SslCredentialsOptions no_client_cert;
  no_client_cert.pem_root_certs = router->ca_pem;
  EXPECT_FALSE(HealthAnswers(port, grpc::SslCredentials(no_client_cert))) << "TLS without a client certificate";
  // The stranger trusts the cluster CA but its own certificate is signed by another one.
  InternalTls mixed = *stranger;
  mixed.ca_pem = router->ca_pem;
  EXPECT_FALSE(HealthAnswers(port, InternalChannelCredentials(&mixed))) << "a certificate from another CA";
  // A client that does not trust the cluster CA refuses the server.
  EXPECT_FALSE(HealthAnswers(port, InternalChannelCredentials(stranger.get()))) << "a server from another CA";
}

TEST_F(TlsFilesTest, TheServerNameOverrideChecksTheNamedService) {
  const std::shared_ptr<const InternalTls> worker = Tls("cluster", "worker");
  ASSERT_TRUE(worker);
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      InternalServerCredentials("nq-worker", "127.0.0.1", worker.get(), false);
  ASSERT_TRUE(credentials.ok()) << credentials.status();
  absl::StatusOr<std::unique_ptr<GrpcServer>> server =
      GrpcServer::Start({.host = "127.0.0.1", .credentials = *credentials});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::shared_ptr<const InternalTls> router = Tls("cluster", "router");
  ASSERT_TRUE(router);
  InternalTls named = *router;
  named.server_name = "nq-worker";  // in the worker's certificate
  EXPECT_TRUE(HealthAnswers((*server)->port(), InternalChannelCredentials(&named), &named));
  named.server_name = "nq-streamer";  // not in it
  EXPECT_FALSE(HealthAnswers((*server)->port(), InternalChannelCredentials(&named), &named));
}

}  // namespace
}  // namespace nq
