#include "services/worker/routing_report.h"

namespace nq::worker {

void AppendTokenRouting(std::span<const uint32_t> layers, std::span<const model::MoeRouting> per_layer, int t,
                        nq::v1::RoutingReport* report) {
  for (size_t i = 0; i < layers.size(); ++i) {
    const model::MoeRouting& r = per_layer[i];
    nq::v1::LayerRouting* entry = report->add_layer_entries();
    entry->set_layer(layers[i]);
    for (int j = 0; j < r.top_k; ++j) {
      entry->add_experts(static_cast<uint32_t>(r.experts[t * r.top_k + j]));
      entry->add_weights(r.weights[t * r.top_k + j]);
    }
    if (static_cast<size_t>(t) < r.input_sq_norms.size()) entry->set_input_sq_norm(r.input_sq_norms[t]);
  }
}

}  // namespace nq::worker
