// nq trace: routing traces of the model over token sequences; nq replay: how well slot
// allocation policies would have served a trace at 4 bits (DESIGN.md section 7).
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <optional>
#include <thread>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include <grpcpp/grpcpp.h>
#include "kernels/backend.h"
#include "nq/v1/worker.grpc.pb.h"
#include "services/common/internal_tls.h"
#include "services/common/status_grpc.h"
#include "services/common/status_macros.h"
#include "services/eval/gate_lookahead.h"
#include "services/format/release_reader.h"
#include "services/model/model.h"
#include "services/release/calibration.h"
#include "services/streamer/jf_model.h"
#include "services/streamer/replay.h"
#include "services/streamer/routing_trace.h"
#include "services/tools/commands.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(std::string, tokens);
ABSL_FLAG(std::string, trace, "", "replay: a routing trace written by nq trace");
ABSL_FLAG(std::string, release_dir, "", "replay: the NestQuant release (fixed sets and static rankings)");
ABSL_FLAG(int, slots, 8, "replay and kld: floating 4-bit slots per layer");
ABSL_FLAG(std::string, predictor, "",
          "replay: a learned predictor (jF safetensors) to replay instead of predictor v0, as nq-streamer "
          "--predictor runs it");
ABSL_FLAG(std::optional<double>, hysteresis, std::nullopt,
          "replay: the predictor's score margin (nq-streamer --hysteresis); unset: the predictor's own, as the "
          "streamer takes it");
ABSL_FLAG(int, read_budget, 64, "replay: most loads per refresh (nq-streamer --read_budget)");
ABSL_FLAG(std::string, depths, "1,2,3", "lookahead: the lookahead depths to measure, in layers");
ABSL_FLAG(int, landing_tokens, 0,
          "replay: decode tokens a load takes to land (an expert loaded at a block's start serves only after, the "
          "expert it replaces until then)");
ABSL_FLAG(int, refresh_interval, 16,
          "replay: tokens between the predictor's refreshes (the streamer's is 16, its workers' report interval); the "
          "oracle and previous-block policies use the same blocks");
ABSL_FLAG(double, request_share, 0.0,
          "replay: share of the floating slots kept for the current request's most-hit experts (nq-streamer "
          "--request_share)");
ABSL_FLAG(std::string, worker, "", "trace: host:port of a running nq-worker to record from (instead of --model)");
ABSL_FLAG(int64_t, trace_tokens, 0, "trace --worker: stop after this many tokens (0: until --seconds or Ctrl-C)");
ABSL_FLAG(double, seconds, 0, "trace --worker: stop after this many seconds (0: until --trace_tokens or Ctrl-C)");

namespace nq::tools {
namespace {

absl::Status RecordTrace(const std::string& model_dir, const std::string& tokens_path, const std::string& out) {
  ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> sequences, release::ReadTokenFile(tokens_path));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  int64_t longest = 1;
  for (const auto& s : sequences) longest = std::max<int64_t>(longest, static_cast<int64_t>(s.size()));
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> model,
                   model::Model::Load(model_dir, *backend, nullptr, {.max_tokens = longest}));
  const model::ModelConfig& config = model->config();
  streamer::RoutingTrace trace;
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.IsMoeLayer(l)) trace.layer_ids.push_back(static_cast<uint32_t>(l));
  }
  trace.experts_per_layer = static_cast<uint32_t>(config.n_routed_experts);
  trace.top_k = static_cast<uint32_t>(config.num_experts_per_tok);
  // One forward's routing, layer by layer, then appended token-major.
  std::vector<model::MoeRouting> per_layer;
  model->SetRoutingObserver([&](int64_t, const model::MoeRouting& routing) { per_layer.push_back(routing); });
  for (const std::vector<int32_t>& sequence : sequences) {
    if (sequence.empty()) continue;
    // Each line of the token file is one request: replay resets per-request state there.
    trace.sequence_starts.push_back(trace.num_tokens());
    per_layer.clear();
    model->ResetCache();
    RETURN_IF_ERROR(model->Forward(sequence).status());
    if (per_layer.size() != trace.layer_ids.size()) return absl::InternalError("a MoE layer reported no routing");
    for (size_t t = 0; t < sequence.size(); ++t) {
      for (const model::MoeRouting& r : per_layer) {
        for (uint32_t j = 0; j < trace.top_k; ++j) {
          trace.experts.push_back(static_cast<uint32_t>(r.experts[t * trace.top_k + j]));
          trace.weights.push_back(r.weights[t * trace.top_k + j]);
        }
        if (r.input_sq_norms.size() != sequence.size()) return absl::InternalError("routing without input norms");
        trace.input_sq_norms.push_back(r.input_sq_norms[t]);
      }
    }
  }
  RETURN_IF_ERROR(streamer::WriteTrace(trace, out));
  std::fprintf(stderr, "nq trace: %zu tokens x %u MoE layers -> %s\n", trace.num_tokens(), trace.num_layers(), out.c_str());
  return absl::OkStatus();
}

std::atomic<bool> interrupted{false};

// Records what a running worker routes (nq.v1.Worker WatchRouting) until `max_tokens`
// tokens, `seconds`, or Ctrl-C; writes whatever was recorded.
absl::Status RecordTraceFromWorker(const std::string& address, const std::string& out, int64_t max_tokens,
                                   double seconds) {
  // A worker behind mutual TLS takes the same --tls_ca/--tls_cert/--tls_key as the services.
  ASSIGN_OR_RETURN(std::shared_ptr<const InternalTls> tls, InternalTlsFromFlags());
  auto stub = nq::v1::Worker::NewStub(InternalChannel(address, tls.get()));
  nq::v1::WorkerInfo info;
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::Status status = stub->GetInfo(&context, {}, &info);
    if (!status.ok()) return Annotate(FromGrpcStatus(status), "GetInfo of worker " + address);
  }
  if (info.experts_per_layer() == 0) return absl::FailedPreconditionError("worker " + address + " serves no model");
  streamer::RoutingTrace trace;
  trace.experts_per_layer = info.experts_per_layer();
  grpc::ClientContext context;
  if (seconds > 0) {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000)));
  }
  signal(SIGINT, [](int) { interrupted = true; });
  std::thread canceller([&] {
    while (!interrupted.load()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    context.TryCancel();
  });
  std::unique_ptr<grpc::ClientReader<nq::v1::RoutingReport>> reader = stub->WatchRouting(&context, {});
  std::fprintf(stderr, "nq trace: recording from %s (%s)...\n", address.c_str(), info.model_id().c_str());
  nq::v1::RoutingReport report;
  std::optional<uint64_t> last_sequence_id;  // a new sequence_id starts a new trace sequence
  absl::Status appended;
  while (reader->Read(&report)) {
    appended = streamer::AppendRoutingReport(report, &trace, &last_sequence_id);
    if (!appended.ok()) break;
    if (max_tokens > 0 && static_cast<int64_t>(trace.num_tokens()) >= max_tokens) break;
  }
  interrupted = true;
  context.TryCancel();
  canceller.join();
  grpc::Status finished = reader->Finish();
  RETURN_IF_ERROR(appended);
  if (!finished.ok() && finished.error_code() != grpc::StatusCode::CANCELLED &&
      finished.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
    return Annotate(FromGrpcStatus(finished), "WatchRouting");
  }
  if (trace.num_tokens() == 0) return absl::UnavailableError("the worker ran no tokens while recording");
  RETURN_IF_ERROR(streamer::WriteTrace(trace, out));
  std::fprintf(stderr, "nq trace: %zu tokens x %u MoE layers -> %s\n", trace.num_tokens(), trace.num_layers(),
               out.c_str());
  return absl::OkStatus();
}

absl::Status ReplayTrace(const std::string& trace_path, const std::string& release_dir, int slots) {
  ASSIGN_OR_RETURN(streamer::RoutingTrace trace, streamer::ReadTrace(trace_path));
  streamer::PredictorOptions options;
  options.num_layers = trace.num_layers();
  options.experts_per_layer = trace.experts_per_layer;
  options.floating_slots = static_cast<uint32_t>(slots);
  options.read_budget = static_cast<uint32_t>(absl::GetFlag(FLAGS_read_budget));
  options.request_share = static_cast<float>(absl::GetFlag(FLAGS_request_share));
  options.refresh_interval = static_cast<uint32_t>(absl::GetFlag(FLAGS_refresh_interval));
  const int landing = absl::GetFlag(FLAGS_landing_tokens);
  options.top_k = trace.top_k;
  if (const std::string path = absl::GetFlag(FLAGS_predictor); !path.empty()) {
    ASSIGN_OR_RETURN(options.learned, streamer::JfModel::Load(path));
  }
  options.hysteresis_margin =
      static_cast<float>(absl::GetFlag(FLAGS_hysteresis).value_or(streamer::DefaultHysteresisMargin(options.learned.get())));
  if (!release_dir.empty()) {
    ASSIGN_OR_RETURN(format::Release release, format::Release::Open(release_dir));
    for (uint32_t layer : trace.layer_ids) {
      const format::ManifestLayer* ml = release.manifest().FindLayer(layer);
      if (ml == nullptr) return absl::FailedPreconditionError(absl::StrCat("the release has no layer ", layer));
      options.fixed.push_back(ml->fixed_4bit);
      options.static_ranking.push_back(ml->ranking);
    }
  }
  ASSIGN_OR_RETURN(streamer::ReplayResult r, streamer::Replay(trace, options, static_cast<uint32_t>(landing)));
  std::printf("%llu tokens in %zu sequences, %llu blocks of at most %u, %u MoE layers, %d floating slots per layer, "
              "%llu loads (%llu wanted), loads land after %d tokens\n",
              static_cast<unsigned long long>(r.tokens), trace.Sequences().size(),
              static_cast<unsigned long long>(r.blocks), options.refresh_interval, trace.num_layers(), slots,
              static_cast<unsigned long long>(r.predictor_loads), static_cast<unsigned long long>(r.predictor_wanted),
              landing);
  std::printf("| policy | expert calls at 4 bits | routing weight at 4 bits |\n| --- | ---: | ---: |\n");
  std::printf("| oracle (block's own top-F) | %.4f | %.4f |\n", r.oracle.calls, r.oracle.weight);
  std::printf("| previous block's top-F | %.4f | %.4f |\n", r.previous_block.calls, r.previous_block.weight);
  std::printf("| predictor %s (margin %.2f) | %.4f | %.4f |\n", options.learned ? "jF" : "v0", options.hysteresis_margin,
              r.predictor.calls, r.predictor.weight);
  return absl::OkStatus();
}

absl::Status MeasureLookahead(const std::string& model_dir, const std::string& tokens_path) {
  ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> sequences, release::ReadTokenFile(tokens_path));
  std::vector<int> depths;
  for (absl::string_view d : absl::StrSplit(absl::GetFlag(FLAGS_depths), ',', absl::SkipEmpty())) {
    int depth = 0;
    if (!absl::SimpleAtoi(d, &depth) || depth < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--depths: \"", d, "\" is not a depth >= 1"));
    }
    depths.push_back(depth);
  }
  if (depths.empty()) return absl::InvalidArgumentError("--depths names no depth");
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  int64_t longest = 1;
  for (const auto& s : sequences) longest = std::max<int64_t>(longest, static_cast<int64_t>(s.size()));
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> model,
                   model::Model::Load(model_dir, *backend, nullptr, {.max_tokens = longest}));
  std::printf("| depth (layers) | MoE layers scored | calls | lookahead recall | weight | previous token's experts | weight |\n"
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (int depth : depths) {
    ASSIGN_OR_RETURN(const eval::LookaheadReport r, eval::MeasureGateLookahead(*model, sequences, depth));
    std::printf("| %d | %zu | %lld | %.4f | %.4f | %.4f | %.4f |\n", depth, r.layers.size(),
                static_cast<long long>(r.lookahead.calls), r.lookahead.recall(), r.lookahead.weight_recall(),
                r.previous_token.recall(), r.previous_token.weight_recall());
    for (size_t i = 0; i < r.layers.size(); ++i) {
      std::printf("|   layer %lld | | %lld | %.4f | %.4f | | |\n", static_cast<long long>(r.layers[i]),
                  static_cast<long long>(r.per_layer[i].calls), r.per_layer[i].recall(), r.per_layer[i].weight_recall());
    }
  }
  return absl::OkStatus();
}

}  // namespace

int RunLookahead(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("lookahead", absl::InvalidArgumentError("unexpected argument " + args[0]));
  const std::string model = absl::GetFlag(FLAGS_model), tokens = absl::GetFlag(FLAGS_tokens);
  if (model.empty() || tokens.empty()) {
    return ReportCommandStatus("lookahead", absl::InvalidArgumentError("--model DIR and --tokens FILE are required"));
  }
  return ReportCommandStatus("lookahead", MeasureLookahead(model, tokens));
}

int RunTrace(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("trace", absl::InvalidArgumentError("unexpected argument " + args[0]));
  const std::string model = absl::GetFlag(FLAGS_model), tokens = absl::GetFlag(FLAGS_tokens),
                    out = absl::GetFlag(FLAGS_out);
  if (const std::string worker = absl::GetFlag(FLAGS_worker); !worker.empty()) {
    if (out.empty() || !model.empty()) {
      return ReportCommandStatus("trace", absl::InvalidArgumentError("--worker takes --out and no --model"));
    }
    return ReportCommandStatus("trace", RecordTraceFromWorker(worker, out, absl::GetFlag(FLAGS_trace_tokens),
                                                              absl::GetFlag(FLAGS_seconds)));
  }
  if (model.empty() || tokens.empty() || out.empty()) {
    return ReportCommandStatus("trace", absl::InvalidArgumentError("--model, --tokens FILE and --out are required"));
  }
  return ReportCommandStatus("trace", RecordTrace(model, tokens, out));
}

int RunReplay(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("replay", absl::InvalidArgumentError("unexpected argument " + args[0]));
  if (absl::GetFlag(FLAGS_trace).empty()) return ReportCommandStatus("replay", absl::InvalidArgumentError("--trace is required"));
  if (absl::GetFlag(FLAGS_slots) < 0) return ReportCommandStatus("replay", absl::InvalidArgumentError("--slots must be >= 0"));
  if (absl::GetFlag(FLAGS_read_budget) < 1 || absl::GetFlag(FLAGS_hysteresis).value_or(0) < 0 ||
      absl::GetFlag(FLAGS_landing_tokens) < 0 || absl::GetFlag(FLAGS_refresh_interval) < 1) {
    return ReportCommandStatus("replay", absl::InvalidArgumentError(
                                             "--read_budget and --refresh_interval must be >= 1, --hysteresis and --landing_tokens >= 0"));
  }
  return ReportCommandStatus("replay", ReplayTrace(absl::GetFlag(FLAGS_trace), absl::GetFlag(FLAGS_release_dir),
                                      absl::GetFlag(FLAGS_slots)));
}

}  // namespace nq::tools
