// Next-token sampling in the leader worker: OpenAI's logit_bias and presence/frequency
// penalties on the raw logits, then greedy, temperature, top-k and top-p (nucleus), seeded so
// a request with a seed is reproducible, with log-probabilities for the API. One Sampler per
// sequence: it counts the tokens it has sampled, which the penalties read.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/sample_tokens.h"

namespace nq::worker {

struct SamplingConfig {
  float temperature = 1.0f;  // 0: greedy
  float top_p = 1.0f;        // (0, 1]
  int top_k = 0;             // 0: off
  uint64_t seed = 0;
  int top_logprobs = 0;      // alternatives to report per token (0..20)
  // Whether SampledToken::logprob is computed (forced by top_logprobs > 0). Without it greedy
  // decoding takes the argmax alone: no softmax over the vocabulary, which costs 0.5-1 ms of host
  // time per token at a 129k-155k vocabulary (bench/README.md) and is then left 0; a draw at a
  // temperature other than 1 skips the second exp per id that the temperature-1 normaliser takes.
  bool logprobs = true;
  float presence_penalty = 0;   // [-2, 2]
  float frequency_penalty = 0;  // [-2, 2]
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, bias in [-100, 100])
  // Set by the sequence runner when it speculates, not by requests: the draws for the k-th
  // token of the sequence come from a stream keyed by (seed, k) instead of one stream for the
  // whole sequence. Verification consumes a varying number of draws per token (an acceptance
  // test, sometimes a residual draw); keyed streams keep a small logit change (an expert moving
  // between 2 and 4 bits) from shifting every later token's draws, as plain sampling's single
  // inverse-CDF draw per token does.
  bool position_keyed_draws = false;
};

// The seed of the draw stream for the token at `position` (SplitMix64 of both): independent
// streams per position, reproducible per seed.
uint64_t PositionSeed(uint64_t seed, uint64_t position);

// The log-probabilities a Sampler reports are those of the model's next-token distribution
// as the request adjusted it: log_softmax(logits + logit_bias - penalties) at temperature 1,
// over the whole vocabulary (before top-k / top-p). Temperature, top-k and top-p shape only
// how the token is drawn, so the reported values do not depend on them (greedy included), as
// OpenAI documents logprobs ("the log probability of this token") and vLLM reports them by
// default. A token with zero probability reports -infinity.
struct SampledToken {
  int32_t id = 0;
  float logprob = 0;
  // The top_logprobs most likely tokens with their log-probabilities, most likely first
  // (ties: lower id first).
  std::vector<std::pair<int32_t, float>> top;
};

class Sampler {
 public:
  // INVALID_ARGUMENT for a negative or non-finite temperature, top_p outside (0, 1], a
  // negative top_k, top_logprobs outside 0..20, a penalty outside [-2, 2], or a logit_bias
  // entry with a negative id or a bias outside [-100, 100].
  static absl::StatusOr<Sampler> Create(const SamplingConfig& config);

  // Picks the next token from one row of logits. Non-finite logits count as -inf; a row with
  // no finite logit, or a logit_bias id outside the row, is INVALID_ARGUMENT. The reported
  // log-probabilities are those of SampledToken's contract.
  absl::StatusOr<SampledToken> Sample(std::span<const float> logits);

  // Speculative verification of `draft` against this row (Leviathan et al. 2023, "Fast
  // Inference from Transformers via Speculative Decoding", algorithm 1). `draft_probs` is the
  // distribution the draft was drawn from ([vocab], sums to 1); empty means a deterministic
  // draft (all mass on `draft`). With p this sampler's distribution for the row:
  //   greedy, or a deterministic draft: the token is exactly Sample's pick; accepted when it
  //           equals the draft (with all of q on the draft, accepting with probability p(draft)
  //           and else drawing from p without it is drawing from p: the same distribution, and
  //           the same draw a backend makes from the row, DeviceDraws);
  //   else:   the draft is accepted with probability min(1, p(draft) / q(draft)); otherwise
  //           the token is drawn from max(0, p - q), normalised.
  // Either way the returned token is distributed as p, so speculation leaves the output
  // distribution unchanged. The token counts for the penalties like a sampled one.
  // INVALID_ARGUMENT: as Sample, a draft outside the row, draft_probs of another length, or a
  // draft the draft distribution gives no mass.
  struct Verdict {
    bool accepted = false;
    SampledToken token;
  };
  absl::StatusOr<Verdict> Verify(std::span<const float> logits, int32_t draft, std::span<const float> draft_probs);

  // The next token's draw for Backend::SampleTokens (kernels/sample_tokens.h), when this
  // request can be sampled where the logits are: no log-probabilities, no logit_bias, no
  // penalties; nullopt otherwise. It takes the same uniform draw from the seeded stream that
  // Sample would, so a seed picks the same tokens either way (but where the draw lands within
  // about 1e-6 of a boundary between two ids). CommitSampled then counts the picked id.
  std::optional<kernels::SampleParams> DeviceDraw();
  // Whether DeviceDraw would give a draw (the request needs nothing the backend's draw lacks).
  bool DrawsOnDevice() const;
  // As DeviceDraw, also for a request with logit_bias or penalties (still none with
  // log-probabilities): `logit_delta` becomes the row [vocab] to add to the logits before the
  // backend draws, what Sample adds itself (LogitAdjustments), zeros elsewhere. nullopt (and
  // nothing drawn) when the request reports log-probabilities, or a logit_bias id is outside
  // `vocab`.
  std::optional<kernels::SampleParams> DeviceDrawAdjusted(size_t vocab, std::vector<float>& logit_delta);
  // Whether DeviceDrawAdjusted would give a draw for a row of `vocab` ids.
  bool DrawsOnDeviceAdjusted(size_t vocab) const;
  // Whether the next row's logits are adjusted (a logit_bias, or penalties for tokens sampled).
  bool AdjustsLogits() const;
  // The draws of the next `rows` tokens (each row the token after the previous one: the rows of
  // a verification of rows - 1 deterministic drafts), under the same conditions as DeviceDraw and
  // only with position_keyed_draws when rows > 1: row k draws from the stream of its position,
  // exactly as Sample or Verify would draw that token. Commits nothing (CommitSampled counts
  // each token kept).
  std::optional<std::vector<kernels::SampleParams>> DeviceDraws(size_t rows);
  SampledToken CommitSampled(int32_t id);

  // The distribution Sample would draw from for this row, normalised ([vocab]; greedy: all mass
  // on the pick). Draws nothing and counts nothing.
  absl::StatusOr<std::vector<float>> Distribution(std::span<const float> logits);

 private:
  // Ids sorted per step before the walk over them sorts further (growing by 4x each time):
  // most of the mass sits in a few ids.
  static constexpr size_t kFirstSortStep = 64;

  explicit Sampler(const SamplingConfig& config) : config_(config), rng_(config.seed) {}
  // The logits with logit_bias and the penalties applied (`logits` itself when none apply):
  // each adjusted id's logit plus its LogitAdjustments delta, one float addition, as a device
  // draw adds the same delta row.
  std::span<const float> Adjust(std::span<const float> logits);
  // Every adjusted id with what is added to its logit: its logit_bias entries summed in order,
  // less frequency_penalty x count + presence_penalty for a sampled one. Ids in no order.
  std::unordered_map<int32_t, float> LogitAdjustments() const;
  void Count(int32_t id);
  // Fills logits_, probs_ (exp of the scaled logits, unnormalised), sum_, log_sum1_, order_
  // and kept_ / kept_mass_ (the candidates top-k / top-p leave) for one row.
  absl::Status Prepare(std::span<const float> raw_logits);
  // The pick from the prepared row: the argmax when greedy, else one draw over the kept set.
  int32_t Draw();
  // Counts `id` for the penalties and reports its log-probabilities from the prepared row.
  SampledToken Commit(int32_t id);
  // With position_keyed_draws: rng_ restarts on the stream of the next token's position.
  void KeyDraws();
  // The next token's draw for the backend: the uniform Draw would take, from the same stream.
  kernels::SampleParams NextDeviceDraw();
  // The sort key of an id (its adjusted logit), and order_[0, n) sorted by it.
  double Key(int32_t id) const;
  void SortPrefix(size_t n);
  // in_kept_ for the prepared row, and an id's probability under p (0 outside the kept set).
  void MarkKept();
  double TargetProbability(int32_t id) const;

  SamplingConfig config_;
  std::mt19937_64 rng_;
  std::span<const float> logits_;  // the prepared row after Adjust (valid within one call)
  std::vector<int32_t> order_;     // scratch: candidates, order_[0, sorted_) sorted
  // Past the first prefix, the unsorted candidates as rank keys (SortPrefix): ranked_[i -
  // ranked_from_] is order_[i]'s for i >= ranked_from_, the sorted ones included.
  static constexpr size_t kNotRanked = static_cast<size_t>(-1);
  std::vector<uint64_t> ranked_;   // scratch
  size_t ranked_from_ = kNotRanked;
  size_t sorted_ = 0;
  std::vector<double> probs_;      // scratch
  std::vector<double> unscaled_;   // scratch: exp(l - max) when the temperature is not 1 and logprobs are reported
  double sum_ = 0;                 // of probs_
  double log_sum1_ = 0;            // log of the temperature-1 normaliser
  size_t kept_ = 0;                // candidates after top-k / top-p (order_[0, kept_) when cut)
  double kept_mass_ = 0;           // their probs_
  // Whether SampledToken's log-probabilities are computed. Without them a draw skips the
  // temperature-1 normaliser, and greedy (argmax_only) finds the pick and nothing else.
  bool reports_logprobs() const { return config_.logprobs || config_.top_logprobs > 0; }
  bool argmax_only() const { return config_.temperature == 0 && !reports_logprobs(); }
  int32_t argmax_ = 0;             // the pick when argmax_only()
  std::vector<uint8_t> in_kept_;   // scratch: token id -> survived top-k / top-p
  std::vector<float> adjusted_;    // scratch: the logits after bias and penalties
  std::unordered_map<int32_t, int> counts_;  // token id -> times sampled in this sequence
  uint64_t committed_ = 0;                    // tokens sampled so far: the next one's position
};

}  // namespace nq::worker
