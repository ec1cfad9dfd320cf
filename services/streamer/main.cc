// nq-streamer: one per node. Owns the NestQuant record directory, maps every worker's slot
// arena, and streams residual records into the slots predictor v0 chooses.
#include <sys/stat.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "services/common/flag_checks.h"
#include "services/common/grpc_server.h"
#include "services/common/http_server.h"
#include "services/common/internal_tls.h"
#include "services/common/metrics/registry.h"
#include "services/common/service_main.h"
#include "services/common/shutdown_signal.h"
#include "services/common/status_macros.h"
#include "services/format/file_io.h"
#include "services/streamer/jf_model.h"
#include "services/streamer/read_faults.h"
#include "services/streamer/record_verifier.h"
#include "services/streamer/record_files.h"
#include "services/streamer/streamer_service.h"
#include "services/streamer/worker_registry.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "Address to listen on (gRPC and /metrics); a non-loopback address needs mutual TLS (--tls_ca, --tls_cert, "
          "--tls_key) or --allow_plaintext_internal");
ABSL_FLAG(int, grpc_port, 8200, "nq.v1.Streamer gRPC port (workers -> streamer)");
ABSL_FLAG(int, metrics_port, 8201, "HTTP port for /metrics and /health");
ABSL_FLAG(std::string, metrics_host, "",
          "Address for /metrics and /health (default: --host); e.g. 0.0.0.0 for scrapes and probes from other hosts "
          "while gRPC stays on loopback");
ABSL_FLAG(std::string, records_dir, "",
          "NestQuant release directory to stream records from (empty: none yet; every expert "
          "runs at 2 bits)");
ABSL_FLAG(std::vector<std::string>, record_mirrors, {},
          "Comma-separated directories holding identical copies of --records_dir (other drives); reads "
          "are spread over all copies");
ABSL_FLAG(int, read_queue_depth, 8, "Record reads in flight per worker (4-8 per drive keeps tail latency low)");
ABSL_FLAG(int, read_piece_kib, 256,
          "Each record is read as pieces of at most this many KiB, all in flight together (drives peak with "
          "128-256 KiB reads many deep); 0 reads a record in one read");
ABSL_FLAG(int, bounce_buffers, 32,
          "Registered bounce buffers per worker session, one record each (pinned for GPU workers), at least "
          "--read_queue_depth: those not being read into keep recent records as an LRU cache, so an expert "
          "evicted and wanted again is copied into its slot without a disk read");
ABSL_FLAG(std::string, direct_io, "auto", "auto: O_DIRECT, buffered with a warning where refused; off: buffered");
ABSL_FLAG(std::string, inject_read_faults, "",
          "Tests and drills only: disk faults injected into record reads, e.g. eio=0.05,short=0.02,slow=0.1:2000,seed=7 "
          "(a probability per record read; slow=P:MS holds a read for MS milliseconds); failed records are never "
          "copied into slots and their experts stay at 2 bits");
ABSL_FLAG(int, verify_threads, 2,
          "Threads that check every record read against its checksum in the release index before it can become "
          "READY, shared by all sessions, so hashing overlaps the next reads; 0 checks on each session's loader "
          "thread");
ABSL_FLAG(std::string, record_check, "fastest",
          "Checksum every record read is checked with: fastest, the index's XXH3-128 where it has one (one "
          "thread keeps up with a drive), else its SHA-256; sha256, SHA-256 always (cryptographic: also stops a "
          "forger who can rewrite record files but not the index; about 1.5 GB/s a verifier thread)");
ABSL_FLAG(int, read_budget, 64, "Most new floating-slot loads per predictor refresh (every 16 tokens)");
ABSL_FLAG(std::optional<double>, hysteresis, std::nullopt,
          "Score margin a challenger needs to evict a resident expert; unset: the predictor's own (2.0 for v0; "
          "for jF the file's \"hysteresis_margin\", else the swept default, bench/README.md)");
ABSL_FLAG(std::string, predictor, "",
          "A learned predictor (jF, safetensors from scripts/predictor/train_jf.py) scoring the floating slots; "
          "empty: predictor v0's EMA heuristic. A file trained for another model (MoE layers, experts, top-k) "
          "is refused");
ABSL_FLAG(std::string, predictor_state_dir, "",
          "Directory keeping each worker rank's predictor state (routing history), restored when its session "
          "starts so a restarted streamer does not start cold; empty: not kept");
ABSL_FLAG(double, request_share, 0.0,
          "Share of each layer's floating slots kept for the experts with the most hits in the current request, "
          "whatever their score (0 to 1)");
ABSL_FLAG(bool, pace_reads, true,
          "Each refresh issues only the loads the measured read throughput lands before the next refresh (less "
          "reads in flight), at most --read_budget; false: always --read_budget");
ABSL_FLAG(std::string, decider_address, "",
          "host:port of the streamer of rank 0's node, when this node's ranks belong to a tensor-parallel group "
          "spanning nodes: that streamer decides for the whole group and this one reads its node's ranks' records "
          "on its orders (docs/tp_streamers.md); empty: this streamer decides for the groups whose rank 0 registers "
          "here. Needs --records_dir (this node's copy of the release)");
ABSL_FLAG(int, node_rank, -1,
          "This node's place in a tensor-parallel group spanning nodes (e.g. a StatefulSet pod's index): node 0 "
          "holds rank 0, so its streamer decides and --decider_address is ignored there; -1: not given");
ABSL_FLAG(double, drain_timeout_s, 10, "On SIGTERM, seconds to let sessions close");

namespace nq::streamer {
namespace {

absl::Status CheckFlags() {
  RETURN_IF_ERROR(CheckPortFlag("grpc_port", absl::GetFlag(FLAGS_grpc_port), true));
  RETURN_IF_ERROR(CheckPortFlag("metrics_port", absl::GetFlag(FLAGS_metrics_port), true));
  RETURN_IF_ERROR(CheckPositiveSecondsFlag("drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s)));
  const std::string dir = absl::GetFlag(FLAGS_records_dir);
  struct stat st;
  if (!dir.empty() && (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))) {
    return absl::NotFoundError(absl::StrCat("--records_dir=", dir, ": not a directory"));
  }
  if (absl::GetFlag(FLAGS_read_queue_depth) < 1 || absl::GetFlag(FLAGS_read_queue_depth) > 256) {
    return absl::InvalidArgumentError("--read_queue_depth must be in [1, 256]");
  }
  // io_uring registers at most 16384 fixed buffers; far fewer already hold minutes of reads.
  if (const int piece = absl::GetFlag(FLAGS_read_piece_kib); piece < 0 || piece > (1 << 20) || piece % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--read_piece_kib=", piece,
                                                   ": want 0 or a multiple of 4 (O_DIRECT alignment) up to 1048576"));
  }
  if (absl::GetFlag(FLAGS_bounce_buffers) < absl::GetFlag(FLAGS_read_queue_depth) ||
      absl::GetFlag(FLAGS_bounce_buffers) > 4096) {
    return absl::InvalidArgumentError("--bounce_buffers must be in [--read_queue_depth, 4096]");
  }
  if (const std::string check = absl::GetFlag(FLAGS_record_check); check != "fastest" && check != "sha256") {
    return absl::InvalidArgumentError(absl::StrCat("--record_check must be fastest or sha256, not '", check, "'"));
  }
  if (absl::GetFlag(FLAGS_verify_threads) < 0 || absl::GetFlag(FLAGS_verify_threads) > 64) {
    return absl::InvalidArgumentError("--verify_threads must be in [0, 64]");
  }
  if (absl::GetFlag(FLAGS_read_budget) < 1) return absl::InvalidArgumentError("--read_budget must be positive");
  if (const std::optional<double> margin = absl::GetFlag(FLAGS_hysteresis); margin && !(*margin >= 0)) {
    return absl::InvalidArgumentError("--hysteresis must not be negative");
  }
  if (const double share = absl::GetFlag(FLAGS_request_share); !(share >= 0 && share <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--request_share=", share, ": want a share in [0, 1]"));
  }
  const std::string direct = absl::GetFlag(FLAGS_direct_io);
  if (direct != "auto" && direct != "off") {
    return absl::InvalidArgumentError(absl::StrCat("--direct_io=", direct, ": want auto or off"));
  }
  if (absl::GetFlag(FLAGS_node_rank) < -1) return absl::InvalidArgumentError("--node_rank must be >= 0 (or -1)");
  if (const std::string decider = absl::GetFlag(FLAGS_decider_address); !decider.empty()) {
    RETURN_IF_ERROR(CheckAddressFlag("decider_address", decider));
    if (dir.empty()) {
      return absl::InvalidArgumentError("--decider_address needs --records_dir: this streamer reads its node's ranks' "
                                        "records on the decider's orders");
    }
  }
  if (dir.empty() && !absl::GetFlag(FLAGS_record_mirrors).empty()) {
    return absl::InvalidArgumentError("--record_mirrors needs --records_dir");
  }
  if (dir.empty() && (!absl::GetFlag(FLAGS_predictor).empty() || !absl::GetFlag(FLAGS_predictor_state_dir).empty())) {
    return absl::InvalidArgumentError("--predictor and --predictor_state_dir need --records_dir (no release, no "
                                      "predictor)");
  }
  return absl::OkStatus();
}

// Validates the release and its mirrors (COMPLETE, indexes, sizes; hashes on demand) and
// returns how sessions read from it, or nullopt without --records_dir.
absl::StatusOr<std::optional<SlotLoaderOptions>> LoaderOptionsFromFlags(std::string* release_id) {
  const std::string dir = absl::GetFlag(FLAGS_records_dir);
  if (dir.empty()) return std::optional<SlotLoaderOptions>();
  SlotLoaderOptions options;
  options.record_dirs.push_back(dir);
  for (const std::string& mirror : absl::GetFlag(FLAGS_record_mirrors)) options.record_dirs.push_back(mirror);
  options.store.queue_depth = static_cast<unsigned>(absl::GetFlag(FLAGS_read_queue_depth));
  options.store.buffers = static_cast<unsigned>(absl::GetFlag(FLAGS_bounce_buffers));
  options.store.read_piece_bytes = static_cast<uint32_t>(absl::GetFlag(FLAGS_read_piece_kib)) * 1024;
  options.store.direct_io = absl::GetFlag(FLAGS_direct_io) == "off" ? DirectIo::kOff : DirectIo::kAuto;
  ASSIGN_OR_RETURN(options.store.faults, ParseReadFaults(absl::GetFlag(FLAGS_inject_read_faults)));
  if (options.store.faults.any()) {
    spdlog::warn("injecting disk faults into record reads (--inject_read_faults={}): a drill, not for serving",
                 absl::GetFlag(FLAGS_inject_read_faults));
  }
  options.store.record_check =
      absl::GetFlag(FLAGS_record_check) == "sha256" ? RecordCheck::kSha256 : RecordCheck::kFastest;
  if (const int threads = absl::GetFlag(FLAGS_verify_threads); threads > 0) {
    ASSIGN_OR_RETURN(options.store.verifier, RecordVerifier::Create(static_cast<unsigned>(threads)));
  }
  options.predictor.read_budget = static_cast<uint32_t>(absl::GetFlag(FLAGS_read_budget));
  options.predictor_state_dir = absl::GetFlag(FLAGS_predictor_state_dir);
  options.pace_reads = absl::GetFlag(FLAGS_pace_reads);
  options.predictor.request_share = static_cast<float>(absl::GetFlag(FLAGS_request_share));
  if (!options.predictor_state_dir.empty()) RETURN_IF_ERROR(format::MakeDirs(options.predictor_state_dir));
  // Opened once, now, so a bad release fails the start, not the first session; every
  // session reads through these files. No layer file is hashed whole: each record read is
  // checked against its own checksum instead (RecordStoreOptions::verify_hashes says why).
  ASSIGN_OR_RETURN(std::shared_ptr<RecordFiles> files, RecordFiles::Open(options.record_dirs, options.store.direct_io));
  *release_id = files->release().id();
  if (options.store.record_check == RecordCheck::kSha256) {
    spdlog::info("record reads are checked with SHA-256 (--record_check=sha256)");
  } else if (files->all_have_record_xxh3()) {
    spdlog::info("record reads are checked with XXH3-128");
  } else {
    spdlog::warn("the release's indexes predate XXH3 record checksums: record reads are checked with SHA-256, "
                 "about 1.5 GB/s a verifier thread (--verify_threads); a release written by this version has them");
  }
  if (const std::string path = absl::GetFlag(FLAGS_predictor); !path.empty()) {
    ASSIGN_OR_RETURN(options.predictor.learned, JfModel::Load(path));
    // Experts (and at most the release's layers) are checked now; the exact layer count and
    // top-k when the first routing report arrives (Predictor::Create): the release may hold
    // layers decode never reports (the MTP layer's experts).
    const format::Manifest& manifest = files->release().manifest();
    const JfGeometry& g = options.predictor.learned->geometry();
    if (g.num_layers > manifest.layers.size() || g.experts_per_layer != manifest.experts_per_layer) {
      return absl::FailedPreconditionError(
          absl::StrCat("--predictor=", path, " was trained for ", g.num_layers, " MoE layers x ", g.experts_per_layer,
                       " experts; the release has ", manifest.layers.size(), " layers x ", manifest.experts_per_layer,
                       " experts"));
    }
    spdlog::info("predictor jF from {} (hidden {}, {} pooling queries)", path, g.hidden, g.queries);
  }
  options.predictor.hysteresis_margin = static_cast<float>(
      absl::GetFlag(FLAGS_hysteresis).value_or(DefaultHysteresisMargin(options.predictor.learned.get())));
  spdlog::info("predictor hysteresis margin {}{}", options.predictor.hysteresis_margin,
               absl::GetFlag(FLAGS_hysteresis) ? "" : " (the predictor's default)");
  spdlog::info("release {} ({} copies, {} MoE layers, codec {})", *release_id, files->copies(),
               files->release().manifest().layers.size(), files->release().manifest().codec);
  options.files = std::move(files);
  return std::optional<SlotLoaderOptions>(std::move(options));
}

absl::Status Run(ShutdownSignal& shutdown) {
  RETURN_IF_ERROR(CheckFlags());
  metrics::Registry& registry = metrics::Registry::Default();
  std::string release_id;
  ASSIGN_OR_RETURN(std::optional<SlotLoaderOptions> loader_options, LoaderOptionsFromFlags(&release_id));
  WorkerRegistry workers(registry, release_id);
  ASSIGN_OR_RETURN(std::shared_ptr<const InternalTls> tls, InternalTlsFromFlags());
  // The node holding rank 0 decides, whatever --decider_address says (one chart sets it on every node).
  const std::string decider = absl::GetFlag(FLAGS_node_rank) == 0 ? "" : absl::GetFlag(FLAGS_decider_address);
  StreamerService service(&workers, registry, std::move(loader_options),
                          StreamerPeerOptions{.decider_address = decider, .tls = tls});
  StreamerPeerService peer_service(&service);
  if (!decider.empty()) {
    spdlog::info("tensor-parallel groups: the streamer at {} decides; this one applies its orders to this node's ranks",
                 decider);
  } else if (!absl::GetFlag(FLAGS_decider_address).empty()) {
    spdlog::info("node 0 (--node_rank=0): this streamer decides for its groups; --decider_address={} is not used",
                 absl::GetFlag(FLAGS_decider_address));
  }
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   InternalServerCredentials("nq-streamer", absl::GetFlag(FLAGS_host), tls.get(),
                                             absl::GetFlag(FLAGS_allow_plaintext_internal)));
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> grpc_server,
                   GrpcServer::Start(GrpcServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_grpc_port),
                       .services = {&service, &peer_service},
                       .health_service_names = {"nq.v1.Streamer"},
                       .credentials = std::move(credentials),
                   }));
  ASSIGN_OR_RETURN(std::unique_ptr<HttpServer> http_server,
                   HttpServer::Start(HttpServerOptions{
                       .host = absl::GetFlag(FLAGS_metrics_host).empty() ? absl::GetFlag(FLAGS_host)
                                                                         : absl::GetFlag(FLAGS_metrics_host),
                       .port = absl::GetFlag(FLAGS_metrics_port),
                       .add_routes =
                           [&](httplib::Server& server) {
                             AddMetricsRoute(server, registry);
                             AddHealthRoute(server, [&] { return grpc_server->serving(); });
                           },
                   }));
  // Nothing else to wait for: the release (if any) was validated above.
  grpc_server->SetServing(true);
  spdlog::info("nq-streamer {}: gRPC on {}, metrics on :{}", service.instance_id(),
               grpc_server->address(), http_server->port());

  shutdown.Wait();
  spdlog::info("signal {} received: draining (up to {} s)", shutdown.signal_number(),
               absl::GetFlag(FLAGS_drain_timeout_s));
  // Sessions are open-ended streams: Drain cancels them at the deadline, and workers fall
  // back to 2 bits and retry.
  grpc_server->Drain(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(
                         absl::GetFlag(FLAGS_drain_timeout_s) * 1000)));
  http_server->Stop();
  spdlog::info("nq-streamer stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace nq::streamer

int main(int argc, char** argv) {
  return nq::ServiceMain(argc, argv, "streamer", "NestQuant streamer: one per node; serves nq.v1.Streamer", nq::streamer::Run);
}
