#include "services/eval/kld_student.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/release/release_experts.h"

namespace nq::eval {
namespace {

struct ModeName {
  KldMode mode;
  const char* name;
};
constexpr ModeName kModeNames[] = {
    {KldMode::kAll4Bit, "all-4-bit"},
    {KldMode::kAll2Bit, "all-2-bit"},
    {KldMode::kFixedSet, "fixed-set"},
    {KldMode::kOracle, "oracle"},
    {KldMode::kPreviousBlock, "previous-block"},
    {KldMode::kLive, "live"},
};

}  // namespace

absl::StatusOr<KldMode> ParseKldMode(const std::string& text) {
  for (const ModeName& m : kModeNames) {
    if (text == m.name) return m.mode;
  }
  return absl::InvalidArgumentError("unknown --mode '" + text +
                                    "': want all-4-bit, all-2-bit, fixed-set, oracle, previous-block or live");
}

const char* KldModeName(KldMode mode) {
  for (const ModeName& m : kModeNames) {
    if (m.mode == mode) return m.name;
  }
  return "?";
}

double ExpertBytes::BitsPerWeight(double share_4bit) const {
  if (weights == 0) return 0;
  return 8.0 * (static_cast<double>(resident) + share_4bit * static_cast<double>(residual)) /
         static_cast<double>(weights);
}

absl::StatusOr<ExpertBytes> MeasureExpertBytes(const release::ReleaseExpertDecoder& decoder, const model::ModelConfig& config) {
  ExpertBytes bytes;
  const uint64_t experts = static_cast<uint64_t>(config.n_routed_experts);
  for (uint32_t layer : decoder.moe_layer_ids()) {
    if (layer >= config.num_hidden_layers) continue;
    ASSIGN_OR_RETURN(const format::LayerEntry* entry, decoder.release().Layer(0, layer));
    ASSIGN_OR_RETURN(std::string path, decoder.release().ResidentPath(0, layer));
    ASSIGN_OR_RETURN(model::SafetensorsFile resident, model::SafetensorsFile::Open(path));
    for (const model::TensorInfo& tensor : resident.header().tensors) bytes.resident += tensor.end - tensor.begin;
    bytes.resident_files += entry->resident.bytes;
    for (const format::Segment& segment : entry->layout.segments) bytes.residual += segment.bytes * experts;
    bytes.weights +=
        experts * 3 * static_cast<uint64_t>(config.moe_intermediate_size) * static_cast<uint64_t>(config.hidden_size);
  }
  return bytes;
}

absl::StatusOr<ReleaseStudent> LoadReleaseStudent(const std::string& model_dir, const std::string& release_dir,
                                                  release::ExpertBits bits, kernels::Backend& backend) {
  ReleaseStudent s;
  ASSIGN_OR_RETURN(s.config, model::LoadModelConfig(model_dir));
  ASSIGN_OR_RETURN(s.decoder, release::ReleaseExpertDecoder::Open(release_dir, model_dir, s.config, {}));
  ASSIGN_OR_RETURN(s.bytes, MeasureExpertBytes(*s.decoder, s.config));
  ASSIGN_OR_RETURN(model::Checkpoint checkpoint, model::Checkpoint::Open(model_dir));
  ASSIGN_OR_RETURN(s.weights, model::LoadModelWeights(checkpoint, s.config, backend, {}, {.routed_experts = false}));
  RETURN_IF_ERROR(release::ApplyReleaseExperts(*s.decoder, s.config, bits, backend, s.weights));
  return s;
}

absl::StatusOr<std::unique_ptr<StudentLogitSource>> StudentLogitSource::Load(const Options& options,
                                                                             kernels::Backend& backend) {
  if (options.mode == KldMode::kLive) {
    return absl::InvalidArgumentError("mode live runs through the streamer (LiveStudentSource, kld_live.h), not a local student");
  }
  if (options.slots < 0) return absl::InvalidArgumentError(absl::StrCat("--slots ", options.slots, ": want >= 0"));
  std::unique_ptr<StudentLogitSource> s(new StudentLogitSource());
  s->options_ = options;
  // Every record stays with its layer (slot e holds expert e) unless the mode is all-2-bit;
  // the hook picks per step which experts read theirs.
  const bool records = options.mode != KldMode::kAll2Bit;
  ASSIGN_OR_RETURN(ReleaseStudent student,
                   LoadReleaseStudent(options.model_dir, options.release_dir,
                                      records ? release::ExpertBits::k4Bit : release::ExpertBits::k2Bit, backend));
  model::ModelConfig config = std::move(student.config);
  model::ModelWeights weights = std::move(student.weights);
  s->decoder_ = std::move(student.decoder);
  s->bytes_ = student.bytes;
  const size_t experts = static_cast<size_t>(config.n_routed_experts);
  for (uint32_t layer : s->decoder_->moe_layer_ids()) {
    s->layers_.push_back(layer);
    std::vector<uint8_t> fixed(experts, 0);
    for (uint32_t e : s->decoder_->FixedSet(layer)) fixed[e] = 1;
    s->fixed_.push_back(std::move(fixed));
  }
  const Table none(s->layers_.size(), std::vector<uint8_t>(experts, 0));
  s->at4_ = none;
  s->previous_ = none;
  s->counts_.assign(s->layers_.size(), std::vector<double>(experts, 0));
  s->mass_ = s->counts_;
  switch (options.mode) {
    case KldMode::kAll4Bit:
      s->at4_.assign(s->layers_.size(), std::vector<uint8_t>(experts, 1));
      break;
    case KldMode::kFixedSet:
      s->at4_ = s->fixed_;
      break;
    default:
      break;
  }
  ASSIGN_OR_RETURN(s->model_, model::Model::Create(std::move(config), std::move(weights), backend, nullptr,
                                                   {.max_tokens = options.max_tokens}));
  s->InstallHooks();
  return s;
}

int StudentLogitSource::Row(int64_t layer) const {
  const auto it = std::find(layers_.begin(), layers_.end(), layer);
  return it == layers_.end() ? -1 : static_cast<int>(it - layers_.begin());
}

void StudentLogitSource::InstallHooks() {
  const int64_t stack = model_->config().num_hidden_layers;
  model_->SetExpertSlotSource(
      [this, stack](int64_t layer, int32_t expert, int64_t tokens) -> int32_t {
        const int row = Row(layer);
        // The oracle's routing pass runs every expert at 2 bits and counts nothing.
        if (row < 0 || !real_run_) return -1;
        const bool four = at4_[row][expert] != 0;
        if (layer < stack) {
          usage_.calls += static_cast<double>(tokens);
          if (four) usage_.calls_4bit += static_cast<double>(tokens);
        }
        return four ? expert : -1;  // slot e of the layer's records holds expert e
      });
  model_->SetRoutingObserver([this, stack](int64_t layer, const model::MoeRouting& routing) {
    const int row = Row(layer);
    if (row < 0) return;
    for (size_t i = 0; i < routing.experts.size(); ++i) {
      const int32_t e = routing.experts[i];
      counts_[row][e] += 1;
      mass_[row][e] += routing.weights[i];
      if (real_run_ && layer < stack) {
        usage_.weight += routing.weights[i];
        if (at4_[row][e]) usage_.weight_4bit += routing.weights[i];
      }
    }
  });
}

void StudentLogitSource::ClearRouting() {
  for (auto& c : counts_) std::fill(c.begin(), c.end(), 0.0);
  for (auto& m : mass_) std::fill(m.begin(), m.end(), 0.0);
}

StudentLogitSource::Table StudentLogitSource::FixedPlusTopF() const {
  Table chosen = fixed_;
  std::vector<uint32_t> order;
  for (size_t row = 0; row < layers_.size(); ++row) {
    const std::vector<double>& calls = counts_[row];
    const std::vector<double>& mass = mass_[row];
    order.clear();
    for (uint32_t e = 0; e < calls.size(); ++e) {
      if (!fixed_[row][e]) order.push_back(e);
    }
    const size_t top = std::min<size_t>(static_cast<size_t>(options_.slots), order.size());
    std::partial_sort(order.begin(), order.begin() + top, order.end(), [&](uint32_t a, uint32_t b) {
      if (calls[a] != calls[b]) return calls[a] > calls[b];
      if (mass[a] != mass[b]) return mass[a] > mass[b];
      return a < b;
    });
    for (size_t i = 0; i < top; ++i) chosen[row][order[i]] = 1;
  }
  return chosen;
}

absl::Status StudentLogitSource::BeginWindow() {
  model_->ResetCache();
  for (auto& p : previous_) std::fill(p.begin(), p.end(), 0);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> StudentLogitSource::Next(std::span<const int32_t> block) {
  if (options_.mode == KldMode::kOracle) {
    const int64_t start = model_->cache_length();
    ClearRouting();
    real_run_ = false;
    RETURN_IF_ERROR(model_->Forward(block).status());
    RETURN_IF_ERROR(model_->TruncateCache(start));
    at4_ = FixedPlusTopF();
  } else if (options_.mode == KldMode::kPreviousBlock) {
    at4_ = fixed_;
    for (size_t row = 0; row < at4_.size(); ++row) {
      for (size_t e = 0; e < at4_[row].size(); ++e) at4_[row][e] |= previous_[row][e];
    }
  }
  for (size_t row = 0; row < layers_.size(); ++row) {
    if (layers_[row] >= model_->config().num_hidden_layers) continue;
    usage_.held_4bit += std::accumulate(at4_[row].begin(), at4_[row].end(), 0.0);
    usage_.held_total += static_cast<double>(at4_[row].size());
  }
  ClearRouting();
  real_run_ = true;
  ASSIGN_OR_RETURN(std::vector<float> logits, model_->Forward(block));
  if (options_.mode == KldMode::kPreviousBlock) {
    // This block's top-F (by its routing as served) serves the next block.
    const Table chosen = FixedPlusTopF();
    for (size_t row = 0; row < chosen.size(); ++row) {
      for (size_t e = 0; e < chosen[row].size(); ++e) previous_[row][e] = chosen[row][e] && !fixed_[row][e];
    }
  }
  return logits;
}

}  // namespace nq::eval
