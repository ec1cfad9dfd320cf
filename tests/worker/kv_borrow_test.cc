// Issue #23's slot borrowing on the embedded default served from its release (CPU): a
// layer-major prefill borrows expert slots from the free KV cache past its span
// (services/model/kv_loan.h, services/release/prefill_experts.h). Borrowed slots give the logits
// own slots holding the same experts give, bit for bit; the borrowed records never lie in a live
// row; a conversation whose cache grows into what earlier turns borrowed gives the output of the
// same turns without borrowing; a cancelled prefill returns its borrow; a span near the cache's
// end borrows fewer slots, or none, and is still right.
#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/common/metrics/registry.h"
#include "services/common/status_macros.h"
#include "services/release/prefill_experts.h"
#include "services/release/release_experts.h"
#include "services/worker/prefill_setup.h"
#include "services/worker/sequence_runner.h"
#include "tests/common/embedded_model.h"
#include "tests/common/status_matchers.h"
#include "tests/worker/nano_model.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int64_t kContext = 1024;   // the KV cache of every model here
constexpr int64_t kChunk = 48;
constexpr int64_t kFullSpan = 64;    // every span here loads every expert it routes (slots allowing)
constexpr int kGenerated = 8;


SequenceRequest Greedy(std::vector<int32_t> prompt) {
  SequenceRequest r;
  r.prompt = std::move(prompt);
  r.sampling.temperature = 0;
  r.sampling.top_logprobs = 3;
  r.max_tokens = kGenerated;
  r.ignore_eos = true;
  return r;
}

double BorrowedGauge() {
  return metrics::Registry::Default().Gauge("nq_worker_prefill_borrowed_slots", "").Get().Value();
}

// Rows [first, last] of `t` ([kContext, row]) that bytes [offset, offset + bytes) touch.
std::pair<int64_t, int64_t> RowsOf(const kernels::Tensor& t, size_t offset, size_t bytes) {
  const size_t row = t.nbytes() / static_cast<size_t>(kContext);
  return {static_cast<int64_t>(offset / row), static_cast<int64_t>((offset + bytes - 1) / row)};
}

// Issue #23's invariant: every borrowed record lies in one tensor of `cache`, whole, in rows at or
// past `first_free_row` (never in the live rows [0, L0 + T)), and apart from every other record.
void ExpectOutsideLiveRows(const model::KvLoan& loan, const model::KvCache& cache, int64_t first_free_row) {
  for (size_t i = 0; i < loan.records().size(); ++i) {
    const model::KvLentRecord& r = loan.records()[i];
    const kernels::Tensor* t = cache.tensor(r.range.cache_layer, r.range.part);
    ASSERT_EQ(r.tensor, t) << "record " << i << " is not in the cache tensor it names";
    ASSERT_LE(r.range.offset + r.range.bytes, t->nbytes()) << "record " << i;
    EXPECT_GE(RowsOf(*t, r.range.offset, r.range.bytes).first, first_free_row)
        << "record " << i << " (" << model::KvCachePartName(r.range.part) << " of cache layer " << r.range.cache_layer
        << ") overlaps live rows below " << first_free_row;
    for (size_t j = 0; j < i; ++j) {
      const model::KvLentRecord& o = loan.records()[j];
      EXPECT_TRUE(o.tensor != r.tensor || o.range.offset + o.range.bytes <= r.range.offset ||
                  r.range.offset + r.range.bytes <= o.range.offset)
          << "records " << j << " and " << i << " overlap";
    }
  }
}

class KvBorrowTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_NO_FATAL_FAILURE(
        nq::testing::PrepareEmbeddedModelOnCpu(NQ_TOOL_BIN, NQ_SOURCE_DIR, NQ_EMBEDDED_MODEL_DIR, &backend_));
    for (auto [served, bits] : {std::pair{&borrower_, release::ExpertBits::k2Bit},
                                std::pair{&reference_, release::ExpertBits::k2Bit},
                                std::pair{&four_bit_, release::ExpertBits::k4Bit}}) {
      absl::StatusOr<release::ServedModel> loaded =
          release::LoadServedModel(NQ_EMBEDDED_MODEL_DIR, std::string(NQ_EMBEDDED_MODEL_DIR) + "/release", bits,
                                   *backend_, nullptr, {.max_tokens = kContext});
      ASSERT_THAT(loaded, IsOk());
      *served = *std::move(loaded);
    }
  }
  static void TearDownTestSuite() {
    borrower_ = {};
    reference_ = {};
    four_bit_ = {};
    delete backend_;
  }
  void SetUp() override {
    for (release::ServedModel* m : {&borrower_, &reference_, &four_bit_}) {
      m->model->ResetCache();
      m->model->SetExpertSlotSource(nullptr);
    }
  }
  static int64_t experts() { return borrower_.model->config().n_routed_experts; }
  static model::Model& borrower() { return *borrower_.model; }

  // Prefill experts with `own` slots that borrow up to `borrow` more.
  static std::unique_ptr<release::PrefillExperts> Experts(int64_t own, int64_t borrow) {
    absl::StatusOr<std::unique_ptr<release::PrefillExperts>> created = release::PrefillExperts::Create(
        *borrower_.decoder, *backend_, experts(),
        {.slots = own,
         .max_borrowed_slots = borrow,
         .full_span_tokens = kFullSpan,
         .decoder_layers = borrower_.model->config().num_hidden_layers});
    EXPECT_THAT(created, IsOk());
    return created.ok() ? *std::move(created) : nullptr;
  }

  // What a layer-major prefill handed the model.
  struct Prefill {
    std::vector<float> last;  // the prompt's last logits
    std::vector<float> next;  // the decode step after it (reads the whole cache)
    std::map<int64_t, std::vector<int32_t>> chosen;  // per MoE layer, slot of each expert
    std::map<int64_t, int64_t> borrowed;             // per MoE layer, borrowed slots in use
    std::map<int64_t, int64_t> scattered;            // per MoE layer, record addresses given
  };
  // `prompt` prefilled layer-major on `m` (at its cache's end) with `experts`, borrowing from m's
  // cache when `lend`; then one decode step. The borrowed records are checked at every layer.
  static Prefill LayerMajor(model::Model& m, release::PrefillExperts* experts, bool lend,
                            std::span<const int32_t> prompt) {
    Prefill out;
    const int64_t first_free = m.cache_length() + static_cast<int64_t>(prompt.size());
    model::Model::LayerMajorOptions options{.chunk_tokens = kChunk, .before_moe = nullptr, .cancelled = nullptr};
    if (experts != nullptr) {
      options.before_moe = [&](int64_t layer, std::span<const model::MoeRouting> chunks)
          -> absl::StatusOr<std::optional<model::Model::PrefillLayerSlots>> {
        ASSIGN_OR_RETURN(std::optional<model::Model::PrefillLayerSlots> slots, experts->BeforeMoe(layer, chunks));
        ExpectOutsideLiveRows(experts->loan(), m.kv_cache(), first_free);
        if (slots.has_value()) {
          out.chosen[layer] = slots->slot_of_expert;
          out.borrowed[layer] = experts->borrowed_slots();
          out.scattered[layer] = static_cast<int64_t>(slots->slot_records.size());
          // Own slots first, then the borrowed records, in the loan's order.
          for (int64_t i = 0; i < experts->borrowed_slots(); ++i) {
            EXPECT_EQ(slots->slot_records[static_cast<size_t>(experts->slots() + i)],
                      experts->loan().records()[static_cast<size_t>(i)].address());
          }
        }
        return slots;
      };
      experts->Begin(static_cast<int64_t>(prompt.size()), lend ? &m : nullptr);
    }
    absl::StatusOr<std::vector<float>> last = m.PrefillLayerMajor(prompt, options);
    if (experts != nullptr) experts->End();
    EXPECT_THAT(last, IsOk());
    absl::StatusOr<std::vector<float>> next = m.Forward(prompt.first(1));
    EXPECT_THAT(next, IsOk());
    out.last = last.value_or(std::vector<float>{});
    out.next = next.value_or(std::vector<float>{});
    return out;
  }
  // Nothing borrowed remains: the prefill experts hold no loan, the cache has none out, and the
  // gauge is back where it was.
  static void ExpectReturned(const release::PrefillExperts& experts, const model::Model& m, double gauge_before) {
    EXPECT_EQ(experts.borrowed_slots(), 0);
    EXPECT_FALSE(experts.loan().outstanding());
    EXPECT_FALSE(m.kv_cache().lent_from().has_value());
    EXPECT_EQ(BorrowedGauge(), gauge_before);
  }
  static std::unique_ptr<SequenceRunner> Runner(model::Model& m, release::PrefillExperts* experts, bool lend) {
    auto runner = std::make_unique<SequenceRunner>(&m, std::vector<int32_t>{});
    PrefillOptions options{.chunk_tokens = kChunk, .layer_major_min_tokens = kFullSpan};
    AttachPrefillExperts(experts, lend ? &m : nullptr, options);
    EXPECT_THAT(runner->SetPrefillOptions(std::move(options)), IsOk());
    return runner;
  }
  static testing::RunResult Run(SequenceRunner& runner, const SequenceRequest& request) {
    absl::StatusOr<testing::RunResult> result = testing::Generate(runner, request);
    EXPECT_THAT(result, IsOk());
    return result.ok() ? *result : testing::RunResult{};
  }
  static void ExpectSame(const testing::RunResult& a, const testing::RunResult& b, const std::string& what) {
    ASSERT_EQ(a.ids.size(), static_cast<size_t>(kGenerated)) << what;
    EXPECT_EQ(a.ids, b.ids) << what;
    EXPECT_EQ(a.logprobs, b.logprobs) << what;  // bit for bit
    ASSERT_FALSE(a.steps.empty());
    ASSERT_FALSE(b.steps.empty());
    EXPECT_EQ(a.steps[0].tokens[0].top, b.steps[0].tokens[0].top) << what;  // the prefill's last row
  }

  static kernels::Backend* backend_;
  static release::ServedModel borrower_;   // borrows from its own cache
  static release::ServedModel reference_;  // the same model, never lending
  static release::ServedModel four_bit_;   // every record resident: token order at a chosen precision
};
kernels::Backend* KvBorrowTest::backend_ = nullptr;
release::ServedModel KvBorrowTest::borrower_;
release::ServedModel KvBorrowTest::reference_;
release::ServedModel KvBorrowTest::four_bit_;

// With no own slots, or 3, and the rest borrowed, every expert the span routes runs at 4 bits
// from records in the free KV cache: the prompt's logits and the next step's (which reads the
// whole cache, so the span's KV rows too) are those of own slots holding the same experts.
TEST_F(KvBorrowTest, BorrowedSlotsGiveTheOwnSlotsPrefillBitForBit) {
  const std::vector<int32_t> prompt = testing::HeldOutText(3000, 300);
  const double gauge_before = BorrowedGauge();
  std::unique_ptr<release::PrefillExperts> own = Experts(experts(), 0);
  ASSERT_NE(own, nullptr);
  EXPECT_EQ(own->max_borrowed_slots(), 0) << "own slots for every expert: nothing to borrow";
  reference_.model->ResetCache();
  const Prefill with_own = LayerMajor(*reference_.model, own.get(), false, prompt);
  EXPECT_EQ(own->totals().CallShare4Bit(), 1.0);
  reference_.model->ResetCache();
  const Prefill all_2bit = LayerMajor(*reference_.model, nullptr, false, prompt);
  ASSERT_FALSE(with_own.last.empty());
  ASSERT_NE(with_own.last, all_2bit.last) << "the 4-bit experts made a difference";

  for (const int64_t own_slots : {int64_t{0}, int64_t{3}}) {
    SCOPED_TRACE(absl::StrCat(own_slots, " own slots"));
    borrower().ResetCache();
    std::unique_ptr<release::PrefillExperts> borrowing = Experts(own_slots, experts());
    ASSERT_NE(borrowing, nullptr);
    ASSERT_EQ(borrowing->max_borrowed_slots(), experts() - own_slots);
    ASSERT_EQ(borrower().LendableKvRecords(300, borrowing->slot_bytes(), experts()), experts())
        << "a 1024-token cache lends every expert's slot past 300 tokens";
    const Prefill borrowed = LayerMajor(borrower(), borrowing.get(), true, prompt);
    EXPECT_EQ(borrowed.last, with_own.last);
    EXPECT_EQ(borrowed.next, with_own.next);
    ASSERT_EQ(borrowed.chosen.size(), 4u);  // glm5_nano: MoE layers 1-4
    for (const auto& [layer, slot_of] : borrowed.chosen) {
      EXPECT_EQ(borrowed.borrowed.at(layer), experts() - own_slots) << "layer " << layer;
      EXPECT_EQ(borrowed.scattered.at(layer), experts()) << "layer " << layer;
      int64_t in_borrowed = 0;
      for (int32_t s : slot_of) in_borrowed += s >= own_slots ? 1 : 0;
      EXPECT_GT(in_borrowed, 0) << "layer " << layer << ": no expert ran from a borrowed slot";
    }
    EXPECT_EQ(borrowing->totals().CallShare4Bit(), 1.0);
    EXPECT_EQ(borrowing->prefills_borrowed(), 1);
    ExpectReturned(*borrowing, borrower(), gauge_before);
  }
}

// Spans at several places of the cache: the loan is carved past each span's end, in rows no
// forward has written, and the most that fits (up to every expert a layer has beyond its own).
TEST_F(KvBorrowTest, BorrowedRecordsNeverOverlapLiveKv) {
  std::unique_ptr<release::PrefillExperts> borrowing = Experts(2, experts());
  ASSERT_NE(borrowing, nullptr);
  for (auto [cached, span] : std::vector<std::pair<int64_t, int64_t>>{{0, 100}, {200, 150}, {500, 300}}) {
    SCOPED_TRACE(absl::StrCat(cached, " tokens cached, a span of ", span));
    borrower().ResetCache();
    if (cached > 0) {
      ASSERT_THAT(borrower().ForwardLast(testing::HeldOutText(6000, static_cast<size_t>(cached))), IsOk());
    }
    borrowing->Begin(span, &borrower());
    const int64_t lendable = borrower().LendableKvRecords(cached + span, borrowing->slot_bytes(), experts() - 2);
    EXPECT_EQ(borrowing->borrowed_slots(), lendable);
    EXPECT_GT(lendable, 0);
    EXPECT_EQ(borrower().kv_cache().lent_from(), cached + span);
    ExpectOutsideLiveRows(borrowing->loan(), borrower().kv_cache(), cached + span);
    // The cache refuses to grow into the loan while it is out.
    EXPECT_THAT(borrower().ForwardLast(testing::HeldOutText(7000, static_cast<size_t>(span + 1))),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("lent")));
    borrowing->End();
    EXPECT_FALSE(borrower().kv_cache().lent_from().has_value());
    EXPECT_THAT(borrower().ForwardLast(testing::HeldOutText(7000, static_cast<size_t>(span + 1))), IsOk());
  }
}

// The stress test: a conversation whose every turn resends the last and adds to it, so each
// turn's prefill writes KV rows that the turn before had lent out as expert slots. Every turn's
// output is the same turn's without borrowing (own slots for every expert): the borrowed records
// never corrupted a KV row, and a new turn's KV rows never corrupted a borrowed record.
TEST_F(KvBorrowTest, AConversationGrowingIntoBorrowedRoomGivesTheOutputWithoutBorrowing) {
  const double gauge_before = BorrowedGauge();
  std::unique_ptr<release::PrefillExperts> borrowing = Experts(2, experts());
  std::unique_ptr<release::PrefillExperts> own = Experts(experts(), 0);
  ASSERT_NE(borrowing, nullptr);
  ASSERT_NE(own, nullptr);
  SequenceRunner runner_with_hooks(&borrower(), {});
  SequenceRunner* runner = &runner_with_hooks;
  std::unique_ptr<SequenceRunner> reference = Runner(*reference_.model, own.get(), false);
  // Each turn's loan, as rows of its cache tensors.
  struct Piece {
    const kernels::Tensor* tensor;
    std::pair<int64_t, int64_t> rows;
  };
  std::vector<Piece> lent_last_turn;
  PrefillOptions hooks{.chunk_tokens = kChunk, .layer_major_min_tokens = kFullSpan};
  AttachPrefillExperts(borrowing.get(), &borrower(), hooks);
  hooks.begin_layer_major = [&, begin = hooks.begin_layer_major](int64_t span) {
    begin(span);
    ExpectOutsideLiveRows(borrowing->loan(), borrower().kv_cache(), borrower().cache_length() + span);
    for (const model::KvLentRecord& r : borrowing->loan().records()) {
      lent_last_turn.push_back({r.tensor, RowsOf(*r.tensor, r.range.offset, r.range.bytes)});
    }
  };
  ASSERT_THAT(runner->SetPrefillOptions(hooks), IsOk());

  std::vector<int32_t> conversation = testing::HeldOutText(9000, 150);
  int64_t cached_before = 0;
  for (int turn = 0; turn < 4; ++turn) {
    SCOPED_TRACE(absl::StrCat("turn ", turn));
    const std::vector<Piece> lent_before = lent_last_turn;
    lent_last_turn.clear();
    const SequenceRequest request = Greedy(conversation);
    const testing::RunResult result = Run(*runner, request);
    ExpectSame(result, Run(*reference, request), "with and without borrowing");
    EXPECT_EQ(borrowing->prefills_borrowed(), turn + 1);
    ASSERT_FALSE(lent_last_turn.empty()) << "this turn's prefill borrowed nothing";
    EXPECT_EQ(static_cast<int64_t>(lent_last_turn.size()), experts() - 2) << "room for every expert";
    ExpectReturned(*borrowing, borrower(), gauge_before);
    // This turn's prefill wrote rows [cached_before, cache) of every layer; some of them held a
    // record the turn before borrowed.
    const int64_t cache = borrower().cache_length();
    if (turn > 0) {
      int64_t reused = 0;
      for (const Piece& p : lent_before) reused += p.rows.first < cache && p.rows.second >= cached_before ? 1 : 0;
      EXPECT_GT(reused, 0) << "the cache did not grow into the rows the last turn borrowed";
    }
    cached_before = cache;
    // The next turn: this turn's reply and 150 tokens of new text (a long span: layer-major).
    conversation.insert(conversation.end(), result.ids.begin(), result.ids.end());
    const std::vector<int32_t> user = testing::HeldOutText(9200 + 150 * static_cast<size_t>(turn), 150);
    conversation.insert(conversation.end(), user.begin(), user.end());
  }
  EXPECT_EQ(borrowing->totals().CallShare4Bit(), 1.0);
}

// A client that leaves mid-prefill: the prefill stops with the borrow out, and the runner's end
// hook returns it; the next request runs as if nothing had been borrowed.
TEST_F(KvBorrowTest, ACancelledPrefillReturnsItsBorrow) {
  const double gauge_before = BorrowedGauge();
  std::unique_ptr<release::PrefillExperts> borrowing = Experts(0, experts());
  std::unique_ptr<release::PrefillExperts> own = Experts(experts(), 0);
  ASSERT_NE(borrowing, nullptr);
  ASSERT_NE(own, nullptr);
  SequenceRunner runner_with_hooks(&borrower(), {});
  SequenceRunner* runner = &runner_with_hooks;
  PrefillOptions hooks{.chunk_tokens = kChunk, .layer_major_min_tokens = kFullSpan};
  AttachPrefillExperts(borrowing.get(), &borrower(), hooks);
  int moe_layers_run = 0;
  double gauge_in_prefill = 0;
  hooks.before_moe = [&, before = hooks.before_moe](int64_t layer, std::span<const model::MoeRouting> chunks) {
    ++moe_layers_run;
    gauge_in_prefill = BorrowedGauge();
    return before(layer, chunks);
  };
  ASSERT_THAT(runner->SetPrefillOptions(hooks), IsOk());
  const SequenceRequest request = Greedy(testing::HeldOutText(12000, 400));
  std::vector<SequenceStep> steps;
  // The client goes away during the second MoE layer's experts.
  absl::StatusOr<SequenceStats> stats = runner->Run(
      request,
      [&](const SequenceStep& step) {
        steps.push_back(step);
        return true;
      },
      [&] { return moe_layers_run >= 2; });
  ASSERT_THAT(stats, IsOk());
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0].finish, nq::v1::FINISH_REASON_ABORT);
  EXPECT_EQ(moe_layers_run, 2);
  EXPECT_EQ(gauge_in_prefill - gauge_before, static_cast<double>(experts())) << "the prefill ran on borrowed slots";
  EXPECT_EQ(borrower().cache_length(), 0) << "a cancelled layer-major prefill keeps nothing of its span";
  ExpectReturned(*borrowing, borrower(), gauge_before);
  // The next request: the same prompt, prefilled and decoded as without borrowing.
  moe_layers_run = -1000;
  const testing::RunResult next = Run(*runner, request);
  ExpectSame(next, Run(*Runner(*reference_.model, own.get(), false), request), "after a cancelled prefill");
  EXPECT_EQ(borrowing->prefills_borrowed(), 2);
  ExpectReturned(*borrowing, borrower(), gauge_before);
}

// A span that ends near the cache's end leaves room for fewer records, or none: the prefill
// borrows what fits and equals token order with exactly the experts it held at 4 bits; with none
// (and no own slots) it runs at the model's own precision.
TEST_F(KvBorrowTest, NearTheCachesEndFewerSlotsOrNoneAndStillRight) {
  std::unique_ptr<release::PrefillExperts> borrowing = Experts(0, experts());
  ASSERT_NE(borrowing, nullptr);
  const int64_t slot_bytes = borrowing->slot_bytes();
  {
    SCOPED_TRACE("a 900-token span: some slots");
    const std::vector<int32_t> prompt = testing::HeldOutText(1000, 900);
    const int64_t lendable = borrower().LendableKvRecords(900, slot_bytes, experts());
    ASSERT_GT(lendable, 0);
    ASSERT_LT(lendable, experts());
    const Prefill borrowed = LayerMajor(borrower(), borrowing.get(), true, prompt);
    ASSERT_EQ(borrowed.chosen.size(), 4u);
    for (const auto& [layer, slot_of] : borrowed.chosen) {
      EXPECT_EQ(borrowed.borrowed.at(layer), lendable);
      int64_t held = 0;
      for (int32_t s : slot_of) held += s >= 0 ? 1 : 0;
      EXPECT_EQ(held, lendable) << "layer " << layer << ": a 900-token span routes more experts than fit";
    }
    four_bit_.model->SetExpertSlotSource([&](int64_t layer, int32_t expert, int64_t) {
      return borrowed.chosen.at(layer)[expert] >= 0 ? expert : -1;
    });
    std::vector<float> last;
    for (size_t at = 0; at < prompt.size(); at += kChunk) {
      absl::StatusOr<std::vector<float>> logits = four_bit_.model->ForwardLast(
          std::span<const int32_t>(prompt).subspan(at, std::min<size_t>(kChunk, prompt.size() - at)));
      ASSERT_THAT(logits, IsOk());
      last = *std::move(logits);
    }
    EXPECT_EQ(borrowed.last, last);
  }
  {
    SCOPED_TRACE("a 1000-token span: no room");
    borrower().ResetCache();
    reference_.model->ResetCache();
    const std::vector<int32_t> prompt = testing::HeldOutText(2000, 1000);
    ASSERT_EQ(borrower().LendableKvRecords(1000, slot_bytes, experts()), 0);
    const int64_t borrowed_before = borrowing->prefills_borrowed();
    const Prefill none = LayerMajor(borrower(), borrowing.get(), true, prompt);
    EXPECT_TRUE(none.chosen.empty()) << "no slot: every layer on the model's own slots";
    EXPECT_EQ(borrowing->prefills_borrowed(), borrowed_before);
    const Prefill plain = LayerMajor(*reference_.model, nullptr, false, prompt);
    ASSERT_FALSE(plain.last.empty());
    EXPECT_EQ(none.last, plain.last);
    EXPECT_EQ(none.next, plain.next);
  }
}

TEST_F(KvBorrowTest, BadSlotCountsAreRefusedByName) {
  EXPECT_THAT(ValidatePrefillFlags({.expert_slots = -2}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--prefill_expert_slots=-2: want -1 (every expert), 0 (none of its own: borrowed "
                                 "slots only, with --prefill_borrow_kv)")));
  const model::ModelConfig& config = borrower().config();
  for (auto [own, borrow] : std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {-1, 4}, {2, -3}}) {
    EXPECT_THAT(release::PrefillExperts::Create(*borrower_.decoder, *backend_, experts(),
                                                {.slots = own, .max_borrowed_slots = borrow,
                                                 .decoder_layers = config.num_hidden_layers}),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr(absl::StrCat(own, " slots, ", borrow, " to borrow"))));
  }
}

// The worker's wiring: --prefill_expert_slots are the own slots, --prefill_borrow_kv adds what the
// cache lends past the shortest layer-major span, up to a layer's every expert.
TEST_F(KvBorrowTest, TheWorkersFlagsSizeTheBorrow) {
  const int64_t E = experts();
  auto create = [&](PrefillFlags flags) {
    absl::StatusOr<std::unique_ptr<release::PrefillExperts>> created =
        CreatePrefillExperts(borrower(), *borrower_.decoder, nullptr, *backend_, flags);
    EXPECT_THAT(created, IsOk());
    return created.ok() ? *std::move(created) : nullptr;
  };
  std::unique_ptr<release::PrefillExperts> small = create({.layer_major_min_tokens = 256, .expert_slots = 4});
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->slots(), 4);
  EXPECT_EQ(small->max_borrowed_slots(), E - 4);
  EXPECT_EQ(MaxBorrowedSlots(borrower(), small->slot_bytes(), 4, 256), E - 4);
  std::unique_ptr<release::PrefillExperts> off =
      create({.layer_major_min_tokens = 256, .expert_slots = 4, .borrow_kv = false});
  ASSERT_NE(off, nullptr);
  EXPECT_EQ(off->max_borrowed_slots(), 0);
  std::unique_ptr<release::PrefillExperts> all = create({.layer_major_min_tokens = 256, .expert_slots = -1});
  ASSERT_NE(all, nullptr);
  EXPECT_EQ(all->max_borrowed_slots(), 0) << "own slots for every expert";
  std::unique_ptr<release::PrefillExperts> borrowed_only = create({.layer_major_min_tokens = 256, .expert_slots = 0});
  ASSERT_NE(borrowed_only, nullptr);
  EXPECT_EQ(borrowed_only->slots(), 0);
  EXPECT_EQ(borrowed_only->max_borrowed_slots(), E);
  // No own slots and no borrowing, or a cache that lends nothing past the shortest span: no
  // prefill experts (layer-major at the decode precision).
  EXPECT_EQ(create({.layer_major_min_tokens = 256, .expert_slots = 0, .borrow_kv = false}), nullptr);
  EXPECT_EQ(create({.layer_major_min_tokens = 1020, .expert_slots = 0}), nullptr);
  EXPECT_LT(MaxBorrowedSlots(borrower(), small->slot_bytes(), 0, 900), E);
}

}  // namespace
}  // namespace nq::worker
