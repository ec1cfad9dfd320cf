#include "services/streamer/predictor.h"
#include "services/streamer/state_bytes.h"

#include <algorithm>
#include <bit>
#include <functional>
#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"

namespace nq::streamer {
namespace {

// Observe folds the EMAs every kMaxPending tokens even without a Refresh, so the inflated
// per-token increments (1 - g) * g^-i stay below 2^(kMaxPending / min half-life) <= 2^64.
constexpr uint32_t kMaxPending = 64;
constexpr uint32_t kMaxHorizons = 8;
// Lifts a request-reserved expert above any score (scores are shares: a uniform router's is 1,
// the most any expert can have is experts / top_k).
constexpr float kReservedBonus = 1e6f;
constexpr double kMinHalfLife = 1.0;
// The recency bonus is tabulated up to kRecencyHalfLives half-lives (2^-32 of its weight),
// at most kMaxRecencyTable tokens; older experts get none.
constexpr double kRecencyHalfLives = 32;
constexpr size_t kMaxRecencyTable = size_t{1} << 16;

absl::Status CheckExpertList(const std::vector<std::vector<uint32_t>>& lists, uint32_t layers,
                             uint32_t experts, const char* what) {
  if (lists.empty()) return absl::OkStatus();
  if (lists.size() != layers) {
    return absl::InvalidArgumentError(absl::StrCat(what, " has ", lists.size(),
                                                   " layers, expected ", layers));
  }
  std::vector<uint8_t> seen(experts);
  for (uint32_t l = 0; l < layers; ++l) {
    std::fill(seen.begin(), seen.end(), 0);
    for (uint32_t e : lists[l]) {
      if (e >= experts) {
        return absl::InvalidArgumentError(absl::StrCat(what, " of layer ", l, ": expert ", e,
                                                       " out of range (", experts, ")"));
      }
      if (seen[e]++) {
        return absl::InvalidArgumentError(absl::StrCat(what, " of layer ", l,
                                                       ": duplicate expert ", e));
      }
    }
  }
  return absl::OkStatus();
}

// The candidate order of PlanLayer as an integer, larger = better: the score's bits mapped to
// an unsigned integer in the same order (negatives flipped; -0 made +0 so it ties with 0),
// then the complement of the expert id.
uint64_t CandidateKey(float score, uint32_t expert) {
  const uint32_t bits = std::bit_cast<uint32_t>(score + 0.0f);
  const uint32_t ordered = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return static_cast<uint64_t>(ordered) << 32 | (UINT32_MAX - expert);
}
uint32_t KeyExpert(uint64_t key) { return UINT32_MAX - static_cast<uint32_t>(key); }

// Moves the k largest of keys (distinct) to its front, in no particular order, the rest after
// them in their original order (std::nth_element's contract, k < keys.size()). A radix select on
// the keys' bytes from the top: per pass a histogram of one byte over the keys that share the
// prefix chosen so far, then the byte whose bucket holds the k-th largest. It stops once that
// bucket is taken whole, usually after two or three passes over a layer's few hundred keys:
// counting has no data-dependent branches, where nth_element's partitions mispredicted about
// every other comparison and were most of a refresh's planning time (bench/README.md, "jF's
// refresh on one core").
void SelectLargestKeys(std::span<uint64_t> keys, uint32_t k, std::span<uint64_t> scratch) {
  uint64_t prefix = 0, mask = 0;
  uint32_t need = k;  // keys still to take from those matching the prefix
  for (int shift = 56; shift >= 0; shift -= 8) {
    uint32_t count[256] = {};
    for (const uint64_t key : keys) count[(key >> shift) & 0xff] += (key & mask) == prefix;
    uint32_t above = 0;
    int byte = 255;
    while (above + count[byte] < need) above += count[byte--];
    need -= above;
    prefix |= static_cast<uint64_t>(byte) << shift;
    mask |= uint64_t{0xff} << shift;
    if (count[byte] == need) break;  // the bucket is taken whole: the top k are the keys >= prefix
  }
  // (key & mask) >= prefix holds for exactly the k largest.
  size_t front = 0, back = 0;
  for (const uint64_t key : keys) {
    const bool top = (key & mask) >= prefix;
    keys[front] = key;  // a write ahead of the read position (front <= the index read)
    scratch[back] = key;
    front += top;
    back += !top;
  }
  std::copy(scratch.begin(), scratch.begin() + static_cast<std::ptrdiff_t>(back), keys.begin() + static_cast<std::ptrdiff_t>(front));
}

}  // namespace

absl::StatusOr<Predictor> Predictor::Create(PredictorOptions options) {
  if (options.num_layers == 0 || options.experts_per_layer == 0) {
    return absl::InvalidArgumentError("predictor needs num_layers and experts_per_layer >= 1");
  }
  if (options.refresh_interval == 0) {
    return absl::InvalidArgumentError("refresh_interval must be >= 1");
  }
  const size_t horizons = options.half_lives.size();
  if (horizons == 0 || horizons > kMaxHorizons) {
    return absl::InvalidArgumentError(absl::StrCat("need 1 to ", kMaxHorizons,
                                                   " EMA half-lives, got ", horizons));
  }
  if (options.count_weights.size() != horizons || options.mass_weights.size() != horizons) {
    return absl::InvalidArgumentError(
        absl::StrCat("count_weights (", options.count_weights.size(), ") and mass_weights (",
                     options.mass_weights.size(), ") need one weight per half-life (",
                     horizons, ")"));
  }
  for (size_t h = 0; h < horizons; ++h) {
    if (!(options.half_lives[h] >= kMinHalfLife)) {
      return absl::InvalidArgumentError(absl::StrCat("half-life ", options.half_lives[h],
                                                     " tokens is below ", kMinHalfLife));
    }
    if (!(options.count_weights[h] >= 0) || !(options.mass_weights[h] >= 0)) {
      return absl::InvalidArgumentError("signal weights must be >= 0");
    }
  }
  if (!(options.request_share >= 0 && options.request_share <= 1)) {
    return absl::InvalidArgumentError(absl::StrCat("request_share ", options.request_share, " is not in [0, 1]"));
  }
  if (!(options.recency_weight >= 0) || !(options.static_weight >= 0) ||
      !(options.hysteresis_margin >= 0) || !(options.recency_half_life > 0)) {
    return absl::InvalidArgumentError(
        "recency_weight, static_weight and hysteresis_margin must be >= 0, "
        "recency_half_life > 0");
  }
  absl::Status status = CheckExpertList(options.fixed, options.num_layers,
                                        options.experts_per_layer, "fixed set");
  if (!status.ok()) return status;
  status = CheckExpertList(options.static_ranking, options.num_layers,
                           options.experts_per_layer, "static ranking");
  if (!status.ok()) return status;
  if (options.top_k > options.experts_per_layer) {
    return absl::InvalidArgumentError(absl::StrCat("top_k ", options.top_k, " exceeds ",
                                                   options.experts_per_layer, " experts"));
  }
  if (options.learned != nullptr) {
    if (options.top_k == 0) {
      return absl::InvalidArgumentError("the learned predictor needs top_k");
    }
    RETURN_IF_ERROR(options.learned->CheckGeometry(options.num_layers, options.experts_per_layer,
                                                   options.top_k));
    // Validates the feature geometry before the constructor builds it.
    RETURN_IF_ERROR(JfFeatureState::Create(options.num_layers, options.experts_per_layer,
                                           options.top_k)
                        .status());
  }
  return Predictor(std::move(options));
}

Predictor::Predictor(PredictorOptions options) : options_(std::move(options)) {
  const uint32_t layers = options_.num_layers;
  const uint32_t experts = options_.experts_per_layer;
  const size_t cells = static_cast<size_t>(layers) * experts;
  num_horizons_ = static_cast<uint32_t>(options_.half_lives.size());
  decay_.resize(num_horizons_);
  inv_pow_.resize(static_cast<size_t>(num_horizons_) * (kMaxPending + 1));
  for (uint32_t h = 0; h < num_horizons_; ++h) {
    decay_[h] = std::exp2(-1.0 / options_.half_lives[h]);
    for (uint32_t i = 0; i <= kMaxPending; ++i) {
      inv_pow_[h * (kMaxPending + 1) + i] =
          static_cast<float>((1.0 - decay_[h]) * std::pow(decay_[h], -static_cast<double>(i)));
    }
  }
  count_ema_.assign(cells * num_horizons_, 0.0f);
  mass_ema_.assign(cells * num_horizons_, 0.0f);
  last_use_.assign(cells, 0);
  request_hits_.assign(cells, 0);
  bonus_.assign(experts, 0.0f);
  hot_.reserve(experts);
  prior_.assign(cells, 0.0f);
  fixed_.assign(cells, 0);
  resident_.assign(cells, 0);
  resident_count_.assign(layers, 0);
  scores_.assign(cells, 0.0f);
  for (uint32_t l = 0; l < layers; ++l) {
    if (!options_.fixed.empty()) {
      for (uint32_t e : options_.fixed[l]) fixed_[Index(l, e)] = 1;
    }
    if (!options_.static_ranking.empty()) {
      const auto& ranking = options_.static_ranking[l];
      for (size_t r = 0; r < ranking.size(); ++r) {
        prior_[Index(l, ranking[r])] =
            options_.static_weight * (1.0f - static_cast<float>(r) / static_cast<float>(experts));
      }
    }
  }
  const size_t recency_size =
      std::min(kMaxRecencyTable,
               static_cast<size_t>(std::ceil(kRecencyHalfLives * options_.recency_half_life)));
  recency_.resize(recency_size);
  for (size_t age = 0; age < recency_size; ++age) {
    const double halvings = static_cast<double>(age) / options_.recency_half_life;
    recency_[age] = options_.recency_weight * static_cast<float>(std::exp2(-halvings));
  }
  candidate_offset_.resize(layers + 1);
  candidates_.reserve(cells);
  for (uint32_t l = 0; l < layers; ++l) {
    candidate_offset_[l] = static_cast<uint32_t>(candidates_.size());
    for (uint32_t e = 0; e < experts; ++e) {
      if (!fixed_[Index(l, e)]) candidates_.push_back(e);
    }
  }
  candidate_offset_[layers] = static_cast<uint32_t>(candidates_.size());
  order_.resize(experts);
  order_scratch_.resize(experts);
  victims_.reserve(experts);
  const uint32_t f = options_.floating_slots;
  plan_.loads.reserve(static_cast<size_t>(layers) * std::min(f, experts));
  plan_.desired.assign(static_cast<size_t>(layers) * f, 0);
  plan_.desired_count.assign(layers, 0);
  top_k_ = options_.top_k;
  if (options_.learned != nullptr) {
    // Create validated this geometry.
    features_.emplace(*JfFeatureState::Create(layers, experts, options_.top_k));
    feature_rows_.resize(static_cast<size_t>(JfFeatureStride(experts)) * kJfFeatures);
    predicted_.resize(experts);
  }
}

absl::Status Predictor::Observe(std::span<const uint32_t> experts,
                                  std::span<const float> weights, std::span<const float> norms) {
  const uint32_t layers = options_.num_layers;
  if (experts.size() != weights.size() || experts.empty() || experts.size() % layers != 0) {
    return absl::InvalidArgumentError(absl::StrCat("token routing has ", experts.size(),
                                                   " experts and ", weights.size(),
                                                   " weights for ", layers, " layers"));
  }
  const uint32_t k = static_cast<uint32_t>(experts.size() / layers);
  if (top_k_ != 0 && k != top_k_) {
    return absl::InvalidArgumentError(absl::StrCat("top_k changed from ", top_k_, " to ", k));
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    if (experts[i] >= options_.experts_per_layer) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", experts[i], " out of range (",
                                                     options_.experts_per_layer, ") in layer ",
                                                     i / k));
    }
  }
  if (!norms.empty() && norms.size() != layers) {
    return absl::InvalidArgumentError(absl::StrCat("token routing has ", norms.size(),
                                                   " input norms for ", layers, " layers"));
  }
  top_k_ = k;
  ++tokens_since_refresh_;
  if (features_.has_value()) {
    // jF scores from its own features; v0's EMAs are not kept (they would only cost time).
    features_->Observe(experts, weights, norms);
    for (uint32_t l = 0, i = 0; l < layers; ++l) {
      const size_t base = Index(l, 0);
      for (uint32_t j = 0; j < k; ++j, ++i) {
        last_use_[base + experts[i]] = now_ + 1;
        ++request_hits_[base + experts[i]];
      }
    }
    ++now_;
    return absl::OkStatus();
  }
  if (pending_tokens_ == kMaxPending) FoldPending();
  ++pending_tokens_;
  float step[kMaxHorizons];
  for (uint32_t h = 0; h < num_horizons_; ++h) {
    step[h] = inv_pow_[h * (kMaxPending + 1) + pending_tokens_];
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    const size_t cell = Index(static_cast<uint32_t>(i / k), experts[i]);
    const float w = std::isfinite(weights[i]) ? std::max(weights[i], 0.0f) : 0.0f;
    float* count = &count_ema_[cell * num_horizons_];
    float* mass = &mass_ema_[cell * num_horizons_];
    for (uint32_t h = 0; h < num_horizons_; ++h) {
      count[h] += step[h];
      mass[h] += step[h] * w;
    }
    last_use_[cell] = now_ + 1;
    ++request_hits_[cell];
  }
  ++now_;
  return absl::OkStatus();
}

void Predictor::NewSequence() {
  if (features_.has_value()) features_->NewSequence();
  std::fill(request_hits_.begin(), request_hits_.end(), 0);
  tokens_since_refresh_ = 0;
}

void Predictor::ScoreLayerLearned(uint32_t layer) {
  const uint32_t experts = options_.experts_per_layer;
  const size_t base = Index(layer, 0);
  features_->Fill(layer, std::span<const uint8_t>(resident_).subspan(base, experts), feature_rows_);
  options_.learned->Forward(layer, feature_rows_, predicted_);
  // Expected hits in the model's horizon -> share units (1.0 = a uniform router's), so the
  // hysteresis margin means the same whatever horizon the model was trained for.
  const float horizon = static_cast<float>(options_.learned->geometry().horizon);
  const float scale = static_cast<float>(experts) / (horizon * static_cast<float>(top_k_));
  for (uint32_t e = 0; e < experts; ++e) scores_[base + e] = predicted_[e] * scale;
}

void Predictor::FoldPending() {
  for (uint32_t h = 0; h < num_horizons_; ++h) {
    const float fold = static_cast<float>(std::pow(decay_[h], pending_tokens_));
    for (size_t i = h; i < count_ema_.size(); i += num_horizons_) {
      count_ema_[i] *= fold;
      mass_ema_[i] *= fold;
    }
  }
  pending_tokens_ = 0;
}

void Predictor::ScoreLayer(uint32_t layer, const double* fold) {
  const uint32_t experts = options_.experts_per_layer;
  const uint32_t hn = num_horizons_;
  float* count = &count_ema_[Index(layer, 0) * hn];
  float* mass = &mass_ema_[Index(layer, 0) * hn];
  double count_sum[kMaxHorizons] = {};
  double mass_sum[kMaxHorizons] = {};
  for (uint32_t e = 0; e < experts; ++e) {
    for (uint32_t h = 0; h < hn; ++h) {
      count[e * hn + h] *= static_cast<float>(fold[h]);
      mass[e * hn + h] *= static_cast<float>(fold[h]);
      count_sum[h] += count[e * hn + h];
      mass_sum[h] += mass[e * hn + h];
    }
  }
  // Shares scaled by `experts`: 1.0 is what a uniform router gives every expert.
  float count_coef[kMaxHorizons];
  float mass_coef[kMaxHorizons];
  for (uint32_t h = 0; h < hn; ++h) {
    count_coef[h] = count_sum[h] > 0
                        ? static_cast<float>(options_.count_weights[h] * experts / count_sum[h])
                        : 0.0f;
    mass_coef[h] = mass_sum[h] > 0
                       ? static_cast<float>(options_.mass_weights[h] * experts / mass_sum[h])
                       : 0.0f;
  }
  for (uint32_t e = 0; e < experts; ++e) {
    const size_t cell = Index(layer, e);
    float score = prior_[cell];
    for (uint32_t h = 0; h < hn; ++h) {
      score += count_coef[h] * count[e * hn + h] + mass_coef[h] * mass[e * hn + h];
    }
    if (last_use_[cell] != 0) {
      const uint64_t age = now_ - last_use_[cell];
      if (age < recency_.size()) score += recency_[age];
    }
    scores_[cell] = score;
  }
}

void Predictor::PlanLayer(uint32_t layer) {
  const uint32_t begin = candidate_offset_[layer];
  const uint32_t n = candidate_offset_[layer + 1] - begin;
  const uint32_t k = std::min(options_.floating_slots, n);
  const float margin = options_.hysteresis_margin;
  const size_t base = Index(layer, 0);
  // The request's reserved slots: its most-hit candidates (then by score, then id) get a bonus
  // above any score.
  const uint32_t reserved = static_cast<uint32_t>(options_.request_share * static_cast<float>(k));
  for (uint32_t e : hot_) bonus_[e] = 0.0f;  // the previous layer's
  hot_.clear();
  if (reserved > 0) {
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t e = candidates_[begin + i];
      if (request_hits_[base + e] > 0) hot_.push_back(e);
    }
    const uint32_t r = std::min<uint32_t>(reserved, static_cast<uint32_t>(hot_.size()));
    auto hotter = [&](uint32_t a, uint32_t b) {
      const uint32_t ha = request_hits_[base + a], hb = request_hits_[base + b];
      if (ha != hb) return ha > hb;
      return scores_[base + a] != scores_[base + b] ? scores_[base + a] > scores_[base + b] : a < b;
    };
    std::partial_sort(hot_.begin(), hot_.begin() + r, hot_.end(), hotter);
    hot_.resize(r);
    for (uint32_t e : hot_) bonus_[e] = kReservedBonus;
  }
  auto effective = [&](uint32_t e) {
    return scores_[base + e] + (resident_[base + e] ? margin : 0.0f) + bonus_[e];
  };
  // Higher effective score first, ties to the lower id (plans are deterministic), as one
  // integer per candidate: selecting among integers is several times cheaper than through a
  // two-field comparator, and the order is the same for every non-NaN score.
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t e = candidates_[begin + i];
    order_[i] = CandidateKey(effective(e), e);
  }
  if (k < n) SelectLargestKeys(std::span<uint64_t>(order_).first(n), k, order_scratch_);
  std::sort(order_.begin(), order_.begin() + k, std::greater<>());
  uint32_t* desired = plan_.desired.data() + static_cast<size_t>(layer) * options_.floating_slots;
  for (uint32_t i = 0; i < k; ++i) desired[i] = KeyExpert(order_[i]);
  plan_.desired_count[layer] = k;
  // Residents outside the desired set, worst first, are the victims.
  victims_.clear();
  for (uint32_t i = k; i < n; ++i) {
    if (resident_[base + KeyExpert(order_[i])]) victims_.push_back(order_[i]);
  }
  std::sort(victims_.begin(), victims_.end());
  const uint32_t free_slots = options_.floating_slots - resident_count_[layer];
  uint32_t loads = 0;
  for (uint32_t i = 0; i < k; ++i) {
    const uint32_t e = KeyExpert(order_[i]);
    if (resident_[base + e]) continue;
    PlannedLoad load{layer, e, PlannedLoad::kNoVictim, scores_[base + e] + bonus_[e]};
    if (loads >= free_slots) {
      load.victim = KeyExpert(victims_[loads - free_slots]);
      load.gain = scores_[base + e] + bonus_[e] - effective(load.victim);
    }
    plan_.loads.push_back(load);
    ++loads;
  }
}

const PredictorPlan& Predictor::Refresh() {
  double fold[kMaxHorizons];
  for (uint32_t h = 0; h < num_horizons_; ++h) fold[h] = std::pow(decay_[h], pending_tokens_);
  plan_.loads.clear();
  for (uint32_t l = 0; l < options_.num_layers; ++l) {
    if (features_.has_value()) {
      ScoreLayerLearned(l);
    } else {
      ScoreLayer(l, fold);
    }
    PlanLayer(l);
  }
  pending_tokens_ = 0;
  tokens_since_refresh_ = 0;
  plan_.wanted_loads = static_cast<uint32_t>(plan_.loads.size());
  auto& loads = plan_.loads;
  const size_t budget = options_.read_budget;
  if (loads.size() > budget) {
    // Largest gains win; within a layer gains fall with the load's rank, so each layer keeps
    // a prefix of its loads and its victim pairing stays valid.
    std::nth_element(loads.begin(), loads.begin() + budget, loads.end(),
                     [](const PlannedLoad& a, const PlannedLoad& b) {
                       return a.gain != b.gain ? a.gain > b.gain
                                               : (a.layer != b.layer ? a.layer < b.layer
                                                                     : a.expert < b.expert);
                     });
    loads.resize(budget);
  }
  std::sort(loads.begin(), loads.end(), [](const PlannedLoad& a, const PlannedLoad& b) {
    return a.layer != b.layer ? a.layer < b.layer
                              : (a.gain != b.gain ? a.gain > b.gain : a.expert < b.expert);
  });
  for (const PlannedLoad& load : loads) {
    const size_t base = Index(load.layer, 0);
    if (load.victim != PlannedLoad::kNoVictim) {
      resident_[base + load.victim] = 0;
    } else {
      ++resident_count_[load.layer];
    }
    resident_[base + load.expert] = 1;
  }
  return plan_;
}

absl::Status Predictor::SetResident(uint32_t layer, std::span<const uint32_t> experts) {
  if (layer >= options_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  if (experts.size() > options_.floating_slots) {
    return absl::InvalidArgumentError(absl::StrCat(experts.size(), " residents exceed ",
                                                   options_.floating_slots, " floating slots"));
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    const uint32_t e = experts[i];
    if (e >= options_.experts_per_layer || fixed_[Index(layer, e)]) {
      return absl::InvalidArgumentError(absl::StrCat("expert ", e, " of layer ", layer,
                                                     " is out of range or in the fixed set"));
    }
    if (std::find(experts.begin(), experts.begin() + i, e) != experts.begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat("duplicate resident expert ", e));
    }
  }
  const size_t base = Index(layer, 0);
  std::fill(resident_.begin() + base, resident_.begin() + base + options_.experts_per_layer, 0);
  for (uint32_t e : experts) resident_[base + e] = 1;
  resident_count_[layer] = static_cast<uint32_t>(experts.size());
  return absl::OkStatus();
}

namespace {

constexpr char kStateMagic[4] = {'N', 'Q', 'P', 'S'};
constexpr uint32_t kStateVersion = 1;
}  // namespace

// Layout: magic "NQPS" | version u32 | layers u32 | experts u32 | learned u8 | top_k u32 |
// horizons u32 | half_lives f64[horizons] | now u64 | pending u32 | since_refresh u32 |
// count_ema, mass_ema f32[cells * horizons] | last_use u64[cells] | jF feature state (the
// rest; learned only). Host byte order: a state file is for the machine that wrote it.
std::string Predictor::SaveState() const {
  std::string out;
  out.append(kStateMagic, 4);
  PutValue(kStateVersion, &out);
  PutValue(options_.num_layers, &out);
  PutValue(options_.experts_per_layer, &out);
  PutValue(static_cast<uint8_t>(learned() ? 1 : 0), &out);
  PutValue(top_k_, &out);
  PutValue(num_horizons_, &out);
  for (double h : options_.half_lives) PutValue(h, &out);
  PutValue(now_, &out);
  PutValue(pending_tokens_, &out);
  PutValue(tokens_since_refresh_, &out);
  PutVector(count_ema_, &out);
  PutVector(mass_ema_, &out);
  PutVector(last_use_, &out);
  if (features_.has_value()) out += features_->Save();
  return out;
}

absl::Status Predictor::RestoreState(std::string_view bytes) {
  StateBytesReader in(bytes);
  char magic[4];
  uint32_t version = 0, layers = 0, experts = 0, top_k = 0, horizons = 0;
  uint8_t learned_flag = 0;
  if (!in.Get(&magic) || std::memcmp(magic, kStateMagic, 4) != 0) {
    return absl::DataLossError("not a predictor state (bad magic)");
  }
  if (!in.Get(&version) || version != kStateVersion) {
    return absl::DataLossError(absl::StrCat("predictor state version ", version, ", this build reads ",
                                            kStateVersion));
  }
  if (!in.Get(&layers) || !in.Get(&experts) || !in.Get(&learned_flag) || !in.Get(&top_k) ||
      !in.Get(&horizons) || horizons > kMaxHorizons) {
    return absl::DataLossError("predictor state truncated or malformed in its header");
  }
  std::vector<double> half_lives(horizons);
  if (!in.GetVector(&half_lives)) return absl::DataLossError("predictor state truncated in its half-lives");
  const bool same_scorer = (learned_flag != 0) == learned();
  if (layers != options_.num_layers || experts != options_.experts_per_layer || !same_scorer ||
      half_lives != options_.half_lives || (learned() && top_k != top_k_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "predictor state is for ", layers, " layers x ", experts, " experts, top_k ", top_k, ", ",
        learned_flag ? "jF" : "v0", " with ", horizons, " half-lives; this predictor has ", options_.num_layers,
        " x ", options_.experts_per_layer, ", top_k ", top_k_, ", ", learned() ? "jF" : "v0", " with ",
        num_horizons_));
  }
  if (!learned() && top_k_ != 0 && top_k != 0 && top_k != top_k_) {
    return absl::InvalidArgumentError(absl::StrCat("predictor state has top_k ", top_k, ", this predictor ", top_k_));
  }
  uint64_t now = 0;
  uint32_t pending = 0, since_refresh = 0;
  std::vector<float> count(count_ema_.size()), mass(mass_ema_.size());
  std::vector<uint64_t> last_use(last_use_.size());
  if (!in.Get(&now) || !in.Get(&pending) || !in.Get(&since_refresh) || !in.GetVector(&count) ||
      !in.GetVector(&mass) || !in.GetVector(&last_use)) {
    return absl::DataLossError("predictor state truncated in its arrays");
  }
  if (pending > kMaxPending) return absl::DataLossError("predictor state has a bad pending count");
  for (uint64_t last : last_use) {
    if (last > now) return absl::DataLossError("predictor state has a last use after its clock");
  }
  if (features_.has_value()) {
    RETURN_IF_ERROR(features_->Restore(in.Rest()));
  } else if (!in.Rest().empty()) {
    return absl::DataLossError("predictor state has trailing bytes");
  }
  top_k_ = top_k;
  now_ = now;
  pending_tokens_ = pending;
  tokens_since_refresh_ = since_refresh;
  count_ema_ = std::move(count);
  mass_ema_ = std::move(mass);
  last_use_ = std::move(last_use);
  return absl::OkStatus();
}

}  // namespace nq::streamer
