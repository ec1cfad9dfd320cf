// nq kld --nvfp4 (issue #20): KL(teacher || the model served from an NVFP4 checkpoint), the
// student loaded by the worker's own loader (release::LoadServedModel: routed experts packed,
// through Backend::Nvfp4Moe, gate/up fused as the worker's --nvfp4_gate_up_scale says), both
// teacher-forced over the same windows (kld_harness.h) on the CPU backend.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "services/eval/kld_harness.h"
#include "services/nvfp4/gate_up_repack.h"

namespace nq::eval {

struct Nvfp4KldRequest {
  std::string teacher_dir;  // the full-precision HF checkpoint the NVFP4 one was quantized from
  std::string nvfp4_dir;    // the NVFP4 checkpoint (ModelOpt layout, nq nvfp4 quantize)
  nvfp4::GateUpScaleMode gate_up = nvfp4::GateUpScaleMode::kCompensate;
  int64_t window = 2048;  // tokens per window; each window starts a fresh KV cache
  std::vector<KldDomain> domains;
};

struct Nvfp4KldReport {
  std::string teacher_dir;
  std::string nvfp4_dir;
  nvfp4::GateUpScaleMode gate_up = nvfp4::GateUpScaleMode::kCompensate;
  int64_t window = 0;
  KldReport kl;
  int64_t expert_bytes = 0;  // the student's routed experts as served (codes, scales)
};

// INVALID_ARGUMENT for a missing directory, window < 2 or no tokens; FAILED_PRECONDITION when
// `nvfp4_dir` is not an NVFP4 checkpoint; the loaders' errors otherwise.
absl::StatusOr<Nvfp4KldReport> EvaluateNvfp4Kld(const Nvfp4KldRequest& request);

nlohmann::ordered_json Nvfp4KldReportJson(const Nvfp4KldReport& report);
std::string Nvfp4KldReportTable(const Nvfp4KldReport& report);

}  // namespace nq::eval
