#include "services/streamer/routing_report.h"

#include "absl/strings/str_cat.h"

namespace nq::streamer {

absl::StatusOr<std::vector<uint32_t>> ReportLayers(const nq::v1::RoutingReport& report) {
  std::vector<uint32_t> layers;
  for (const nq::v1::LayerRouting& entry : report.layer_entries()) {
    if (!layers.empty() && entry.layer() == layers.front()) break;
    layers.push_back(entry.layer());
  }
  if (layers.empty() || report.layer_entries_size() % layers.size() != 0) {
    return absl::InvalidArgumentError("routing report is not token-major over a fixed layer list");
  }
  return layers;
}

absl::Status CheckReport(const nq::v1::RoutingReport& report, std::span<const uint32_t> layers,
                         uint32_t experts_per_layer) {
  const size_t L = layers.size();
  const size_t entries = static_cast<size_t>(report.layer_entries_size());
  if (L == 0 || entries % L != 0 || entries / L != report.num_tokens()) {
    return absl::InvalidArgumentError(
        absl::StrCat(entries, " entries for ", report.num_tokens(), " tokens x ", L, " layers"));
  }
  // The predictor takes a fixed top_k of at least one expert per layer: the same for every
  // entry, or the report would be refused at its first token of another width.
  const int top_k = entries == 0 ? 0 : report.layer_entries(0).experts_size();
  if (entries > 0 && top_k == 0) return absl::InvalidArgumentError("routing report entries have no experts");
  for (size_t t = 0; t < report.num_tokens(); ++t) {
    for (size_t l = 0; l < L; ++l) {
      const nq::v1::LayerRouting& entry = report.layer_entries(static_cast<int>(t * L + l));
      if (entry.layer() != layers[l] || entry.experts_size() != entry.weights_size() ||
          entry.experts_size() != top_k) {
        return absl::InvalidArgumentError(absl::StrCat("token ", t, " layer ", entry.layer(),
                                                       " does not match the report's layers, has experts "
                                                       "without weights, or another number of experts"));
      }
      for (uint32_t e : entry.experts()) {
        if (e >= experts_per_layer) {
          return absl::InvalidArgumentError(absl::StrCat("token ", t, " layer ", entry.layer(), ": expert ", e,
                                                         " out of range (", experts_per_layer, " per layer)"));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace nq::streamer
