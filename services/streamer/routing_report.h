// What the streamer accepts in a worker's routing report (nq.v1.RoutingReport), checked whole
// before any of it reaches the predictor: a report is untrusted input (a bug or a foreign
// client on the session could send anything), and one refused halfway would already have fed
// some of its tokens. Pure functions, fuzzed (fuzz/routing_report_fuzzer.cc).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nq/v1/streamer.pb.h"

namespace nq::streamer {

// The layer list a report is token-major over: its entries' layers up to the first repeat of
// the first one. INVALID_ARGUMENT for no entries, or a count that is not a whole number of
// tokens over that list.
absl::StatusOr<std::vector<uint32_t>> ReportLayers(const nq::v1::RoutingReport& report);

// OK when `report` holds exactly num_tokens x layers.size() entries, token-major over `layers`
// (entry t * L + l is layer layers[l]), each with as many weights as experts, the same number
// of experts (at least one) in every entry, and every expert below `experts_per_layer`: what
// PredictorV0::Observe takes, token by token, without refusing any.
// INVALID_ARGUMENT naming the first entry that breaks a rule otherwise.
absl::Status CheckReport(const nq::v1::RoutingReport& report, std::span<const uint32_t> layers,
                         uint32_t experts_per_layer);

}  // namespace nq::streamer
