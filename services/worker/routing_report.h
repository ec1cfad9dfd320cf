// Building nq.v1.RoutingReport blocks (DESIGN.md section 3, step 4) from the model's per-layer
// routing of one forward: one entry per (token, MoE layer), token-major.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "nq/v1/streamer.pb.h"
#include "services/model/moe_routing.h"

namespace nq::worker {

// Appends token `t`'s (layer, experts, weights) for every MoE layer: `per_layer[i]` is the
// forward's routing at model layer `layers[i]`. Does not touch num_tokens.
void AppendTokenRouting(std::span<const uint32_t> layers, std::span<const model::MoeRouting> per_layer, int t,
                        nq::v1::RoutingReport* report);

}  // namespace nq::worker
