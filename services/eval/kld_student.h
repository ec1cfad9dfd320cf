// The student of nq kld: the model with its routed experts from a NestQuant release, each
// expert call served at 2 or 4 bits by a per-mode policy (issue #7):
//
//   all-4-bit       every expert at 4 bits (base + residual);
//   all-2-bit       every expert at 2 bits (the resident base alone);
//   fixed-set       the manifest's fixed 4-bit set of each layer at 4 bits, the rest at 2;
//   oracle          per 16-token block and MoE layer: the fixed set plus the F experts outside
//                   it with the most calls in that very block (ties: more routing weight, then
//                   the lower id) -- an upper bound on the calls any F-slot policy serves
//                   at 4 bits;
//   previous-block  the fixed set plus the previous block's top-F by the same order; the first
//                   block of a window has only the fixed set (nq replay starts from the
//                   static ranking instead, as the streamer does);
//   live            through the running streamer and predictor v0 (kld_live.h).
//
// The student loads at 2 bits and keeps every expert's 4-bit weights in a table beside it;
// the model's routed-expert source hook picks per (layer, expert) and counts the calls.
// Oracle routing: a block's routing must be known before it runs, so the block runs once
// with every expert at 2 bits, the routing observer records its calls, the cache is
// truncated back, and the block re-runs with the chosen set. The oracle's set therefore
// comes from the routing under the 2-bit student (exact for the first MoE layer, whose input
// no expert touches); calls are counted on the second, real run only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "services/eval/kld_harness.h"
#include "services/model/model.h"
#include "services/release/release_expert_decoder.h"
#include "services/release/release_experts.h"

namespace nq::eval {

enum class KldMode { kAll4Bit, kAll2Bit, kFixedSet, kOracle, kPreviousBlock, kLive };

// "all-4-bit", "all-2-bit", "fixed-set", "oracle", "previous-block" or "live".
absl::StatusOr<KldMode> ParseKldMode(const std::string& text);
const char* KldModeName(KldMode mode);

// What the student's routed experts did on the real runs, summed over the MoE layers of the
// decoder stack (the MTP layer does not run in teacher-forced evaluation).
struct ExpertUsage {
  double calls = 0;       // routed (token, layer, expert) calls
  double calls_4bit = 0;  // of those, served by 4-bit weights
  double weight = 0;      // the routing weight of those calls
  double weight_4bit = 0;
  double held_4bit = 0;   // (block, layer, expert) triples held at 4 bits while the block ran
  double held_total = 0;  // (block, layer, expert) triples

  double CallShare() const { return calls > 0 ? calls_4bit / calls : 0; }
  double WeightShare() const { return weight > 0 ? weight_4bit / weight : 0; }
  double HeldShare() const { return held_total > 0 ? held_4bit / held_total : 0; }
};

// A release's routed-expert bytes over the decoder stack's MoE layers (the MTP layer left
// out, as it does not run), for bits per weight.
struct ExpertBytes {
  // The resident files' tensors: base codes (2 bits a weight, packed), per-row and
  // per-column scales, base and residual codebooks, rotation parameters. What every expert
  // keeps, whatever its precision.
  uint64_t resident = 0;
  // The same files whole: the tensors plus the safetensors headers (JSON naming every
  // tensor; it dominates on a toy model, vanishes on a real one). Reported, not counted.
  uint64_t resident_files = 0;
  // Every expert's residual planes: the payload of its record (segment bytes), without the
  // padding that rounds a record up to 4 KiB for O_DIRECT reads. What a 4-bit expert adds.
  uint64_t residual = 0;
  // Routed expert weights: layers x experts x 3 matrices x moe_intermediate x hidden.
  uint64_t weights = 0;

  // Bits per weight when `share_4bit` of the experts also hold their residual:
  // 8 * (resident + share_4bit * residual) / weights.
  double BitsPerWeight(double share_4bit) const;
};

absl::StatusOr<ExpertBytes> MeasureExpertBytes(const release::ReleaseExpertDecoder& decoder, const model::ModelConfig& config);

// A student model served from a release: the opened release, what its experts cost, and the
// model's weights with every routed expert packed (records kept for the experts `bits` runs at 4
// bits; the checkpoint's expert tensors are never read).
struct ReleaseStudent {
  model::ModelConfig config;
  std::unique_ptr<release::ReleaseExpertDecoder> decoder;
  ExpertBytes bytes;
  model::ModelWeights weights;
};
absl::StatusOr<ReleaseStudent> LoadReleaseStudent(const std::string& model_dir, const std::string& release_dir,
                                                  release::ExpertBits bits, kernels::Backend& backend);

// A student of nq kld: logits, plus what its routed experts did and cost.
class StudentSource : public LogitSource {
 public:
  virtual const ExpertUsage& usage() const = 0;
  virtual const ExpertBytes& bytes() const = 0;
};

class StudentLogitSource : public StudentSource {
 public:
  struct Options {
    std::string model_dir;  // the HF checkpoint the release was encoded from
    std::string release_dir;
    KldMode mode = KldMode::kAll4Bit;
    int slots = 8;           // F, floating 4-bit experts per layer (oracle, previous-block)
    int64_t max_tokens = 0;  // the KV cache: the longest window
  };
  // INVALID_ARGUMENT for live (kld_live.h) or negative slots; the release's own errors
  // (FAILED_PRECONDITION for a missing COMPLETE or another model's release).
  static absl::StatusOr<std::unique_ptr<StudentLogitSource>> Load(const Options& options, kernels::Backend& backend);

  int64_t vocab_size() const override { return model_->config().vocab_size; }
  absl::Status BeginWindow() override;
  absl::StatusOr<std::vector<float>> Next(std::span<const int32_t> block) override;

  const ExpertUsage& usage() const override { return usage_; }
  const ExpertBytes& bytes() const override { return bytes_; }

 private:
  // Per MoE layer (rows in decoder order) and expert.
  using Table = std::vector<std::vector<uint8_t>>;

  StudentLogitSource() = default;
  void InstallHooks();
  int Row(int64_t layer) const;
  // The fixed set plus the top-F of `counts_` outside it (ties: routing weight, lower id).
  Table FixedPlusTopF() const;
  void ClearRouting();

  Options options_;
  std::unique_ptr<release::ReleaseExpertDecoder> decoder_;
  std::unique_ptr<model::Model> model_;
  std::vector<int64_t> layers_;                           // MoE layer id of each row
  Table fixed_;
  Table at4_;                                       // the running block's 4-bit set
  Table previous_;                                  // the previous block's top-F (previous-block mode)
  std::vector<std::vector<double>> counts_, mass_;  // [row][expert]: this run's routing
  bool real_run_ = false;                           // false during the oracle's routing pass
  ExpertUsage usage_;
  ExpertBytes bytes_;
};

}  // namespace nq::eval
