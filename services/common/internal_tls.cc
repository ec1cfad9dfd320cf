#include "services/common/internal_tls.h"

#include <arpa/inet.h>

#include <fstream>
#include <sstream>

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

ABSL_FLAG(std::string, tls_ca, "",
          "PEM file of the cluster CA: with --tls_cert and --tls_key, internal gRPC (worker, streamer) uses mutual "
          "TLS, each side requiring a certificate signed by this CA (scripts/make_cluster_certs.sh)");
ABSL_FLAG(std::string, tls_cert, "", "PEM file of this service's certificate (chain), signed by --tls_ca");
ABSL_FLAG(std::string, tls_key, "", "PEM file of this service's private key");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name to check in the server certificate when dialling an internal service, instead of the dialled host");
ABSL_FLAG(bool, allow_plaintext_internal, false,
          "Serve internal gRPC (nq.v1.Worker / nq.v1.Streamer) in plain text on a non-loopback --host: anyone who "
          "reaches the port can then call it. Without this flag such a service refuses to start unless TLS is set");

namespace nq {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path, absl::string_view kind) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, "=", path, ": cannot open the file"));
  std::ostringstream text;
  text << in.rdbuf();
  std::string pem = text.str();
  // "-----BEGIN CERTIFICATE-----", "-----BEGIN PRIVATE KEY-----", "-----BEGIN EC PRIVATE KEY-----", ...
  if (!absl::StrContains(pem, "-----BEGIN ") || !absl::StrContains(pem, kind)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, ": not a PEM ", absl::AsciiStrToLower(kind), " (no -----BEGIN ... ",
                     kind, "----- block)"));
  }
  return pem;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const InternalTls>> LoadInternalTls(const std::string& ca_path,
                                                                   const std::string& cert_path,
                                                                   const std::string& key_path,
                                                                   std::string server_name) {
  const int given = !ca_path.empty() + !cert_path.empty() + !key_path.empty();
  if (given == 0) return std::shared_ptr<const InternalTls>();
  if (given != 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mutual TLS needs all of --tls_ca, --tls_cert and --tls_key; missing:", ca_path.empty() ? " --tls_ca" : "",
        cert_path.empty() ? " --tls_cert" : "", key_path.empty() ? " --tls_key" : ""));
  }
  auto tls = std::make_shared<InternalTls>();
  ASSIGN_OR_RETURN(tls->ca_pem, ReadPem("tls_ca", ca_path, "CERTIFICATE"));
  ASSIGN_OR_RETURN(tls->cert_pem, ReadPem("tls_cert", cert_path, "CERTIFICATE"));
  ASSIGN_OR_RETURN(tls->key_pem, ReadPem("tls_key", key_path, "PRIVATE KEY"));
  tls->server_name = std::move(server_name);
  return std::shared_ptr<const InternalTls>(std::move(tls));
}

absl::StatusOr<std::shared_ptr<const InternalTls>> InternalTlsFromFlags() {
  return LoadInternalTls(absl::GetFlag(FLAGS_tls_ca), absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key),
                         absl::GetFlag(FLAGS_tls_server_name));
}

bool IsLoopbackHost(absl::string_view host) {
  if (absl::EqualsIgnoreCase(host, "localhost")) return true;
  std::string bare(host);
  if (bare.size() >= 2 && bare.front() == '[' && bare.back() == ']') bare = bare.substr(1, bare.size() - 2);
  in_addr v4{};
  if (inet_pton(AF_INET, bare.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, bare.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> InternalServerCredentials(
    absl::string_view service, absl::string_view host, const InternalTls* tls, bool allow_plaintext) {
  if (tls != nullptr) {
    grpc::SslServerCredentialsOptions options(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    options.pem_root_certs = tls->ca_pem;
    options.pem_key_cert_pairs.push_back({tls->key_pem, tls->cert_pem});
    return grpc::SslServerCredentials(options);
  }
  if (IsLoopbackHost(host)) return grpc::InsecureServerCredentials();
  if (!allow_plaintext) {
    return absl::FailedPreconditionError(absl::StrCat(
        service, ": --host=", host,
        " is not a loopback address, and internal gRPC in plain text would let anyone who reaches the port call it. "
        "Give --tls_ca, --tls_cert and --tls_key (mutual TLS; scripts/make_cluster_certs.sh makes a test CA), listen "
        "on 127.0.0.1, or accept the risk with --allow_plaintext_internal"));
  }
  spdlog::warn("{}: internal gRPC in plain text on {} (--allow_plaintext_internal): anyone who reaches this port "
               "can call it; restrict it with a network policy or use mutual TLS",
               std::string(service), std::string(host));
  return grpc::InsecureServerCredentials();
}

std::shared_ptr<grpc::ChannelCredentials> InternalChannelCredentials(const InternalTls* tls) {
  if (tls == nullptr) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = tls->ca_pem;
  options.pem_private_key = tls->key_pem;
  options.pem_cert_chain = tls->cert_pem;
  return grpc::SslCredentials(options);
}

void AddInternalChannelArguments(const InternalTls* tls, grpc::ChannelArguments& args) {
  if (tls != nullptr && !tls->server_name.empty()) args.SetSslTargetNameOverride(tls->server_name);
}

std::shared_ptr<grpc::Channel> InternalChannel(const std::string& address, const InternalTls* tls,
                                               grpc::ChannelArguments args) {
  AddInternalChannelArguments(tls, args);
  return grpc::CreateCustomChannel(address, InternalChannelCredentials(tls), args);
}

}  // namespace nq
