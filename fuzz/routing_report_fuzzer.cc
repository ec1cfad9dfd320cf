// libFuzzer target for the routing reports a worker sends the streamer (scripts/fuzz.sh
// routing_report).
//
// A report arrives on a worker's session as protobuf bytes; the streamer orders it
// (ReportOrder), derives and checks its layers (routing_report.h), then feeds it token by token
// to predictor v0. On any bytes nothing may crash or trip a sanitizer, and a report the checks
// accept must be taken by the predictor at every token (a report refused halfway would already
// have fed some of it), and refresh into a plan of experts inside the layer.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fuzz/fuzz_require.h"
#include "nq/v1/streamer.pb.h"
#include "services/streamer/predictor.h"
#include "services/streamer/report_order.h"
#include "services/streamer/routing_report.h"

using nq::fuzz::Require;

namespace {

constexpr uint32_t kExperts = 16;   // the worker's experts per layer
constexpr uint32_t kFloating = 2;   // floating slots per layer
constexpr size_t kMaxLayers = 128;  // more than any served model has MoE layers

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  nq::v1::RoutingReport report;
  if (!report.ParseFromArray(data, static_cast<int>(size))) return 0;
  nq::streamer::ReportOrder order;
  if (!order.Accept(report).ok()) return 0;
  // The same report again repeats its tokens: refused.
  Require(!order.Accept(report).ok());
  const absl::StatusOr<std::vector<uint32_t>> layers = nq::streamer::ReportLayers(report);
  if (!layers.ok()) {
    Require(!layers.status().message().empty());
    return 0;
  }
  const absl::Status checked = nq::streamer::CheckReport(report, *layers, kExperts);
  if (!checked.ok()) {
    Require(checked.code() == absl::StatusCode::kInvalidArgument && !checked.message().empty());
    return 0;
  }
  if (layers->size() > kMaxLayers) return 0;
  nq::streamer::PredictorOptions options;
  options.num_layers = static_cast<uint32_t>(layers->size());
  options.experts_per_layer = kExperts;
  options.floating_slots = kFloating;
  absl::StatusOr<nq::streamer::Predictor> predictor = nq::streamer::Predictor::Create(options);
  Require(predictor.ok());
  const size_t L = layers->size();
  std::vector<uint32_t> experts;
  std::vector<float> weights;
  std::vector<float> norms;
  for (size_t t = 0; t < report.num_tokens(); ++t) {
    experts.clear();
    weights.clear();
    norms.clear();
    for (size_t l = 0; l < L; ++l) {
      const nq::v1::LayerRouting& entry = report.layer_entries(static_cast<int>(t * L + l));
      experts.insert(experts.end(), entry.experts().begin(), entry.experts().end());
      weights.insert(weights.end(), entry.weights().begin(), entry.weights().end());
      norms.push_back(entry.input_sq_norm());
    }
    Require(predictor->Observe(experts, weights, norms).ok());
    if (predictor->RefreshDue()) {
      const nq::streamer::PredictorPlan& plan = predictor->Refresh();
      for (const nq::streamer::PlannedLoad& load : plan.loads) Require(load.layer < L && load.expert < kExperts);
    }
  }
  return 0;
}
