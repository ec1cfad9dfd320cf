// nq-worker: one per GPU (rank r of a tensor-parallel world). Creates the slot arena,
// registers it with nq-streamer, and serves nq.v1.Worker to the router (rank 0).
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <string>
#include <string_view>

#include <spdlog/spdlog.h>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/backend.h"
#include "services/common/flag_checks.h"
#include "services/common/grpc_server.h"
#include "services/common/http_server.h"
#include "services/common/internal_tls.h"
#include "services/common/metrics/registry.h"
#include "services/common/service_main.h"
#include "services/common/shutdown_signal.h"
#include "services/common/slot_geometry.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"
#include "services/nvfp4/gate_up_repack.h"
#include "services/release/release_expert_decoder.h"
#include "services/release/release_experts.h"
#include "services/worker/arena_geometry.h"
#include "services/worker/context_capacity.h"
#include "services/worker/device_fit.h"
#include "services/worker/gpu_memory.h"
#include "services/worker/prefill_setup.h"
#include "services/worker/slot_arena_memory.h"
#include "services/worker/slot_runtime.h"
#include "services/worker/worker_mailbox.h"
#include "services/worker/slot_table.h"
#include "services/worker/streamer_client.h"
#include "services/worker/tp_follower.h"
#include "services/worker/tp_leader.h"
#include "services/worker/tp_transport.h"
#include "services/worker/worker_service.h"

ABSL_FLAG(std::string, host, "127.0.0.1",
          "Address to listen on (gRPC and /metrics); a non-loopback address needs mutual TLS (--tls_ca, --tls_cert, "
          "--tls_key) or --allow_plaintext_internal");
ABSL_FLAG(int, grpc_port, 8100, "nq.v1.Worker gRPC port (router -> leader worker)");
ABSL_FLAG(int, metrics_port, 8101, "HTTP port for /metrics and /health");
ABSL_FLAG(std::string, metrics_host, "",
          "Address for /metrics and /health (default: --host); e.g. 0.0.0.0 for scrapes and probes from other hosts "
          "while gRPC stays on loopback");
ABSL_FLAG(std::string, streamer_address, "127.0.0.1:8200", "host:port of nq-streamer");
ABSL_FLAG(int, rank, 0, "Tensor-parallel rank of this worker (with --node_rank: its rank within the node)");
ABSL_FLAG(int, node_rank, -1,
          "A group spanning nodes: this node's place (0 holds rank 0), e.g. a StatefulSet pod's index; the worker's "
          "rank is then node_rank x --ranks_per_node + --rank. -1: --rank is the rank");
ABSL_FLAG(int, ranks_per_node, 0, "With --node_rank: the ranks each node holds");
ABSL_FLAG(int, world_size, 1,
          "Tensor-parallel world size: ranks 0..W-1 run as processes on one host (collectives over shared memory "
          "on the cpu backend, over NCCL on cuda, one GPU per rank: --gpu); rank 0 serves the router, the others "
          "follow it");
ABSL_FLAG(std::string, leader_address, "127.0.0.1:8100",
          "Ranks > 0: host:port of rank 0's gRPC server; its port names the group (see --tp_group)");
ABSL_FLAG(std::string, tp_group, "",
          "Shared-memory name of the tensor-parallel group (default: nq-tp-<rank 0's gRPC port>); every rank "
          "of one group must use the same");
ABSL_FLAG(std::string, tp_control, "shm",
          "The tensor-parallel group's control channel (rendezvous, identity checks, step commands; on the cpu "
          "backend also the model's collectives): shm, one host's shared memory; tcp, a connection from every "
          "rank to rank 0 (--tp_control_port), so ranks may run on other hosts. Not encrypted: beyond loopback it "
          "needs --allow_plaintext_internal and a private network");
ABSL_FLAG(int, tp_control_port, 8190,
          "--tp_control=tcp: rank 0 listens on --host at this port; the other ranks connect to the host of "
          "--leader_address at it");
ABSL_FLAG(double, tp_timeout_s, 60,
          "Tensor parallelism: a collective whose ranks do not all arrive within this many seconds fails the "
          "request and breaks the group (a dead rank is detected at once, not after this)");
ABSL_FLAG(std::string, backend, "cpu", "Compute backend: cpu or cuda");
ABSL_FLAG(std::string, decode_gemv, "auto",
          "cuda: the decode GEMV of BF16 weight matrices: auto (the tensor cores for matrices that fill the GPU, "
          "fp32 FMAs for the rest), tensor or fma (one kernel for every matrix; an escape hatch and a measure)");
ABSL_FLAG(int, gpu, 0,
          "With --backend cuda: the CUDA device ordinal this worker runs on (as CUDA_VISIBLE_DEVICES numbers them); "
          "with --world_size > 1 each rank needs its own (NCCL refuses two ranks on one GPU)");
ABSL_FLAG(std::string, model, "", "HF checkpoint directory to serve (config.json + safetensors); empty serves none");
ABSL_FLAG(std::string, served_model_name, "", "Model id reported to the router (default: the model directory's name)");
ABSL_FLAG(std::string, release, "",
          "NestQuant release of --model's routed experts (nq encode); empty serves the checkpoint's experts");
ABSL_FLAG(std::string, expert_bits, "dynamic",
          "With --release: 'dynamic' (2-bit base; an expert runs at 4 bits while the streamer holds its residual "
          "in a READY slot), or a static choice without streaming: 2, 4, or 'fixed' (the manifest's fixed set at "
          "4 bits, the rest at 2)");
ABSL_FLAG(std::string, nvfp4_gate_up_scale, "compensate",
          "NVFP4 checkpoints: how each expert's gate and up halves share one global scale when fused "
          "(compensate: rescale the smaller half's block scales; requantize: requantize it; gate_only: "
          "the gate's global for both, the known serving bug, for measurement)");
ABSL_FLAG(bool, verify_release, true,
          "Hash the release's manifest, rank index and this rank's resident files before serving them (all cores; "
          "refuses a release whose bytes differ). Off only for a release just checked with nq verify");
ABSL_FLAG(int, slot_wait_tokens, 0,
          "During a request's first N steps, a step may wait for loads the streamer announced (0: never wait)");
ABSL_FLAG(double, slot_wait_ms, 20, "Longest wait per step for announced loads (with --slot_wait_tokens)");
ABSL_FLAG(bool, verify_slots, false,
          "Check each slot announced READY against its record in the release, and after every step re-hash READY "
          "slots and count any that changed (nq_worker_slot_integrity_failures_total; costs a read per load and a "
          "pass over the slots per step)");
ABSL_FLAG(int, speculative_tokens, -1,
          "MTP speculative decoding: draft tokens verified per decode step (0: off; -1: 3 when the checkpoint has an "
          "MTP layer and the backend is not cpu, else off). A positive count on a model without MTP weights is "
          "refused");
ABSL_FLAG(std::string, max_model_len, "4096",
          "Context window: tokens of prompt + completion the KV cache holds, or auto: as many as the memory free at "
          "start holds beside everything else the worker loads (less 10% headroom), up to the model's limit "
          "(one rank only)");
// f32 on every backend until the BF16 cache's accuracy has been measured on the served models
// (issue #13); bf16 halves the cache (twice the context per byte).
ABSL_FLAG(std::string, kv_cache_dtype, "f32",
          "Storage of the KV cache's MLA latent and rope key: f32, bf16 or fp8 (E4M3 latent rows with a scale "
          "per 128 values and a bf16 rope key); the DSA indexer keys stay f32");
// BF16 halves the weight matrices' memory and the bytes a decode step reads, and is exact for
// BF16 checkpoints; FP8 (128 x 128 block scales) halves them again and keeps an FP8 checkpoint's
// matrices as stored. f32 stays the default until the served models' outputs have been compared.
ABSL_FLAG(std::string, weight_dtype, "f32",
          "Storage of the weight matrices (projections, MLPs): f32, bf16 or fp8 (E4M3 with 128x128 block scales, "
          "the vocabulary heads and MLA absorption then bf16; norms, router and embedding stay f32)");
// Graphs are what a GPU decode step needs (one launch instead of hundreds); off only to compare.
ABSL_FLAG(bool, step_graphs, true,
          "Run decode steps (up to 4 tokens: a plain step or an MTP verification) as captured CUDA graphs");
// Results are equal with it off; off only to compare the step time.
ABSL_FLAG(bool, side_streams, true,
          "Run a layer's independent ops (an MoE layer's shared expert and routing log copies, the new keys' norms and "
          "cache writes) on a second stream beside the rest (the CUDA backend; the CPU runs them in order)");
// Results are equal either way (the CPU suite; on an H100 the GLM-5 slice's greedy tokens, and the
// kernel's tests under memcheck); on there +0.8-2.4 % tokens/s (bench/README.md, "The
// thirty-sixth and thirty-seventh sessions' changes on an H100"). Off only to compare.
ABSL_FLAG(bool, fused_residual_norm, true,
          "Add each block's residual in the next RmsNorm's kernel instead of by Adds of its own (two or three "
          "launches fewer a layer on the CUDA backend; the CPU runs the same ops either way)");
// On by default: on the H200 the in-graph draw picks the host Sampler's tokens (greedy and seeded
// draws, scripts/device/profile_decode_step.sh's "sampling" section) and saves the logits' trip;
// off only to compare.
ABSL_FLAG(bool, device_sampling, true,
          "Sample plain decode steps inside their CUDA graph (greedy, temperature, top-k, top-p; not for "
          "requests with logprobs, logit_bias or penalties): only the token crosses to the host");
// On by default: on an H100 a penalised seeded request on the GLM-5 slice drew the host's tokens
// from the captured graph's added row, at 1.28x the host path's tokens/s (bench/README.md, "The thirty-sixth
// and thirty-seventh sessions' changes on an H100"); on the CPU the graph body runs uncaptured in the tests
// (SampledSpeculationTest.BiasAndPenaltyRequestsDrawInTheGraphAsTheHostDoes). Off only to compare.
ABSL_FLAG(bool, device_logit_adjust, true,
          "With --device_sampling, requests with logit_bias or presence/frequency penalties (no logprobs) also "
          "draw inside the step graph, their adjustments added to the logits there");
// auto = on for a CUDA worker that streams experts alone (its steps are graphs, which take changes
// only through device-visible memory); the CPU backend applies between steps unless asked.
ABSL_FLAG(std::string, slot_mailbox, "auto",
          "Take slot-table changes inside decode steps through a shared-memory mailbox the streamer posts to "
          "(DESIGN.md section 4): on, off, or auto (on for a CUDA worker streaming experts with --world_size=1). "
          "Needs --expert_bits=dynamic and --world_size=1");
// Gate lookahead (issue #21): off by default. On glm5_nano (bench/README.md, "Gate lookahead in
// serving") it adds host routing of every layer to each forward and turns off step graphs.
ABSL_FLAG(int, lookahead_layers, 0,
          "Gate lookahead within a token: during decode, report layer L+D's predicted experts to the streamer as "
          "soon as layer L has run, so their residuals may load before layer L+D runs (0 = off). Pays off with "
          "--slot_mailbox=on, where loads that land mid-token serve the token's later layers");
// Slot-arena geometry. With --release the MoE layers, experts and record size come from the
// release and the fixed slots default to its fixed sets; without one these flags set it.
ABSL_FLAG(int, first_moe_layer, 1, "Without --release: model layer id of the first MoE layer");
ABSL_FLAG(int, num_moe_layers, 3, "Without --release: number of MoE layers with slots");
ABSL_FLAG(int, experts_per_layer, 16, "Without --release: routed experts per MoE layer");
ABSL_FLAG(int, slots_per_layer, -1,
          "Residual slots per MoE layer: the fixed set's, F floating, and one staging slot (-1: with --release, the "
          "fixed set + 2 x num_experts_per_tok floating + 1 staging; without, 4). With streaming on, a value that "
          "leaves no floating slot is refused");
ABSL_FLAG(int, fixed_slots_per_layer, -1,
          "Slots per layer pinned to the fixed 4-bit set (-1: the release's largest fixed set; 2 without one)");
ABSL_FLAG(int64_t, rec_bytes, 64 << 10, "Without --release: bytes of one residual record (multiple of 4096)");
// Issue #23 (services/worker/prefill_setup.h).
ABSL_FLAG(int64_t, prefill_chunk_tokens, 2048,
          "Tokens per prefill chunk: bounds a prompt's activations; a cancelled request stops within one chunk");
ABSL_FLAG(int64_t, layer_major_prefill_tokens, 2048,
          "New prompt spans of at least this many tokens prefill layer by layer, each MoE layer's routed experts at 4 "
          "bits when a release is streamed (0: off)");
ABSL_FLAG(int64_t, prefill_expert_slots, -1,
          "Layer-major prefill: its own record slots for experts held at 4 bits, device memory kept for the worker's "
          "life (-1: all of a layer's; 0: none of its own). Slots borrowed from the free KV cache "
          "(--prefill_borrow_kv) come on top");
ABSL_FLAG(bool, prefill_borrow_kv, true,
          "Layer-major prefill: borrow extra expert slots from the free part of the KV cache past the span (up to a "
          "layer's every routed expert beyond --prefill_expert_slots), returned when the prefill ends. With "
          "--prefill_expert_slots=0 and this off, layer-major prefill runs at the decode precision");
ABSL_FLAG(int64_t, prefill_full_span_tokens, 32768,
          "Layer-major prefill: spans this long hold every routed expert they use at 4 bits; a shorter span its "
          "most-routed experts within a time budget once a prefill has been timed (what a layer's compute hides, "
          "plus --prefill_late_read_share), in proportion to its length before that");
ABSL_FLAG(double, prefill_late_read_share, 0.25,
          "Layer-major prefill: the share of a layer's compute that reads the prefetch missed may add (0.25 keeps a "
          "prefill at 0.8x or more of its all-2-bit speed; 0: the budget by span length only)");
ABSL_FLAG(double, drain_timeout_s, 30, "On SIGTERM, seconds to finish the running sequence");

namespace nq::worker {
namespace {

// The seed system's setting (issue #15): GLM-5.3 accepts 2.60 tokens per step with 3 drafts.
constexpr int kDefaultSpeculativeTokens = 3;
// Drafts past this many are almost never all accepted, and each costs a verification row.
constexpr int kMaxSpeculativeTokens = 16;

// --speculative_tokens resolved against the loaded model and the backend. Auto is off on the CPU
// backend: there a forward costs per row, so verifying 1 + 3 tokens costs 2.7 plain steps and
// drafts make glm5_nano 0.6-0.8x as fast (bench/README.md); a GPU decode step is bound by
// reading weights, which the extra rows share.
absl::StatusOr<int> SpeculativeTokens(const model::Model& model, std::string_view backend) {
  const int flag = absl::GetFlag(FLAGS_speculative_tokens);
  if (flag < -1 || flag > kMaxSpeculativeTokens) {
    return absl::InvalidArgumentError(absl::StrCat("--speculative_tokens=", flag, ": want -1 (auto), 0 (off) or 1..",
                                                   kMaxSpeculativeTokens));
  }
  if (!model.has_mtp()) {
    if (!model.mtp_missing().empty()) {
      if (flag > 0) {
        return absl::FailedPreconditionError(absl::StrCat("--speculative_tokens=", flag, ": ", model.mtp_missing()));
      }
      spdlog::warn("{}: serving without MTP speculative decoding", model.mtp_missing());
    } else if (flag > 0) {
      return absl::FailedPreconditionError(absl::StrCat("--speculative_tokens=", flag,
                                                        ": the model has no MTP layer (num_nextn_predict_layers is 0)"));
    }
    return 0;
  }
  if (flag >= 0) return flag;
  if (backend == "cpu") {
    spdlog::info("MTP layer present; speculative decoding off on the cpu backend by default (it is slower there: "
                 "bench/README.md); --speculative_tokens=N turns it on");
    return 0;
  }
  return kDefaultSpeculativeTokens;
}

// Without a release the arena only carries the slot protocol: the old fixed default.
constexpr int kSlotsWithoutRelease = 4;
constexpr int kFixedWithoutRelease = 2;

// With a release: sized from it (worker/arena_geometry.h), --slots_per_layer and
// --fixed_slots_per_layer overriding. `streaming`: the streamer will fill the floating slots,
// so an arena without one is refused rather than serving the fixed set alone in silence.
absl::StatusOr<SlotGeometry> GeometryFromFlags(const release::ReleaseExpertDecoder* decoder,
                                               const model::ModelConfig* config, bool streaming) {
  const int slots = absl::GetFlag(FLAGS_slots_per_layer);
  const int fixed = absl::GetFlag(FLAGS_fixed_slots_per_layer);
  const int first = absl::GetFlag(FLAGS_first_moe_layer);
  const int layers = absl::GetFlag(FLAGS_num_moe_layers);
  const int experts = absl::GetFlag(FLAGS_experts_per_layer);
  const int64_t rec_bytes = absl::GetFlag(FLAGS_rec_bytes);
  if (first < 0 || layers <= 0 || experts <= 0 || slots == 0 || slots < -1 || rec_bytes <= 0) {
    return absl::InvalidArgumentError(
        "--first_moe_layer, --num_moe_layers, --experts_per_layer, --slots_per_layer and --rec_bytes must be "
        "positive (the first layer may be 0; --slots_per_layer=-1 sizes the arena from the release)");
  }
  if (fixed < -1) return absl::InvalidArgumentError("--fixed_slots_per_layer must be >= 0, or -1 for the release's");
  if (decoder == nullptr) {
    std::vector<uint32_t> layer_ids;
    for (int i = 0; i < layers; ++i) layer_ids.push_back(static_cast<uint32_t>(first + i));
    SlotGeometry geometry = SlotGeometry::Packed(
        std::move(layer_ids), static_cast<uint32_t>(slots < 0 ? kSlotsWithoutRelease : slots),
        static_cast<uint64_t>(rec_bytes), static_cast<uint32_t>(experts),
        static_cast<uint32_t>(fixed < 0 ? kFixedWithoutRelease : fixed));
    RETURN_IF_ERROR(geometry.Validate());
    return geometry;
  }
  ArenaSizing sizing;
  if (slots > 0) sizing.slots_per_layer = static_cast<uint32_t>(slots);
  if (fixed >= 0) sizing.fixed_slots_per_layer = static_cast<uint32_t>(fixed);
  ASSIGN_OR_RETURN(SlotGeometry geometry, ReleaseArenaGeometry(*decoder, *config, sizing));
  if (streaming && geometry.FloatingSlots() == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--slots_per_layer=", geometry.slots_per_layer, " with ", geometry.fixed_slots_per_layer,
        " fixed slots per layer leaves no floating slot: the streamer could only load the fixed set and the "
        "predictor would place nothing. Leave --slots_per_layer unset to size the arena from the release (",
        geometry.fixed_slots_per_layer + DefaultFloatingSlots(*config) + kStagingSlotsPerLayer,
        " here), give at least ", geometry.fixed_slots_per_layer + 1, ", or serve the fixed set without streaming "
        "with --expert_bits=fixed"));
  }
  return geometry;
}

// The host the TCP control channel listens on (rank 0) or connects to (the others).
std::string TpControlHost(int rank) {
  if (rank == 0) return absl::GetFlag(FLAGS_host);
  const std::string leader = absl::GetFlag(FLAGS_leader_address);
  return leader.substr(0, leader.rfind(':'));
}

absl::Status CheckTpControlFlags(int rank) {
  const std::string control = absl::GetFlag(FLAGS_tp_control);
  if (control == "shm") return absl::OkStatus();
  if (control != "tcp") return absl::InvalidArgumentError(absl::StrCat("--tp_control=", control, ": want shm or tcp"));
  RETURN_IF_ERROR(CheckPortFlag("tp_control_port", absl::GetFlag(FLAGS_tp_control_port)));
  // The channel carries step commands (and on the cpu backend every activation) in the clear.
  if (const std::string host = TpControlHost(rank); !IsLoopbackHost(host) && !absl::GetFlag(FLAGS_allow_plaintext_internal)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--tp_control=tcp on ", host, " (beyond loopback) is not encrypted: pass --allow_plaintext_internal to run it "
        "on a private network"));
  }
  return absl::OkStatus();
}

absl::Status CheckFlags() {
  RETURN_IF_ERROR(CheckPortFlag("grpc_port", absl::GetFlag(FLAGS_grpc_port), true));
  RETURN_IF_ERROR(CheckPortFlag("metrics_port", absl::GetFlag(FLAGS_metrics_port), true));
  RETURN_IF_ERROR(CheckAddressFlag("streamer_address", absl::GetFlag(FLAGS_streamer_address)));
  RETURN_IF_ERROR(CheckPositiveSecondsFlag("drain_timeout_s", absl::GetFlag(FLAGS_drain_timeout_s)));
  if (absl::GetFlag(FLAGS_slot_wait_tokens) < 0 || absl::GetFlag(FLAGS_slot_wait_ms) < 0) {
    return absl::InvalidArgumentError("--slot_wait_tokens and --slot_wait_ms must not be negative");
  }
  if (const std::string bits = absl::GetFlag(FLAGS_expert_bits); bits != "dynamic" && !release::ParseExpertBits(bits).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--expert_bits=", bits, ": want dynamic, 2, 4 or fixed"));
  }
  if (const std::string kv = absl::GetFlag(FLAGS_kv_cache_dtype); !model::ParseKvCacheDType(kv).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_dtype=", kv, ": want f32, bf16 or fp8"));
  } else if (kv != "f32" && absl::GetFlag(FLAGS_model).empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--kv_cache_dtype=", kv, " needs --model (no model, no KV cache)"));
  }
  if (absl::GetFlag(FLAGS_gpu) < 0) return absl::InvalidArgumentError("--gpu must be a device ordinal (>= 0)");
  if (const std::string w = absl::GetFlag(FLAGS_weight_dtype); !model::ParseWeightDType(w).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--weight_dtype=", w, ": want f32, bf16 or fp8"));
  }
  const int rank = absl::GetFlag(FLAGS_rank);
  const int world = absl::GetFlag(FLAGS_world_size);
  if (world < 1 || rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rank=", rank, " --world_size=", world, ": want 0 <= rank < world_size"));
  }
  if (const int lookahead = absl::GetFlag(FLAGS_lookahead_layers); lookahead < 0) {
    return absl::InvalidArgumentError(absl::StrCat("--lookahead_layers=", lookahead, " is negative"));
  } else if (lookahead > 0 && world > 1) {
    // A group's slot changes apply at the step its leader names (and its streamer takes no
    // hints): nothing a hint loads could serve the token that sent it.
    return absl::InvalidArgumentError(absl::StrCat(
        "--lookahead_layers=", lookahead,
        " with --world_size > 1: a tensor-parallel group takes slot changes only between steps"));
  }
  if (world > 1) {
    RETURN_IF_ERROR(CheckAddressFlag("leader_address", absl::GetFlag(FLAGS_leader_address)));
    RETURN_IF_ERROR(CheckPositiveSecondsFlag("tp_timeout_s", absl::GetFlag(FLAGS_tp_timeout_s)));
    RETURN_IF_ERROR(CheckTpControlFlags(rank));
    if (absl::GetFlag(FLAGS_model).empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--world_size=", world, " needs --model (ranks shard a model)"));
    }
    // CPU: the group's shared memory carries the collectives; CUDA: NCCL (tp_transport.h).
    if (const std::string backend = absl::GetFlag(FLAGS_backend); backend != "cpu" && !HaveNcclDataPlane()) {
      return absl::UnimplementedError(absl::StrCat(
          "--world_size=", world, " --backend=", backend,
          ": this nq-worker was built without NCCL, which tensor parallelism on the GPU runs over; build the "
          "cuda preset where libnccl is found (worker processes on the cpu backend use shared memory)"));
    }
  }
  return absl::OkStatus();
}

// The group's shared-memory name: --tp_group, or one derived from rank 0's gRPC port, which
// every rank knows (rank 0 its own --grpc_port, the others --leader_address).
absl::StatusOr<std::string> TpGroupName() {
  if (const std::string name = absl::GetFlag(FLAGS_tp_group); !name.empty()) {
    return name.front() == '/' ? name : "/" + name;
  }
  if (absl::GetFlag(FLAGS_rank) == 0) return absl::StrCat("/nq-tp-", absl::GetFlag(FLAGS_grpc_port));
  const std::string leader = absl::GetFlag(FLAGS_leader_address);
  return absl::StrCat("/nq-tp-", leader.substr(leader.rfind(':') + 1));
}

// What the worker will hold in memory for this model (the GPU's, or the host's on the CPU
// backend) with a KV cache of ONE token, estimated from the checkpoint, config and release before
// anything is loaded: the cache is linear in its tokens (KvCache::BytesFor), so `kv_cache` is the
// bytes of a token and the rest does not depend on --max_model_len. Opening the checkpoint and
// the release maps their headers and indexes only; the release's files are hashed once, by the
// load that follows (--verify_release), not here too.
absl::StatusOr<DeviceBytesEstimate> EstimateWorkerBytesPerToken(const std::string& model_dir,
                                                                const std::string& release_dir, bool streaming,
                                                                const model::ModelOptions& options) {
  ASSIGN_OR_RETURN(const model::ModelConfig config, model::LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(const model::Checkpoint checkpoint, model::Checkpoint::Open(model_dir));
  std::unique_ptr<release::ReleaseExpertDecoder> decoder;
  uint64_t arena_bytes = 0;
  if (!release_dir.empty()) {
    absl::StatusOr<std::unique_ptr<release::ReleaseExpertDecoder>> opened =
        release::ReleaseExpertDecoder::Open(release_dir, model_dir, config, options.tp, /*verify=*/false);
    if (!opened.ok()) return Annotate(opened.status(), "release " + release_dir);
    decoder = *std::move(opened);
    if (streaming) {
      ASSIGN_OR_RETURN(const SlotGeometry geometry, GeometryFromFlags(decoder.get(), &config, streaming));
      arena_bytes = geometry.ArenaBytes();
    }
  }
  return EstimateDeviceBytes({.checkpoint = &checkpoint,
                              .config = &config,
                              .release = decoder != nullptr ? &decoder->release() : nullptr,
                              .rank = static_cast<uint32_t>(absl::GetFlag(FLAGS_rank)),
                              .max_tokens = 1,
                              .kv_cache_dtype = options.kv_cache_dtype,
                              .weight_dtype = options.weight_dtype,
                              .slot_arena_bytes = arena_bytes});
}

// A CUDA worker refuses before loading when the model would not fit (DESIGN.md: a clear error,
// not an out-of-memory failure minutes into the load).
absl::Status CheckFitsOnGpu(const kernels::Backend& backend, int gpu, const GpuMemory& memory,
                            DeviceBytesEstimate needed, int64_t max_tokens) {
  needed.kv_cache *= static_cast<uint64_t>(max_tokens);
  spdlog::info("GPU {} ({}): the model needs about {}; {:.2f} GiB free", gpu, backend.DeviceDescription(),
               needed.ToString(), static_cast<double>(memory.free) / (1 << 30));
  return CheckFitsOnDevice(needed, memory.free, memory.total,
                           absl::StrCat("GPU ", gpu, " (", backend.DeviceDescription(), ")"));
}

// --max_model_len=auto: what the free memory holds (AutoMaxModelLen) beside the rest of
// `per_token`'s estimate. One rank only: each rank would size its own, and a group's ranks must
// agree (the caller refuses auto with W > 1).
absl::StatusOr<int64_t> AutoMaxModelLenFor(const DeviceBytesEstimate& per_token, uint64_t free_bytes,
                                           const std::string& device, int64_t model_limit) {
  const uint64_t rest = per_token.total() - per_token.kv_cache;
  ASSIGN_OR_RETURN(const int64_t tokens, AutoMaxModelLen(free_bytes, rest, per_token.kv_cache, model_limit, device));
  spdlog::info("--max_model_len=auto: {} tokens ({:.2f} GiB free on {}, {:.2f} GiB for the rest of the model; the "
               "model's limit is {})",
               tokens, static_cast<double>(free_bytes) / (1 << 30), device, static_cast<double>(rest) / (1 << 30),
               model_limit);
  return tokens;
}

// What this rank's group is called and must agree on (services/worker/tp_identity.h).
absl::StatusOr<TpGroupOptions> TpOptions(const std::string& model_id, const release::ReleaseExpertDecoder* decoder,
                                         const std::atomic<bool>* stop, const TpDataPlaneFactory* data_plane,
                                         int64_t max_model_len) {
  TpGroupOptions options;
  options.data_plane = data_plane;
  ASSIGN_OR_RETURN(options.shm_name, TpGroupName());
  options.rank = absl::GetFlag(FLAGS_rank);
  if (absl::GetFlag(FLAGS_tp_control) == "tcp") {
    options.tcp_address = absl::StrCat(TpControlHost(options.rank), ":", absl::GetFlag(FLAGS_tp_control_port));
  }
  options.collective_timeout = absl::Seconds(absl::GetFlag(FLAGS_tp_timeout_s));
  options.stop = stop;
  TpIdentity& id = options.identity;
  id.model_id = model_id;
  ASSIGN_OR_RETURN(id.config_hash, ConfigHash(absl::GetFlag(FLAGS_model)));
  id.release_id = decoder != nullptr ? decoder->release().id() : "";
  id.expert_bits = decoder != nullptr ? absl::GetFlag(FLAGS_expert_bits) : "";
  id.world_size = absl::GetFlag(FLAGS_world_size);
  id.backend = absl::GetFlag(FLAGS_backend);
  id.weight_dtype = absl::GetFlag(FLAGS_weight_dtype);
  id.kv_cache_dtype = absl::GetFlag(FLAGS_kv_cache_dtype);
  id.max_model_len = max_model_len;
  return options;
}

// How this rank registers with the streamer: its rank, group, release (none with static expert
// bits: the streamer then loads nothing) and arena.
// Whether this worker takes slot-table changes through a mailbox (--slot_mailbox). `streams`:
// it serves a model whose experts stream (--expert_bits=dynamic).
absl::StatusOr<bool> UseSlotMailbox(bool on_gpu, bool streams, int world) {
  const std::string flag = absl::GetFlag(FLAGS_slot_mailbox);
  if (flag == "auto") return on_gpu && streams && world == 1;
  if (flag == "off") return false;
  if (flag != "on") return absl::InvalidArgumentError(absl::StrCat("--slot_mailbox=", flag, ": want on, off or auto"));
  if (!streams) return absl::InvalidArgumentError("--slot_mailbox=on needs a model whose experts stream (--expert_bits=dynamic)");
  if (world != 1) {
    return absl::InvalidArgumentError(
        "--slot_mailbox=on with --world_size > 1: a tensor-parallel group's changes must apply at the step its leader "
        "names, so they travel in its step commands");
  }
  return true;
}

StreamerClientOptions StreamerOptions(std::shared_ptr<const InternalTls> tls, const SlotArenaMemory& arena,
                                      const release::ReleaseExpertDecoder* streamed_release,
                                      const WorkerMailbox* mailbox = nullptr) {
  StreamerClientOptions client_options;
  client_options.address = absl::GetFlag(FLAGS_streamer_address);
  client_options.tls = std::move(tls);
  client_options.rank = static_cast<uint32_t>(absl::GetFlag(FLAGS_rank));
  client_options.world_size = static_cast<uint32_t>(absl::GetFlag(FLAGS_world_size));
  if (client_options.world_size > 1) client_options.tp_group = TpGroupName().value_or("");
  client_options.arena_request.set_pid(static_cast<uint32_t>(getpid()));
  char hostname[256] = {};
  if (gethostname(hostname, sizeof(hostname) - 1) == 0) client_options.arena_request.set_hostname(hostname);
  arena.Describe(client_options.arena_request);
  if (mailbox != nullptr) client_options.arena_request.mutable_slot_mailbox()->set_shm(mailbox->name());
  if (streamed_release != nullptr) client_options.release_id = streamed_release->release().id();
  return client_options;
}

// A follower's slots when it streams experts: the arena the streamer writes this rank's records
// into, the table the leader's relayed updates change, and the session that registers the arena
// and acknowledges unmaps (the group's updates reach it through the leader's step commands).
struct FollowerSlots {
  std::unique_ptr<SlotArenaMemory> arena;
  std::unique_ptr<SlotTable> table;
  std::unique_ptr<SlotRuntime> runtime;
  std::unique_ptr<StreamerClient> streamer;
};

absl::StatusOr<FollowerSlots> StartFollowerSlots(model::Model& model, const release::ReleaseExpertDecoder* decoder,
                                                 std::shared_ptr<const InternalTls> tls) {
  FollowerSlots slots;
  ASSIGN_OR_RETURN(SlotGeometry geometry, GeometryFromFlags(decoder, &model.config(), /*streaming=*/true));
  ASSIGN_OR_RETURN(slots.arena, SlotArenaMemory::CreateHost(absl::GetFlag(FLAGS_rank), geometry.ArenaBytes()));
  slots.table = std::make_unique<SlotTable>(geometry);
  SlotArenaMemory* arena = slots.arena.get();
  // No bounded wait for loads (--slot_wait_tokens): a follower's updates arrive with the command.
  slots.runtime = std::make_unique<SlotRuntime>(
      slots.table.get(), arena->host_view(), decoder,
      SlotRuntimeOptions{.verify_slots = absl::GetFlag(FLAGS_verify_slots),
                         .read_arena = [arena](uint64_t offset, std::span<std::byte> out) {
                           return arena->Read(offset, out);
                         }});
  slots.runtime->SetGroupRole(SlotRuntime::GroupRole::kFollower);
  model.SetSlotArena(ModelSlotArena(geometry, arena->base()));
  model.SetExpertSlotTables(slots.runtime->SlotTables());
  slots.streamer =
      std::make_unique<StreamerClient>(StreamerOptions(std::move(tls), *arena, decoder), slots.runtime.get(), nullptr);
  slots.streamer->Start();
  return slots;
}

// A rank > 0: no gRPC server (the router talks to rank 0); it follows rank 0's group until
// shutdown, and serves /metrics and /health (200 while it is in a formed group) on
// --metrics_port. With dynamic experts it has a slot arena and a streamer session of its own
// (StartFollowerSlots); with static bits, neither.
absl::Status RunFollower(ShutdownSignal& shutdown, model::Model& model, GroupCommunicator& group,
                         const std::string& model_id, const release::ReleaseExpertDecoder* decoder,
                         bool dynamic_experts, std::shared_ptr<const InternalTls> tls,
                         const TpDataPlaneFactory* data_plane) {
  std::atomic<bool> stop{false};
  ASSIGN_OR_RETURN(const TpGroupOptions options, TpOptions(model_id, decoder, &stop, data_plane, model.max_tokens()));
  metrics::Registry& registry = metrics::Registry::Default();
  FollowerSlots slots;
  if (dynamic_experts) {
    ASSIGN_OR_RETURN(slots, StartFollowerSlots(model, decoder, std::move(tls)));
  }
  auto& joined_gauge = registry.Gauge("nq_worker_tp_group_joined", "1 while this rank is in a formed tensor-parallel group").Get();
  std::atomic<bool> joined{false};
  ASSIGN_OR_RETURN(std::unique_ptr<HttpServer> http_server,
                   HttpServer::Start(HttpServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_metrics_port),
                       .add_routes =
                           [&](httplib::Server& server) {
                             AddMetricsRoute(server, registry, nullptr);
                             AddHealthRoute(server, [&] { return joined.load(); });
                           },
                   }));
  spdlog::info("nq-worker rank {}/{} (follower of group {}): metrics on :{}", options.rank,
               options.identity.world_size, options.shm_name, http_server->port());
  TpFollower follower(options, &group, &model, slots.runtime.get(), [&](bool now_joined) {
    joined = now_joined;
    joined_gauge.Set(now_joined ? 1 : 0);
  });
  absl::Status result;
  std::thread follow([&] {
    result = follower.Run();
    if (!result.ok()) shutdown.Trigger();  // refused: nothing to wait for
  });
  shutdown.Wait();
  stop = true;
  follow.join();
  if (slots.streamer != nullptr) slots.streamer->Stop();
  http_server->Stop();
  if (!result.ok()) return result;
  spdlog::info("nq-worker rank {} stopped", options.rank);
  return absl::OkStatus();
}

// --node_rank: --rank names the rank within the node; from here on FLAGS_rank is the group's.
absl::Status ResolveNodeRank() {
  const int node = absl::GetFlag(FLAGS_node_rank);
  if (node == -1) return absl::OkStatus();
  const int local = absl::GetFlag(FLAGS_rank);
  ASSIGN_OR_RETURN(int rank, GlobalRank(node, absl::GetFlag(FLAGS_ranks_per_node), local));
  absl::SetFlag(&FLAGS_rank, rank);
  spdlog::info("rank {} of the group: rank {} of node {} ({} ranks a node)", rank, local, node,
               absl::GetFlag(FLAGS_ranks_per_node));
  return absl::OkStatus();
}

absl::Status Run(ShutdownSignal& shutdown) {
  RETURN_IF_ERROR(ResolveNodeRank());
  RETURN_IF_ERROR(CheckFlags());
  // Who may call this worker, settled before the (possibly long) model load: a bad certificate
  // or a plain-text address beyond loopback fails the start at once.
  ASSIGN_OR_RETURN(std::shared_ptr<const InternalTls> tls, InternalTlsFromFlags());
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   InternalServerCredentials("nq-worker", absl::GetFlag(FLAGS_host), tls.get(),
                                             absl::GetFlag(FLAGS_allow_plaintext_internal)));
  const int gpu = absl::GetFlag(FLAGS_gpu);
  const int world = absl::GetFlag(FLAGS_world_size);
  // Ranks on one host share its cores.
  const int cpu_threads =
      world > 1 ? std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / world) : 0;
  const absl::StatusOr<kernels::DecodeGemv> decode_gemv = kernels::ParseDecodeGemv(absl::GetFlag(FLAGS_decode_gemv));
  if (!decode_gemv.ok()) return Annotate(decode_gemv.status(), "--decode_gemv");
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend,
                   kernels::CreateBackend(absl::GetFlag(FLAGS_backend),
                                          {.device = gpu, .cuda_decode_gemv = *decode_gemv, .cpu_threads = cpu_threads}));
  // The CUDA backend keeps the model, KV cache and (streaming) the slot arena on the GPU.
  const bool on_gpu = backend->name() == "cuda";
  if (on_gpu) spdlog::info("GPU {}: {}", gpu, backend->DeviceDescription());
  const int rank = absl::GetFlag(FLAGS_rank);
  metrics::Registry& registry = metrics::Registry::Default();

  // The model loads before any server starts: health is NOT_SERVING until it is ready.
  std::unique_ptr<model::Model> model;
  std::unique_ptr<release::ReleaseExpertDecoder> decoder;
  bool dynamic_experts = false;
  std::string model_id = absl::GetFlag(FLAGS_served_model_name);
  // With W > 1 the model's collectives go through the group rank 0 forms (and re-forms), over
  // its shared memory (CPU) or NCCL on this backend's stream (CUDA).
  std::unique_ptr<GroupCommunicator> group;
  std::unique_ptr<TpDataPlaneFactory> data_plane;
  if (world > 1) {
    group = std::make_unique<GroupCommunicator>(rank, world);
    ASSIGN_OR_RETURN(data_plane, TpDataPlaneFor(*backend, gpu, absl::Seconds(absl::GetFlag(FLAGS_tp_timeout_s))));
  }
  if (const std::string dir = absl::GetFlag(FLAGS_model); !dir.empty()) {
    const auto started = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(const kernels::DType kv_cache_dtype, model::ParseKvCacheDType(absl::GetFlag(FLAGS_kv_cache_dtype)));
    ASSIGN_OR_RETURN(const kernels::DType weight_dtype, model::ParseWeightDType(absl::GetFlag(FLAGS_weight_dtype)));
    model::ModelOptions options{.max_tokens = 0,  // --max_model_len, below
                                .tp = {rank, world},
                                .kv_cache_dtype = kv_cache_dtype,
                                .weight_dtype = weight_dtype,
                                .step_graphs = absl::GetFlag(FLAGS_step_graphs),
                                .side_streams = absl::GetFlag(FLAGS_side_streams),
                                .fused_residual_norm = absl::GetFlag(FLAGS_fused_residual_norm)};
    const std::string release = absl::GetFlag(FLAGS_release);
    const std::string bits_flag = absl::GetFlag(FLAGS_expert_bits);
    dynamic_experts = !release.empty() && bits_flag == "dynamic";
    // Dynamic experts load at 2 bits; the slots the streamer fills raise them to 4.
    ASSIGN_OR_RETURN(release::ExpertBits bits, release.empty() || dynamic_experts
                                                   ? release::ExpertBits::k2Bit
                                                   : release::ParseExpertBits(bits_flag));
    ASSIGN_OR_RETURN(const nvfp4::GateUpScaleMode gate_up,
                     nvfp4::ParseGateUpScaleMode(absl::GetFlag(FLAGS_nvfp4_gate_up_scale)));
    ASSIGN_OR_RETURN(const std::optional<int64_t> max_model_len, ParseMaxModelLen(absl::GetFlag(FLAGS_max_model_len)));
    if (!max_model_len.has_value() && world > 1) {
      return absl::InvalidArgumentError(
          "--max_model_len=auto sizes one rank's cache; a tensor-parallel group's ranks must agree: give a number");
    }
    options.max_tokens = max_model_len.value_or(0);  // 0: auto, sized below
    if (on_gpu || options.max_tokens == 0) {
      // One estimate serves both the auto size and the fit check.
      ASSIGN_OR_RETURN(const DeviceBytesEstimate per_token,
                       EstimateWorkerBytesPerToken(dir, release, dynamic_experts, options));
      std::optional<GpuMemory> gpu_memory;
      if (on_gpu) {
        ASSIGN_OR_RETURN(gpu_memory, QueryGpuMemory(gpu));
      }
      if (options.max_tokens == 0) {
        ASSIGN_OR_RETURN(const uint64_t free_bytes, on_gpu ? absl::StatusOr<uint64_t>(gpu_memory->free)
                                                           : HostAvailableBytes());
        ASSIGN_OR_RETURN(const model::ModelConfig config, model::LoadModelConfig(dir));
        ASSIGN_OR_RETURN(options.max_tokens,
                         AutoMaxModelLenFor(per_token, free_bytes, on_gpu ? absl::StrCat("GPU ", gpu) : "the host",
                                            config.max_position_embeddings));
      }
      if (on_gpu) RETURN_IF_ERROR(CheckFitsOnGpu(*backend, gpu, *gpu_memory, per_token, options.max_tokens));
    }
    ASSIGN_OR_RETURN(release::ServedModel served, release::LoadServedModel(dir, release, bits, *backend, group.get(),
                                                                           options, {.gate_up = gate_up}));
    model = std::move(served.model);
    decoder = std::move(served.decoder);
    if (!release.empty()) {
      spdlog::info("routed experts from release {} ({})", release,
                   dynamic_experts ? "2-bit base, 4 bits from READY slots" : bits_flag + " bits, no streaming");
    }
    if (model_id.empty()) model_id = std::filesystem::path(dir).lexically_normal().filename().string();
    if (model_id.empty()) model_id = std::filesystem::path(dir).lexically_normal().parent_path().filename().string();
    spdlog::info("loaded {} ({}, weight matrices {}) in {:.2f} s; KV cache {} tokens, latent {}", dir,
                 std::string(model::ArchitectureName(model->config().architecture)),
                 std::string(kernels::DTypeName(options.weight_dtype)),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(),
                 model->max_tokens(), kernels::DTypeName(model->kv_cache_dtype()));
  } else if (!absl::GetFlag(FLAGS_release).empty()) {
    return absl::InvalidArgumentError("--release needs --model");
  }
  if (rank > 0) {
    return RunFollower(shutdown, *model, *group, model_id, decoder.get(), dynamic_experts, tls, data_plane.get());
  }
  ASSIGN_OR_RETURN(SlotGeometry geometry,
                   GeometryFromFlags(decoder.get(), model != nullptr ? &model->config() : nullptr, dynamic_experts));
  if (decoder != nullptr) {
    spdlog::info("slot arena: {} MoE layers (MTP layers get none) x {} slots: {} fixed, {} floating, {} staging",
                 geometry.moe_layer_ids.size(), geometry.slots_per_layer, geometry.fixed_slots_per_layer,
                 geometry.FloatingSlots(),
                 geometry.slots_per_layer - geometry.fixed_slots_per_layer - geometry.FloatingSlots());
  }

  // Where the streamer writes residuals: device memory it opens through CUDA IPC when a CUDA
  // worker streams, else POSIX shared memory it maps by name (the CPU backend; and a worker with
  // static expert bits, whose arena only carries the slot protocol).
  std::unique_ptr<SlotArenaMemory> arena;
  if (on_gpu && dynamic_experts) {
    ASSIGN_OR_RETURN(arena, SlotArenaMemory::CreateDevice(gpu, geometry.ArenaBytes()));
  } else {
    ASSIGN_OR_RETURN(arena, SlotArenaMemory::CreateHost(rank, geometry.ArenaBytes()));
  }
  registry.Gauge("nq_worker_slot_arena_bytes", "Bytes of this worker's slot arena").Get().Set(
      static_cast<double>(arena->bytes()));
  ASSIGN_OR_RETURN(const bool use_mailbox, UseSlotMailbox(on_gpu, dynamic_experts && model != nullptr, world));
  std::unique_ptr<WorkerMailbox> mailbox;
  if (use_mailbox) {
    ASSIGN_OR_RETURN(mailbox, WorkerMailbox::Create(geometry, rank, on_gpu ? std::optional<int>(gpu) : std::nullopt));
    spdlog::info("slot mailbox {}: slot-table changes apply inside decode steps", mailbox->mailbox().name());
  }
  SlotTable table(geometry);
  SlotRuntime slots(&table, arena->host_view(), dynamic_experts ? decoder.get() : nullptr,
                    SlotRuntimeOptions{
                        .wait_tokens = static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_slot_wait_tokens))),
                        .wait_per_step = absl::Milliseconds(absl::GetFlag(FLAGS_slot_wait_ms)),
                        .verify_slots = absl::GetFlag(FLAGS_verify_slots),
                        .read_arena = [&arena](uint64_t offset, std::span<std::byte> out) {
                          return arena->Read(offset, out);
                        },
                        .mailbox = mailbox != nullptr ? &mailbox->mailbox() : nullptr,
                    });
  // A group's leader applies the streamer's updates only at step starts and relays them to the
  // other ranks in the step command (slot_runtime.h).
  if (world > 1 && dynamic_experts) slots.SetGroupRole(SlotRuntime::GroupRole::kLeader);
  if (model != nullptr && dynamic_experts) {
    // The kernels read residuals in place from the arena the streamer writes. A step reads the
    // slot table once, between steps, and ends synchronised with the device (its logits come
    // back), so a slot the worker acks as unmapped is no longer being read on the GPU.
    model->SetSlotArena(ModelSlotArena(geometry, arena->base()));
    model->SetExpertSlotTables(slots.SlotTables());
    if (mailbox != nullptr) RETURN_IF_ERROR(model->SetSlotMailbox(mailbox->all_rows(), mailbox->layers()));
  }
  if (model != nullptr) {
    // Routed experts in memory: the packed codes, scales and tables (plus any records a layer
    // keeps), and the slot arena. Nothing else holds expert weights.
    auto& expert_bytes = registry.Gauge("nq_worker_routed_expert_bytes",
                                        "Bytes of routed-expert weights held, by where they live", {"kind"});
    expert_bytes.WithLabels({"resident"}).Set(static_cast<double>(model->RoutedExpertBytes()));
    expert_bytes.WithLabels({"slots"}).Set(dynamic_experts ? static_cast<double>(arena->bytes()) : 0.0);
    registry.Gauge("nq_worker_kv_cache_bytes", "Bytes of the KV cache (latent, rope and indexer keys)")
        .Get()
        .Set(static_cast<double>(model->kv_cache_bytes()));
  }
  // The GPU's memory as the driver reports it, read at each scrape.
  std::function<void()> before_scrape;
  if (on_gpu) {
    auto& gpu_bytes = registry.Gauge("nq_worker_gpu_memory_bytes", "Memory of this worker's GPU", {"kind"});
    before_scrape = [&gpu_bytes, gpu] {
      absl::StatusOr<GpuMemory> memory = QueryGpuMemory(gpu);
      if (!memory.ok()) return;
      gpu_bytes.WithLabels({"total"}).Set(static_cast<double>(memory->total));
      gpu_bytes.WithLabels({"free"}).Set(static_cast<double>(memory->free));
      gpu_bytes.WithLabels({"used"}).Set(static_cast<double>(memory->total - memory->free));
    };
    before_scrape();
  }

  WorkerService service(WorkerIdentity{absl::GetFlag(FLAGS_backend), static_cast<uint32_t>(rank),
                                       static_cast<uint32_t>(absl::GetFlag(FLAGS_world_size)), model_id,
                                       decoder != nullptr ? decoder->release().id() : ""},
                        &slots, model.get());
  // Rank 0 of a group: sequences hold the group and mirror their steps to the other ranks.
  std::atomic<bool> tp_stop{false};
  std::unique_ptr<TpLeader> tp_leader;
  std::atomic<bool> group_ready{world == 1};
  std::function<void()> update_serving = [] {};  // set once the gRPC server exists
  // Set once the streamer client exists: a newly formed group whose leader had to clear its slot
  // table registers again, so the streamer adopts the empty table.
  std::atomic<StreamerClient*> resync_streamer{nullptr};
  if (world > 1) {
    ASSIGN_OR_RETURN(const TpGroupOptions tp_options, TpOptions(model_id, decoder.get(), &tp_stop, data_plane.get(), model->max_tokens()));
    // on_ready is set below, once the servers it drives exist; the manager starts after that.
    auto& formed = registry.Gauge("nq_worker_tp_group_ready", "1 while this leader's tensor-parallel group is formed")
                       .Get();
    auto& reformed = registry.Counter("nq_worker_tp_groups_formed_total",
                                      "Tensor-parallel groups this leader formed (more than 1: a rank came back)")
                         .Get();
    formed.Set(0);
    tp_leader = std::make_unique<TpLeader>(tp_options, group.get(), [&](bool ready) {
      group_ready = ready;
      formed.Set(ready ? 1 : 0);
      if (ready) reformed.Increment();
      // Every rank of the new group starts from an empty slot table (the followers clear theirs
      // when they join); no sequence runs while the manager forms a group.
      if (ready && dynamic_experts && slots.ResetForNewGroup()) {
        if (StreamerClient* client = resync_streamer.load(); client != nullptr) client->Resync();
      }
      update_serving();
    });
    service.SetTensorParallelLeader(tp_leader.get());
  }
  service.SetDeviceSampling(absl::GetFlag(FLAGS_device_sampling));
  service.SetDeviceLogitAdjust(absl::GetFlag(FLAGS_device_logit_adjust));
  if (model != nullptr) {
    ASSIGN_OR_RETURN(const int speculative_tokens, SpeculativeTokens(*model, backend->name()));
    RETURN_IF_ERROR(service.EnableSpeculation(speculative_tokens));
    spdlog::info("speculative decoding: {}", speculative_tokens > 0
                                                 ? absl::StrCat(speculative_tokens, " MTP draft tokens per step")
                                                 : std::string("off"));
  }
  // Before serving: no request runs yet, so the model's observer is set race-free. Hints go to
  // the streamer session once it exists (resync_streamer; dropped and counted before and after).
  auto send_hint = [&resync_streamer](nq::v1::LookaheadHint hint) {
    StreamerClient* client = resync_streamer.load();
    return client != nullptr && client->EnqueueLookaheadHint(std::move(hint));
  };
  RETURN_IF_ERROR(service.EnableLookahead(absl::GetFlag(FLAGS_lookahead_layers), send_hint));
  if (absl::GetFlag(FLAGS_lookahead_layers) > 0 && !dynamic_experts) {
    // Still predicted and sent (the streamer counts them): what lookahead costs a step, alone.
    spdlog::warn("gate lookahead with --expert_bits={}: every expert's precision is fixed, so the hints load nothing",
                 absl::GetFlag(FLAGS_expert_bits));
  } else if (absl::GetFlag(FLAGS_lookahead_layers) > 0) {
    spdlog::info("gate lookahead: layer L+{}'s predicted experts go to the streamer as soon as layer L ran{}",
                 absl::GetFlag(FLAGS_lookahead_layers),
                 mailbox != nullptr ? " (slot mailbox: applied before every MoE layer)"
                                    : " (changes apply between steps: hinted loads serve later tokens only)");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<release::PrefillExperts> prefill_experts,
                   ConfigurePrefill(service, model.get(), dynamic_experts ? decoder.get() : nullptr, &slots, *backend,
                                    {.chunk_tokens = absl::GetFlag(FLAGS_prefill_chunk_tokens),
                                     .layer_major_min_tokens = absl::GetFlag(FLAGS_layer_major_prefill_tokens),
                                     .expert_slots = absl::GetFlag(FLAGS_prefill_expert_slots),
                                     .borrow_kv = absl::GetFlag(FLAGS_prefill_borrow_kv),
                                     .full_span_tokens = absl::GetFlag(FLAGS_prefill_full_span_tokens),
                                     .late_read_share = absl::GetFlag(FLAGS_prefill_late_read_share)}));
  if (model != nullptr) {
    const absl::StatusOr<GpuMemory> gpu_memory = on_gpu ? QueryGpuMemory(gpu) : absl::StatusOr<GpuMemory>(GpuMemory{});
    const uint64_t free_bytes = on_gpu ? (gpu_memory.ok() ? gpu_memory->free : 0) : HostAvailableBytes().value_or(0);
    ReportContextCapacity(MeasureContextCapacity(*model, free_bytes),
                          on_gpu ? absl::StrCat("GPU ", gpu) : std::string("the host"), registry);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcServer> grpc_server,
                   GrpcServer::Start(GrpcServerOptions{
                       .host = absl::GetFlag(FLAGS_host),
                       .port = absl::GetFlag(FLAGS_grpc_port),
                       .services = {&service},
                       .health_service_names = {"nq.v1.Worker"},
                       .credentials = std::move(credentials),
                   }));
  ASSIGN_OR_RETURN(std::unique_ptr<HttpServer> http_server,
                   HttpServer::Start(HttpServerOptions{
                       .host = absl::GetFlag(FLAGS_metrics_host).empty() ? absl::GetFlag(FLAGS_host)
                                                                         : absl::GetFlag(FLAGS_metrics_host),
                       .port = absl::GetFlag(FLAGS_metrics_port),
                       .add_routes =
                           [&](httplib::Server& server) {
                             AddMetricsRoute(server, registry, before_scrape);
                             AddHealthRoute(server, [&] { return grpc_server->serving(); });
                           },
                   }));
  spdlog::info("nq-worker rank {}/{} ({} backend): gRPC on {}, metrics on :{}, arena {} ({} bytes)",
               rank, absl::GetFlag(FLAGS_world_size), backend->name(), grpc_server->address(),
               http_server->port(), arena->name(), arena->bytes());
  // SERVING once the streamer first accepts the arena (from then on the worker keeps serving,
  // at 2 bits, through streamer outages, as DESIGN.md section 4 requires) and, with W > 1,
  // while the tensor-parallel group is formed: a group missing a rank cannot compute.
  std::atomic<bool> streamer_accepted{false};
  std::mutex serving_mu;
  update_serving = [&] {
    std::lock_guard<std::mutex> lock(serving_mu);
    const bool serve = streamer_accepted && group_ready;
    if (serve && service.state() == nq::v1::WORKER_STATE_LOADING) service.SetReady();
    if (service.state() == nq::v1::WORKER_STATE_READY) grpc_server->SetServing(serve);
  };
  if (tp_leader != nullptr) tp_leader->Start();

  // A worker with static expert bits asks for no loads: the streamer sees no release id.
  StreamerClient streamer(StreamerOptions(tls, *arena, dynamic_experts ? decoder.get() : nullptr, mailbox.get()), &slots,
                          [&](bool connected) {
    service.SetStreamerConnected(connected);
    if (connected && !streamer_accepted.exchange(true)) update_serving();
  });
  service.SetRoutingSink([&streamer](nq::v1::RoutingReport report) {
    streamer.EnqueueRoutingReport(std::move(report));
  });
  resync_streamer = &streamer;
  streamer.Start();

  shutdown.Wait();
  spdlog::info("signal {} received: draining (up to {} s)", shutdown.signal_number(),
               absl::GetFlag(FLAGS_drain_timeout_s));
  service.SetDraining();
  grpc_server->Drain(std::chrono::system_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(
                         absl::GetFlag(FLAGS_drain_timeout_s) * 1000)));
  resync_streamer = nullptr;
  streamer.Stop();
  // The other ranks go back to waiting for a group (a restarted rank 0 forms it again).
  tp_stop = true;
  tp_leader.reset();
  http_server->Stop();
  spdlog::info("nq-worker stopped");
  return absl::OkStatus();
}

}  // namespace
}  // namespace nq::worker

int main(int argc, char** argv) {
  return nq::ServiceMain(argc, argv, "worker", "NestQuant worker: one per GPU; serves nq.v1.Worker", nq::worker::Run);
}
