// A routing report for loader tests: `tokens` decode tokens from `first_token` on, each routing
// layer `layer` to `expert` alone (top-1, weight 1), sequence 1.
#pragma once

#include <cstdint>

#include "nq/v1/streamer.pb.h"

namespace nq::streamer {

inline nq::v1::RoutingReport TopOneReport(uint64_t first_token, uint32_t layer, uint32_t expert, uint32_t tokens) {
  nq::v1::RoutingReport report;
  report.set_sequence_id(1);
  report.set_first_token(first_token);
  report.set_num_tokens(tokens);
  for (uint32_t t = 0; t < tokens; ++t) {
    nq::v1::LayerRouting* entry = report.add_layer_entries();
    entry->set_layer(layer);
    entry->add_experts(expert);
    entry->add_weights(1.0f);
  }
  return report;
}

}  // namespace nq::streamer
