// The predictor (DESIGN.md section 7, issues #6 and #21) decides which experts sit in each
// layer's F floating 4-bit slots. It scores every (layer, expert) one of two ways:
//
//  - v0 (default), an EMA heuristic:
//      score = sum_h count_weight[h] * count_share_h + sum_h mass_weight[h] * mass_share_h
//            + recency_weight * 2^(-tokens_since_last_use / recency_half_life)
//            + static_weight * (1 - static_rank / experts)
//    where count_share_h (mass_share_h) is the expert's EMA of routed calls (routing weight)
//    at half-life half_lives[h], divided by the layer's total and multiplied by `experts` (so
//    1.0 is a uniform router's share);
//  - jF (options.learned set), the learned model of jf_model.h over the features of
//    jf_features.h: its expected hits in the next H tokens (H: the file's horizon), x experts /
//    (H x top_k), so 1.0
//    is again a uniform router's share and the hysteresis margin means the same in both.
// Fixed-set experts are always at 4 bits and never compete.
//
// Refresh() (every refresh_interval tokens) picks the desired floating set per layer as the
// top F by score, where a resident expert counts hysteresis_margin higher: it keeps its slot
// unless a challenger beats it by the margin. The loads that move residency toward the
// desired sets are cut to read_budget, keeping the largest gains (challenger score minus the
// victim's), and listed by layer ascending: layer l is needed before layer l + 1 in the next
// step. Eviction is lazy: a victim appears only paired with the load that replaces it.
//
// The predictor assumes its planned loads land (Refresh applies them to its residency);
// SetResident resynchronises it with the streamer's real slot tables. NewSequence marks a
// new request (RoutingReport.sequence_id, a trace's sequence start); SaveState/RestoreState
// carry the routing history over a streamer restart, so it does not start cold.
//
// Cost: Observe is O(layers * top_k * horizons); Refresh is O(layers * experts) with partial
// selection (jF: plus its forward, jf_model.h), and allocates nothing after construction.
// Not thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/streamer/jf_features.h"
#include "services/streamer/jf_model.h"

namespace nq::streamer {

// v0's hysteresis margin (PredictorOptions' default).
inline constexpr float kV0DefaultMargin = 2.0f;
// The margin to run a scorer with when none is asked for: `learned`'s (JfModel::
// hysteresis_margin) for jF, kV0DefaultMargin for v0 (null).
inline float DefaultHysteresisMargin(const JfModel* learned) {
  return learned != nullptr ? learned->hysteresis_margin() : kV0DefaultMargin;
}

struct PredictorOptions {
  uint32_t num_layers = 0;
  uint32_t experts_per_layer = 0;
  // F: floating 4-bit slots per layer.
  uint32_t floating_slots = 0;
  // Per layer, the fixed 4-bit set from the manifest (empty outer vector: no fixed sets).
  std::vector<std::vector<uint32_t>> fixed;
  // Per layer, experts best first from the manifest's ranking (empty: no static prior).
  // May be partial; unranked experts get no prior.
  std::vector<std::vector<uint32_t>> static_ranking;
  // EMA half-lives in tokens, and each horizon's weight for call counts and routing mass.
  std::vector<double> half_lives = {8, 64, 512};
  std::vector<float> count_weights = {0.25f, 0.35f, 0.15f};
  std::vector<float> mass_weights = {0.25f, 0.35f, 0.15f};
  float recency_weight = 0.5f;
  double recency_half_life = 16;
  float static_weight = 0.2f;
  // In score units (1.0 = a uniform router's share). jF wants its own
  // (DefaultHysteresisMargin): the streamer and `nq replay` take that when --hysteresis is unset.
  float hysteresis_margin = kV0DefaultMargin;
  // Share of each layer's F floating slots kept for the experts with the most hits in the
  // current request (sequence), whatever their score: floor(request_share * F) of them, among
  // experts hit at least once in it. They rank above every other candidate (their loads first
  // in the budget cut; never a victim while reserved).
  float request_share = 0.0f;
  // Most new loads per refresh, over all layers.
  uint32_t read_budget = 64;
  uint32_t refresh_interval = 16;
  // The learned model (--predictor FILE); null: v0's EMA scoring. It must have been trained
  // for num_layers x experts_per_layer and top_k (Create refuses a mismatch).
  std::shared_ptr<const JfModel> learned;
  // Routed experts per token and layer: required with `learned`; otherwise 0 (taken from the
  // first token) or the value every token must have.
  uint32_t top_k = 0;
};

struct PlannedLoad {
  static constexpr uint32_t kNoVictim = UINT32_MAX;
  uint32_t layer = 0;
  uint32_t expert = 0;
  // The resident expert this load replaces once it lands, or kNoVictim (a free slot).
  uint32_t victim = kNoVictim;
  float gain = 0;  // score(expert) - score(victim), or score(expert) for a free slot
};

struct PredictorPlan {
  // Loads ordered by layer ascending (then by gain, largest first); at most read_budget.
  std::vector<PlannedLoad> loads;
  // Desired floating set of each layer, flattened: layer l's set is
  // desired[l * floating_slots, + desired_count[l]).
  std::vector<uint32_t> desired;
  std::vector<uint32_t> desired_count;
  // Loads wanted before the budget cut (how far residency is from the desired sets).
  uint32_t wanted_loads = 0;
};

class Predictor {
 public:
  // INVALID_ARGUMENT for inconsistent options (sizes, ids out of range, duplicates,
  // non-positive half-lives or interval).
  static absl::StatusOr<Predictor> Create(PredictorOptions options);

  // One decode token: for each layer l (in order), top_k experts and weights at
  // [l * top_k, (l + 1) * top_k). top_k = experts.size() / num_layers and must not change.
  // `norms`: per layer, the squared norm of the token's input to it (LayerRouting
  // .input_sq_norm), or empty when unreported; only jF reads them.
  absl::Status Observe(std::span<const uint32_t> experts, std::span<const float> weights,
                       std::span<const float> norms = {});
  // A new request (sequence) starts: jF clears its per-request signals, and the next refresh
  // comes refresh_interval tokens into it.
  void NewSequence();
  bool RefreshDue() const { return tokens_since_refresh_ >= options_.refresh_interval; }

  // Scores everything, plans, and applies the plan's loads to the residency. The reference
  // stays valid until the next Refresh.
  const PredictorPlan& Refresh();

  // Replaces layer's floating residency (e.g. from the worker's slot table). Fixed experts and
  // more than F experts are INVALID_ARGUMENT.
  absl::Status SetResident(uint32_t layer, std::span<const uint32_t> experts);
  bool IsResident(uint32_t layer, uint32_t expert) const {
    return resident_[Index(layer, expert)] != 0;
  }
  bool IsFixed(uint32_t layer, uint32_t expert) const {
    return fixed_[Index(layer, expert)] != 0;
  }
  // The score of (layer, expert) at the last Refresh.
  float Score(uint32_t layer, uint32_t expert) const { return scores_[Index(layer, expert)]; }
  uint64_t tokens_observed() const { return now_; }
  const PredictorOptions& options() const { return options_; }
  bool learned() const { return options_.learned != nullptr; }
  // The next refreshes' read budget (the streamer paces it by measured disk throughput,
  // read_pacer.h); 0 plans no loads.
  void set_read_budget(uint32_t budget) { options_.read_budget = budget; }

  // The routing history (EMAs, recency, jF's features) as bytes, and back into a predictor of
  // the same geometry and scorer: INVALID_ARGUMENT naming both for another geometry or
  // scorer, DATA_LOSS for truncated or malformed bytes (the predictor is then unchanged).
  // Residency is not part of it: the slot tables are the truth (SetResident).
  std::string SaveState() const;
  absl::Status RestoreState(std::string_view bytes);

 private:
  explicit Predictor(PredictorOptions options);
  size_t Index(uint32_t layer, uint32_t expert) const {
    return static_cast<size_t>(layer) * options_.experts_per_layer + expert;
  }
  // Folds the pending tokens into the EMAs (multiplies by g^pending).
  void FoldPending();
  // Folds layer's EMAs by fold[h] and scores its experts.
  void ScoreLayer(uint32_t layer, const double* fold);
  // jF's scores of layer's experts (the EMAs still fold in ScoreLayer).
  void ScoreLayerLearned(uint32_t layer);
  void PlanLayer(uint32_t layer);

  PredictorOptions options_;
  uint32_t num_horizons_ = 0;
  uint32_t top_k_ = 0;
  uint64_t now_ = 0;             // tokens observed so far
  uint32_t pending_tokens_ = 0;  // tokens since the last fold
  uint32_t tokens_since_refresh_ = 0;
  std::vector<double> decay_;    // per horizon, g = 2^(-1/half_life)
  // inv_pow_[h * (kMaxPending + 1) + i] = (1 - g) * g^(-i): a token i steps after the last
  // fold adds this, so that the true EMA is stored * g^pending.
  std::vector<float> inv_pow_;
  // Per (layer, expert), num_horizons_ entries each: EMA of calls and of routing weight.
  std::vector<float> count_ema_;
  std::vector<float> mass_ema_;
  std::vector<uint64_t> last_use_;  // token index + 1 of the last call, 0 = never
  std::vector<uint32_t> request_hits_;  // calls in the current sequence
  std::vector<float> bonus_;            // one layer's reservation bonus per expert (PlanLayer)
  std::vector<uint32_t> hot_;           // one layer's candidates hit in this request
  std::vector<float> prior_;        // static prior per (layer, expert)
  std::vector<uint8_t> fixed_;
  std::vector<uint8_t> resident_;
  std::vector<uint32_t> resident_count_;  // per layer
  std::vector<float> scores_;
  // jF: its features (created with the predictor) and one layer's feature rows.
  std::optional<JfFeatureState> features_;
  std::vector<float> feature_rows_;
  std::vector<float> predicted_;
  // Scratch, sized at construction.
  std::vector<uint32_t> candidates_;  // per layer, the non-fixed experts
  std::vector<uint32_t> candidate_offset_;
  std::vector<float> recency_;  // recency bonus by age in tokens; 0 past the end
  // One layer's candidates as CandidateKey(effective score, expert) (predictor.cc), to select
  // in, and its victims.
  std::vector<uint64_t> order_;
  std::vector<uint64_t> order_scratch_;  // SelectLargestKeys's partition buffer
  std::vector<PlannedLoad> layer_loads_;
  std::vector<uint64_t> victims_;
  std::vector<PlannedLoad> all_loads_;
  PredictorPlan plan_;
};

}  // namespace nq::streamer
