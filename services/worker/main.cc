// nq-worker: one per GPU (rank r of a tensor-parallel world). Creates the slot arena,
// registers it with nq-streamer, and serves nq.v1.Worker to the router (rank 0).
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "services/common/flag_checks.h"
#include "services/common/grpc_server.h"
#include "services/common/http_server.h"
#include "services/common/logging.h"
#include "services/common/metrics/registry.h"
#include "services/common/shared_memory.h"
#include "services/common/shutdown_signal.h"
#include "services/common/slot_geometry.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"
#include "services/tools/release_experts.h"
#include "services/worker/slot_table.h"
#include "services/worker/streamer_client.h"
#include "services/worker/worker_service.h"

ABSL_FLAG(std::string, host, "0.0.0.0", "Address to listen on");
ABSL_FLAG(int, grpc_port, 8100, "nq.v1.Worker gRPC port (router -> leader worker)");
ABSL_FLAG(int, metrics_port, 8101, "HTTP port for /metrics and /health");
ABSL_FLAG(std::string, streamer_address, "127.0.0.1:8200", "host:port of nq-streamer");
ABSL_FLAG(int, rank, 0, "Tensor-parallel rank of this worker");
ABSL_FLAG(int, world_size, 1, "Tensor-parallel world size");
ABSL_FLAG(std::string, backend, "cpu", "Compute backend: cpu or cuda");
ABSL_FLAG(std::string, model, "", "HF checkpoint directory to serve (config.json + safetensors); empty serves none");
ABSL_FLAG(std::string, served_model_name, "", "Model id reported to the router (default: the model directory's name)");
ABSL_FLAG(std::string, release, "",
          "NestQuant release of --model's routed experts (nq encode); empty serves the checkpoint's experts");
ABSL_FLAG(std::string, expert_bits, "fixed",
          "With --release: every expert at 2 or 4 bits, or 'fixed' (the manifest's fixed 4-bit set, the rest "
          "at 2 bits) until the streamer chooses them (issue #6)");
ABSL_FLAG(int64_t, max_model_len, 4096, "Context window: tokens of prompt + completion the KV cache holds");
// Slot-arena geometry. Once a NestQuant release is served (issue #5) it comes from the
// release's manifest; these flags set it until then.
ABSL_FLAG(int, first_moe_layer, 1, "Model layer id of the first MoE layer (dense layers before it)");
ABSL_FLAG(int, num_moe_layers, 3, "Number of MoE layers with slots");
ABSL_FLAG(int, experts_per_layer, 16, "Routed experts per MoE layer");
ABSL_FLAG(int, slots_per_layer, 4, "Residual slots per MoE layer");
ABSL_FLAG(int, fixed_slots_per_layer, 2, "Slots per layer pinned to the fixed 4-bit set");
ABSL_FLAG(int64_t, rec_bytes, 64 << 10, "Bytes of one residual record (multiple of 4096)");
ABSL_FLAG(double, drain_timeout_s, 30, "On SIGTERM, seconds to finish the running sequence");
ABSL_FLAG(std::string, log_level, "info", "trace, debug, info, warn, error or off");

namespace nq::worker {
namespace {

absl::StatusOr<SlotGeometry> GeometryFromFlags() {
  const int first = absl::GetFlag(FLAGS_first_moe_layer);
  const int layers = absl::GetFlag(FLAGS_num_moe_layers);
  const int64_t rec_bytes = absl::GetFlag(FLAGS_rec_bytes);
  if (first < 0 || layers <= 0 || absl::GetFlag(FLAGS_experts_per_layer) <= 0 ||
      absl::GetFlag(FLAGS_slots_per_layer) <= 0 || absl::GetFlag(FLAGS_fixed_slots_per_layer) < 0 ||
      rec_bytes <= 0) {
    return absl::InvalidArgumentError(
        "--first_moe_layer, --num_moe_layers, --experts_per_layer, --slots_per_layer, "
        "--fixed_slots_per_layer and --rec_bytes must be positive (first layer and fixed slots "
        "may be 0)");
  }
  std::vector<uint32_t> layer_ids;
  for (int i = 0; i < layers; ++i) layer_ids.push_back(static_cast<uint32_t>(first + i));
  SlotGeometry geometry = SlotGeometry::Packed(
      std::move(layer_ids), absl::GetFlag(FLAGS_slots_per_layer), static_cast<uint64_t>(rec_bytes),
      absl::GetFlag(FLAGS_experts_per_layer), absl::GetFlag(FLAGS_fixed_slots_per_layer));
  RETURN_IF_ERROR(geometry.Validate());
  return geometry;
}

absl::Status CheckFlags() {
  RETURN_IF_ERROR(CheckPortFlag("grpc_port", absl::GetFlag(FLAGS_grpc_port), true));
  RETURN_IF_ERROR(CheckPortFlag("metrics_port", absl::GetFlag(FLAGS_metrics_port), true));
  RETURN_IF_ERROR(CheckAddressFlag("streamer_address", absl::GetFlag(FLAGS_streamer_address)));
  RETURN_IF_ERROR(CheckPositiveSecondsFlag("drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s)));
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world_size);
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank=", rank, " --world_size=", world, ": want 0 <= rank < world_size"));
  }
  return absl::OkStatus();
}

std::string ArenaName(int rank) {
  // Unique per process and start, so a restarted worker never collides with a name a dead
  // predecessor left behind.
  std::mt19937_64 rng(std::random_device{}());
  return absl::StrFormat("/nq-arena-r%d-%d-%08x", rank, getpid(),
                         static_cast<uint32_t>(rng()));
}

absl::Status Run(ShutdownSignal& shutdown) {
  RETURN_IF_ERROR(CheckFlags());
  ASSIGN_OR_RETURN(SlotGeometry geometry, GeometryFromFlags());
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend,
                   kernels::CreateBackend(absl::GetFlag(FLAGS_backend)));
  const int rank = absl::GetFlag(FLAGS_rank);

  // The CPU backend's arena lives in POSIX shared memory that the streamer maps by name.
  ASSIGN_OR_RETURN(SharedMemory arena, SharedMemory::Create(ArenaName(rank), geometry.ArenaBytes()));
  metrics::Registry& registry = metrics::Registry::Default();
  registry.Gauge("nq_worker_slot_arena_bytes", "Bytes of this worker's slot arena").Get().Set(
      static_cast<double>(arena.size()));
  SlotTable table(geometry);

  // The model loads before any server starts: health is NOT_SERVING until it is ready.
  std::unique_ptr<model::Model> model;
  std::string model_id = absl::GetFlag(FLAGS_served_model_name);
  if (const std::string dir = absl::GetFlag(FLAGS_model); !dir.empty()) {
    if (absl::GetFlag(FLAGS_world_size) != 1) {
      return absl::UnimplementedError("--world_size > 1 across worker processes is not wired up yet");
    }
    if (absl::GetFlag(FLAGS_max_model_len) <= 0) return absl::InvalidArgumentError("--max_model_len must be positive");
    const auto started = std::chrono::steady_clock::now();
    const model::ModelOptions options{.max_tokens = absl::GetFlag(FLAGS_max_model_len)};
    if (const std::string release = absl::GetFlag(FLAGS_release); !release.empty()) {
      ASSIGN_OR_RETURN(tools::ExpertBits bits, tools::ParseExpertBits(absl::GetFlag(FLAGS_expert_bits)));
      ASSIGN_OR_RETURN(model, tools::LoadModelWithRelease(dir, release, bits, *backend, nullptr, options));
      spdlog::info("routed experts from release {} ({} bits)", release, absl::GetFlag(FLAGS_expert_bits));
    } else {
      ASSIGN_OR_RETURN(model, model::Model::Load(dir, *backend, nullptr, options));
    }
    if (model_id.empty()) model_id = std::filesystem::path(dir).lexically_normal().filename().string();
    if (model_id.empty()) model_id = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
    spdlog::info("loaded {} ({}) in {:.2f} s", dir, std::string(model::ArchitectureName(model->config().architecture)),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
  WorkerService service(WorkerIdentity{absl::GetFlag(FLAGS_backend), static_cast<uint32_t>(rank),
                                       static_cast<uint32_t>(absl::GetFlag(FLAGS_world_size)), model_id},
                        &table, model.get());
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> grpc_server,
                   GrpcServer::Start(GrpcServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_grpc_port),
                       .services = {&service},
                       .health_service_names = {"nq.v1.Worker"},
                   }));
  ASSIGN_OR_RETURN(std::unique_ptr<HttpServer> http_server,
                   HttpServer::Start(HttpServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_metrics_port),
                       .add_routes =
                           [&](httplib::Server& server) {
                             AddMetricsRoute(server, registry);
                             AddHealthRoute(server, [&] { return grpc_server->serving(); });
                           },
                   }));
  spdlog::info("nq-worker rank {}/{} ({} backend): gRPC on {}, metrics on :{}, arena {} ({} bytes)",
               rank, absl::GetFlag(FLAGS_world_size), backend->name(), grpc_server->address(),
               http_server->port(), arena.name(), arena.size());

  StreamerClientOptions client_options;
  client_options.address = absl::GetFlag(FLAGS_streamer_address);
  client_options.rank = static_cast<uint32_t>(rank);
  client_options.world_size = static_cast<uint32_t>(absl::GetFlag(FLAGS_world_size));
  client_options.arena_request.set_pid(static_cast<uint32_t>(getpid()));
  char hostname[256] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) == 0) client_options.arena_request.set_hostname(hostname);
  client_options.arena_request.mutable_shm()->set_name(arena.name());
  client_options.arena_request.mutable_shm()->set_bytes(arena.size());
  // SERVING once the streamer first accepts the arena: from then on the worker keeps serving
  // (at 2 bits) through streamer outages, as DESIGN.md section 4 requires.
  StreamerClient streamer(std::move(client_options), &table, [&](bool connected) {
    service.SetStreamerConnected(connected);
    if (connected && service.state() == nq::v1::WORKER_STATE_LOADING) {
      service.SetReady();
      grpc_server->SetServing(true);
    }
  });
  service.SetRoutingSink([&streamer](nq::v1::RoutingReport report) {
    streamer.EnqueueRoutingReport(std::move(report));
  });
  streamer.Start();

  shutdown.Wait();
  spdlog::info("signal {} received: draining (up to {} s)", shutdown.signal_number(),
               absl::GetFlag(FLAGS_drain_timeout_s));
  service.SetDraining();
  grpc_server->Drain(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(
                         absl::GetFlag(FLAGS_drain_timeout_s) * 1000)));
  streamer.Stop();
  http_server->Stop();
  spdlog::info("nq-worker stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace nq::worker

int main(int argc, char** argv) {
  if (absl::Status s = nq::ShutdownSignal::BlockTerminationSignals(); !s.ok()) {
    std::fprintf(stderr, "nq-worker: %s\n", s.ToString().c_str());
    return 1;
  }
  absl::SetProgramUsageMessage("NestQuant worker: one per GPU; serves nq.v1.Worker");
  absl::ParseCommandLine(argc, argv);
  if (absl::Status s = nq::InitLogging("worker", absl::GetFlag(FLAGS_log_level)); !s.ok()) {
    std::fprintf(stderr, "nq-worker: %s\n", s.ToString().c_str());
    return 2;
  }
  nq::ShutdownSignal shutdown;
  if (absl::Status s = nq::worker::Run(shutdown); !s.ok()) {
    spdlog::critical("nq-worker failed: {}", s.ToString());
    return 1;
  }
  return 0;
}
