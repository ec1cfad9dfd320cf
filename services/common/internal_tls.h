// Who may call the internal services (nq.v1.Worker, nq.v1.Streamer): the policy and the gRPC
// credentials that carry it (DESIGN.md section 8, issue #22).
//
// - On a loopback address (127.0.0.0/8, ::1, localhost) a service is reachable only from its own
//   host, and plain-text gRPC is allowed: the default (`--host=127.0.0.1`).
// - On any other address the three services authenticate each other with mutual TLS: every
//   server presents a certificate and requires one from its caller, both signed by the cluster
//   CA (`--tls_ca`, `--tls_cert`, `--tls_key`; scripts/make_cluster_certs.sh makes them for a
//   test cluster). Clients verify the server against the same CA.
// - Plain text on a non-loopback address needs `--allow_plaintext_internal`, and logs a warning
//   naming the address: anyone who reaches the port can generate without the router's API key
//   or register a fake worker with the streamer.
#pragma once

#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/flags/declare.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

ABSL_DECLARE_FLAG(std::string, tls_ca);
ABSL_DECLARE_FLAG(std::string, tls_cert);
ABSL_DECLARE_FLAG(std::string, tls_key);
ABSL_DECLARE_FLAG(std::string, tls_server_name);
ABSL_DECLARE_FLAG(bool, allow_plaintext_internal);

namespace nq {

// PEM text of the cluster CA and of this service's certificate chain and private key.
struct InternalTls {
  std::string ca_pem;
  std::string cert_pem;
  std::string key_pem;
  // When set, clients check the server's certificate for this name instead of the host they
  // dial (e.g. a certificate for "nq-worker" reached through an IP address).
  std::string server_name;
};

// The TLS material named by the flags: nullptr when none of --tls_ca/--tls_cert/--tls_key is
// set; INVALID_ARGUMENT naming the flag when only some are set, a file cannot be read, or its
// contents are not PEM of the expected kind.
absl::StatusOr<std::shared_ptr<const InternalTls>> InternalTlsFromFlags();
// The same from explicit paths (tests, tools).
absl::StatusOr<std::shared_ptr<const InternalTls>> LoadInternalTls(const std::string& ca_path,
                                                                   const std::string& cert_path,
                                                                   const std::string& key_path,
                                                                   std::string server_name = "");

// True for 127.0.0.0/8, ::1 and localhost (what a host flag may name).
bool IsLoopbackHost(absl::string_view host);

// The credentials a server of an internal service listens with on `host`: mutual TLS when
// `tls` is set; plain text on loopback; plain text elsewhere only with `allow_plaintext`
// (logged as a warning), else FAILED_PRECONDITION explaining the choices.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> InternalServerCredentials(
    absl::string_view service, absl::string_view host, const InternalTls* tls, bool allow_plaintext);

// The credentials a client of an internal service dials with: TLS with this service's
// certificate when `tls` is set, plain text otherwise.
std::shared_ptr<grpc::ChannelCredentials> InternalChannelCredentials(const InternalTls* tls);
// Channel arguments that go with them (the server-name override); adds to `args`.
void AddInternalChannelArguments(const InternalTls* tls, grpc::ChannelArguments& args);
// A channel to an internal service at `address` with the credentials and arguments above.
std::shared_ptr<grpc::Channel> InternalChannel(const std::string& address, const InternalTls* tls,
                                               grpc::ChannelArguments args = {});

}  // namespace nq
