#include "services/streamer/replay.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::streamer {
namespace {

// Sum of the `f` largest values among `values[candidates]` (partial selection).
double TopSum(const std::vector<double>& values, const std::vector<uint32_t>& candidates,
              uint32_t f, std::vector<double>* scratch) {
  scratch->clear();
  for (uint32_t e : candidates) scratch->push_back(values[e]);
  const size_t k = std::min<size_t>(f, scratch->size());
  std::nth_element(scratch->begin(), scratch->begin() + k, scratch->end(), std::greater<>());
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += (*scratch)[i];
  return sum;
}

}  // namespace

absl::StatusOr<ReplayResult> Replay(const RoutingTrace& trace, PredictorOptions options, uint32_t landing_tokens) {
  RETURN_IF_ERROR(ValidateTrace(trace));
  const uint32_t layers = trace.num_layers();
  const uint32_t experts = trace.experts_per_layer;
  if (options.num_layers == 0) options.num_layers = layers;
  if (options.experts_per_layer == 0) options.experts_per_layer = experts;
  if (options.num_layers != layers || options.experts_per_layer != experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("options are for ", options.num_layers, " layers x ",
                     options.experts_per_layer, " experts, the trace has ", layers, " x ",
                     experts));
  }
  if (options.top_k == 0) options.top_k = trace.top_k;
  ASSIGN_OR_RETURN(Predictor predictor, Predictor::Create(options));
  const uint32_t f = options.floating_slots;
  const uint32_t k = trace.top_k;

  // Per layer, the experts that may float, and the initial floating set.
  std::vector<std::vector<uint32_t>> candidates(layers);
  std::vector<uint8_t> previous(static_cast<size_t>(layers) * experts, 0);
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t e = 0; e < experts; ++e) {
      if (!predictor.IsFixed(l, e)) candidates[l].push_back(e);
    }
    std::vector<uint32_t> initial;
    if (!options.static_ranking.empty()) {
      for (uint32_t e : options.static_ranking[l]) {
        if (initial.size() < f && !predictor.IsFixed(l, e)) initial.push_back(e);
      }
    }
    for (uint32_t e : candidates[l]) {
      if (initial.size() >= f) break;
      if (std::find(initial.begin(), initial.end(), e) == initial.end()) initial.push_back(e);
    }
    RETURN_IF_ERROR(predictor.SetResident(l, initial));
    for (uint32_t e : initial) previous[static_cast<size_t>(l) * experts + e] = 1;
  }

  ReplayResult result;
  result.tokens = trace.num_tokens();
  const size_t block = options.refresh_interval;
  std::vector<double> counts(static_cast<size_t>(layers) * experts);
  std::vector<double> mass(counts.size());
  // The calls and weight of the block's first landing_tokens tokens, which a load decided at
  // the block's start misses; and per policy the experts that arrived at this block's start.
  std::vector<double> early_counts(counts.size()), early_mass(counts.size());
  std::vector<uint8_t> arrived_previous(counts.size(), 0), arrived_predictor(counts.size(), 0);
  // And the experts those loads replace, which serve until the loads land.
  std::vector<uint8_t> left_previous(counts.size(), 0), left_predictor(counts.size(), 0);
  std::vector<double> scratch;
  std::vector<uint32_t> order;
  double served_calls[3] = {0, 0, 0};  // oracle, previous block, predictor
  double served_weight[3] = {0, 0, 0};
  double total_calls = 0, total_weight = 0;
  // Blocks restart at every sequence (request) start, as the streamer's refreshes do.
  std::vector<std::pair<size_t, size_t>> blocks;
  for (const auto& [begin, end] : trace.Sequences()) {
    for (size_t start = begin; start < end; start += block) blocks.emplace_back(start, std::min(start + block, end));
  }
  for (const auto& [start, end] : blocks) {
    if (trace.sequence_starts.empty() ? start == 0
                                      : std::binary_search(trace.sequence_starts.begin(),
                                                           trace.sequence_starts.end(), start)) {
      predictor.NewSequence();
    }
    ++result.blocks;
    std::fill(counts.begin(), counts.end(), 0.0);
    std::fill(mass.begin(), mass.end(), 0.0);
    std::fill(early_counts.begin(), early_counts.end(), 0.0);
    std::fill(early_mass.begin(), early_mass.end(), 0.0);
    for (size_t t = start; t < end; ++t) {
      const auto ids = trace.TokenExperts(t);
      const auto ws = trace.TokenWeights(t);
      const bool early = t < start + landing_tokens;
      for (size_t i = 0; i < ids.size(); ++i) {
        const size_t cell = (i / k) * experts + ids[i];
        counts[cell] += 1;
        mass[cell] += ws[i];
        if (early) {
          early_counts[cell] += 1;
          early_mass[cell] += ws[i];
        }
      }
    }
    for (uint32_t l = 0; l < layers; ++l) {
      const size_t base = static_cast<size_t>(l) * experts;
      const std::vector<double> layer_counts(counts.begin() + base,
                                             counts.begin() + base + experts);
      const std::vector<double> layer_mass(mass.begin() + base, mass.begin() + base + experts);
      double fixed_calls = 0, fixed_weight = 0;
      for (uint32_t e = 0; e < experts; ++e) {
        total_calls += layer_counts[e];
        total_weight += layer_mass[e];
        if (predictor.IsFixed(l, e)) {
          fixed_calls += layer_counts[e];
          fixed_weight += layer_mass[e];
        }
        // An expert that arrived at this block's start serves only after its load lands.
        if (previous[base + e]) {
          served_calls[1] += layer_counts[e] - (arrived_previous[base + e] ? early_counts[base + e] : 0.0);
          served_weight[1] += layer_mass[e] - (arrived_previous[base + e] ? early_mass[base + e] : 0.0);
        }
        if (predictor.IsResident(l, e)) {
          served_calls[2] += layer_counts[e] - (arrived_predictor[base + e] ? early_counts[base + e] : 0.0);
          served_weight[2] += layer_mass[e] - (arrived_predictor[base + e] ? early_mass[base + e] : 0.0);
        }
        if (left_previous[base + e]) {
          served_calls[1] += early_counts[base + e];
          served_weight[1] += early_mass[base + e];
        }
        if (left_predictor[base + e]) {
          served_calls[2] += early_counts[base + e];
          served_weight[2] += early_mass[base + e];
        }
      }
      for (int p = 0; p < 3; ++p) {
        served_calls[p] += fixed_calls;
        served_weight[p] += fixed_weight;
      }
      served_calls[0] += TopSum(layer_counts, candidates[l], f, &scratch);
      served_weight[0] += TopSum(layer_mass, candidates[l], f, &scratch);
      // This block's top F by calls (then weight, then id) serves the next block.
      order = candidates[l];
      const size_t top = std::min<size_t>(f, order.size());
      std::partial_sort(order.begin(), order.begin() + top, order.end(),
                        [&](uint32_t a, uint32_t b) {
                          if (layer_counts[a] != layer_counts[b]) {
                            return layer_counts[a] > layer_counts[b];
                          }
                          if (layer_mass[a] != layer_mass[b]) return layer_mass[a] > layer_mass[b];
                          return a < b;
                        });
      std::fill(arrived_previous.begin() + base, arrived_previous.begin() + base + experts, 0);
      for (size_t i = 0; i < top; ++i) arrived_previous[base + order[i]] = !previous[base + order[i]];
      std::copy(previous.begin() + base, previous.begin() + base + experts, left_previous.begin() + base);
      std::fill(previous.begin() + base, previous.begin() + base + experts, 0);
      for (size_t i = 0; i < top; ++i) {
        previous[base + order[i]] = 1;
        left_previous[base + order[i]] = 0;
      }
    }
    for (size_t t = start; t < end; ++t) {
      RETURN_IF_ERROR(predictor.Observe(trace.TokenExperts(t), trace.TokenWeights(t), trace.TokenNorms(t)));
    }
    const PredictorPlan& plan = predictor.Refresh();
    std::fill(arrived_predictor.begin(), arrived_predictor.end(), 0);
    std::fill(left_predictor.begin(), left_predictor.end(), 0);
    for (const PlannedLoad& load : plan.loads) {
      const size_t base = static_cast<size_t>(load.layer) * experts;
      arrived_predictor[base + load.expert] = 1;
      if (load.victim != PlannedLoad::kNoVictim) left_predictor[base + load.victim] = 1;
    }
    result.predictor_loads += plan.loads.size();
    result.predictor_wanted += plan.wanted_loads;
  }
  result.calls = static_cast<uint64_t>(total_calls);
  result.weight = total_weight;
  auto share = [](double served, double total) { return total > 0 ? served / total : 1.0; };
  result.oracle = {share(served_calls[0], total_calls), share(served_weight[0], total_weight)};
  result.previous_block = {share(served_calls[1], total_calls),
                           share(served_weight[1], total_weight)};
  result.predictor = {share(served_calls[2], total_calls), share(served_weight[2], total_weight)};
  return result;
}

}  // namespace nq::streamer
