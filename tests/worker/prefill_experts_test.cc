// The layer-major prefill's own 4-bit experts (issue #23) on the embedded default served from
// its release (CPU): with every routed expert in budget the prefill is the all-4-bit model's,
// bit for bit; with a budget it holds the span's most-routed experts at 4 bits and equals a
// token-order prefill that runs exactly those at 4 bits; the share of 4-bit calls is counted.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/release/release_experts.h"
#include "services/release/prefill_experts.h"
#include "services/worker/arena_geometry.h"
#include "services/worker/prefill_bench.h"
#include "services/worker/prefill_record_reader.h"
#include "services/worker/slot_runtime.h"
#include "services/worker/slot_table.h"
#include "tests/common/embedded_model.h"
#include "tests/common/status_matchers.h"

namespace nq::worker {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int64_t kPromptTokens = 300;
constexpr int64_t kChunk = 64;

class PrefillExpertsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ASSERT_NO_FATAL_FAILURE(
        nq::testing::PrepareEmbeddedModelOnCpu(NQ_TOOL_BIN, NQ_SOURCE_DIR, NQ_EMBEDDED_MODEL_DIR, &backend_));
    for (auto [served, bits] : {std::pair{&two_bit_, release::ExpertBits::k2Bit},
                                std::pair{&four_bit_, release::ExpertBits::k4Bit}}) {
      absl::StatusOr<release::ServedModel> loaded =
          release::LoadServedModel(NQ_EMBEDDED_MODEL_DIR, std::string(NQ_EMBEDDED_MODEL_DIR) + "/release", bits,
                                   *backend_, nullptr, {.max_tokens = 1024});
      ASSERT_THAT(loaded, IsOk());
      *served = *std::move(loaded);
    }
    std::ifstream in(std::string(NQ_SOURCE_DIR) + "/models/glm5_nano/eval/stdlib_code.tokens.json");
    std::stringstream text;
    text << in.rdbuf();
    const std::vector<int32_t> ids = nlohmann::json::parse(text.str()).get<std::vector<int32_t>>();
    ASSERT_GT(ids.size(), static_cast<size_t>(kPromptTokens + 1000));
    prompt_.assign(ids.begin() + 1000, ids.begin() + 1000 + kPromptTokens);
  }
  static void TearDownTestSuite() {
    two_bit_ = {};
    four_bit_ = {};
    delete backend_;
  }
  void SetUp() override {
    two_bit_.model->ResetCache();
    four_bit_.model->ResetCache();
    four_bit_.model->SetExpertSlotSource(nullptr);
    two_bit_.model->SetExpertSlotSource(nullptr);
  }
  int64_t experts() const { return two_bit_.model->config().n_routed_experts; }
  int64_t layers() const { return two_bit_.model->config().num_hidden_layers; }
  // MoE layers of the decoder stack (the release also holds the MTP layer's).
  double MoeLayers() const {
    double n = 0;
    for (uint32_t l : two_bit_.decoder->moe_layer_ids()) n += l < layers() ? 1 : 0;
    return n;
  }

  // The 2-bit model's layer-major prefill of the prompt with `prefill`'s 4-bit experts, then one
  // decode step; `chosen` receives each MoE layer's 4-bit experts.
  std::pair<std::vector<float>, std::vector<float>> LayerMajor(release::PrefillExperts& prefill,
                                                               std::map<int64_t, std::vector<int32_t>>* chosen,
                                                               std::map<int64_t, std::vector<int64_t>>* calls) {
    model::Model::LayerMajorOptions options{.chunk_tokens = kChunk};
    options.before_moe = [&](int64_t layer, std::span<const model::MoeRouting> chunks)
        -> absl::StatusOr<std::optional<model::Model::PrefillLayerSlots>> {
      ASSIGN_OR_RETURN(std::optional<model::Model::PrefillLayerSlots> slots, prefill.BeforeMoe(layer, chunks));
      if (slots.has_value()) (*chosen)[layer] = slots->slot_of_expert;
      std::vector<int64_t>& n = (*calls)[layer];
      n.assign(static_cast<size_t>(experts()), 0);
      for (const model::MoeRouting& r : chunks) {
        for (int32_t e : r.experts) ++n[static_cast<size_t>(e)];
      }
      return slots;
    };
    prefill.Begin(kPromptTokens);
    absl::StatusOr<std::vector<float>> last = two_bit_.model->PrefillLayerMajor(prompt_, options);
    prefill.End();
    EXPECT_THAT(last, IsOk());
    absl::StatusOr<std::vector<float>> next = two_bit_.model->Forward(std::span<const int32_t>(prompt_).first(1));
    EXPECT_THAT(next, IsOk());
    return {last.value_or(std::vector<float>{}), next.value_or(std::vector<float>{})};
  }
  // Token-order prefill (chunks of kChunk) on `m`, then the same decode step (every expert at
  // 2 bits, as the 2-bit model decodes above).
  static std::pair<std::vector<float>, std::vector<float>> TokenOrder(model::Model& m) {
    std::vector<float> last;
    for (int64_t at = 0; at < kPromptTokens; at += kChunk) {
      absl::StatusOr<std::vector<float>> logits = m.ForwardLast(
          std::span<const int32_t>(prompt_).subspan(at, std::min(kChunk, kPromptTokens - at)));
      EXPECT_THAT(logits, IsOk());
      last = logits.value_or(std::vector<float>{});
    }
    m.SetExpertSlotSource([](int64_t, int32_t, int64_t) { return -1; });
    absl::StatusOr<std::vector<float>> next = m.Forward(std::span<const int32_t>(prompt_).first(1));
    EXPECT_THAT(next, IsOk());
    return {last, next.value_or(std::vector<float>{})};
  }

  static kernels::Backend* backend_;
  static release::ServedModel two_bit_;
  static release::ServedModel four_bit_;
  static std::vector<int32_t> prompt_;
};
kernels::Backend* PrefillExpertsTest::backend_ = nullptr;
release::ServedModel PrefillExpertsTest::two_bit_;
release::ServedModel PrefillExpertsTest::four_bit_;
std::vector<int32_t> PrefillExpertsTest::prompt_;

TEST_F(PrefillExpertsTest, RefusesAnEmptyBudget) {
  EXPECT_THAT(release::PrefillExperts::Create(*two_bit_.decoder, *backend_, experts(), {.slots = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 slots")));
}

TEST_F(PrefillExpertsTest, EveryRoutedExpertInBudgetIsTheAll4BitModelBitForBit) {
  absl::StatusOr<std::unique_ptr<release::PrefillExperts>> prefill =
      release::PrefillExperts::Create(*two_bit_.decoder, *backend_, experts(), {.slots = experts(), .full_span_tokens = 256, .decoder_layers = layers()});
  ASSERT_THAT(prefill, IsOk());
  std::map<int64_t, std::vector<int32_t>> chosen;
  std::map<int64_t, std::vector<int64_t>> calls;
  const auto layer_major = LayerMajor(**prefill, &chosen, &calls);
  const auto all_4bit = TokenOrder(*four_bit_.model);
  const auto all_2bit = TokenOrder(*two_bit_.model);
  ASSERT_FALSE(layer_major.first.empty());
  EXPECT_EQ(layer_major.first, all_4bit.first);
  EXPECT_EQ(layer_major.second, all_4bit.second);  // the KV cache too
  EXPECT_NE(layer_major.first, all_2bit.first);    // the precision made a difference
  const release::PrefillExpertStats& stats = (*prefill)->totals();
  const double moe_layers = MoeLayers();
  ASSERT_EQ(moe_layers, 4);  // glm5_nano: layers 1-4
  EXPECT_EQ(stats.calls_4bit, kPromptTokens * moe_layers * two_bit_.model->config().num_experts_per_tok);
  EXPECT_EQ(stats.calls_2bit, 0);
  EXPECT_EQ(stats.CallShare4Bit(), 1.0);
  // With every expert in budget the prefetch (the manifest's ranking, all of it) left nothing
  // to read late.
  EXPECT_EQ(stats.records_read_late, 0);
  EXPECT_GT(stats.records_prefetched_used, 0);
}

TEST_F(PrefillExpertsTest, ABudgetHoldsTheMostRoutedExpertsAndMatchesTokenOrderAtTheSamePrecision) {
  // 300 of 1200 tokens: a quarter of the 32 slots, 8 experts per layer.
  absl::StatusOr<std::unique_ptr<release::PrefillExperts>> prefill =
      release::PrefillExperts::Create(*two_bit_.decoder, *backend_, experts(), {.slots = experts(), .full_span_tokens = 1200, .decoder_layers = layers()});
  ASSERT_THAT(prefill, IsOk());
  ASSERT_EQ((*prefill)->Budget(kPromptTokens).prefetch, experts() / 4);
  ASSERT_FALSE((*prefill)->Budget(kPromptTokens).by_time) << "nothing measured yet: the budget by tokens";
  std::map<int64_t, std::vector<int32_t>> chosen;
  std::map<int64_t, std::vector<int64_t>> calls;
  const auto layer_major = LayerMajor(**prefill, &chosen, &calls);
  ASSERT_EQ(static_cast<double>(chosen.size()), MoeLayers());
  for (const auto& [layer, slot_of] : chosen) {
    const std::vector<int64_t>& n = calls[layer];
    std::vector<int32_t> order(static_cast<size_t>(experts()));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return n[a] > n[b]; });
    // The budget's most-routed experts run at 4 bits; what else the prefetch brought may too,
    // but only experts the span routes take a slot.
    for (int64_t i = 0; i < experts() / 4; ++i) {
      EXPECT_GE(slot_of[order[i]], 0) << "layer " << layer << ": the #" << i << " most-routed expert ran at 2 bits";
    }
    int64_t held = 0;
    for (int64_t e = 0; e < experts(); ++e) {
      if (slot_of[e] < 0) continue;
      ++held;
      EXPECT_GT(n[e], 0) << "layer " << layer << " holds expert " << e << ", which the span never routes";
    }
    EXPECT_LT(held, experts()) << "layer " << layer;
  }
  // The all-4-bit model's records, but only the experts the prefill held at 4 bits.
  four_bit_.model->SetExpertSlotSource([&](int64_t layer, int32_t expert, int64_t) {
    return chosen.at(layer)[expert] >= 0 ? expert : -1;
  });
  const auto same_precision = TokenOrder(*four_bit_.model);
  EXPECT_EQ(layer_major.first, same_precision.first);
  EXPECT_EQ(layer_major.second, same_precision.second);
  const double share = (*prefill)->totals().CallShare4Bit();
  EXPECT_GT(share, 0.25);  // the most-routed quarter of the experts serve more than a quarter of the calls
  EXPECT_LT(share, 1.0);
}

// Issue #23's time budget: the prefetch reads what one layer's compute hides, the late reads a
// quarter of that, each at least what the arithmetic gives and at most the slots.
TEST(ReadTimeBudgetTest, ReadsWhatALayersComputeHidesAndAShareMoreLate) {
  // 10 us a token a layer over 1000 tokens: 10 ms of compute, 10 MB at 1 GB/s, 10 records of 1 MB.
  const release::PrefillTimings timings{.seconds_per_token_layer = 1e-5, .read_bytes_per_second = 1e9};
  release::PrefillReadBudget b = release::ReadTimeBudget(timings, 1000, 1'000'000, 256, 0.25);
  EXPECT_EQ(b.prefetch, 10);
  EXPECT_EQ(b.late, 2);  // 2.5 records' time: whole records only
  EXPECT_TRUE(b.by_time);
  // Twice the tokens, twice the reads; a slower drive, fewer.
  EXPECT_EQ(release::ReadTimeBudget(timings, 2000, 1'000'000, 256, 0.25).prefetch, 20);
  EXPECT_EQ(release::ReadTimeBudget({.seconds_per_token_layer = 1e-5, .read_bytes_per_second = 2.5e8}, 1000,
                                    1'000'000, 256, 0.25).prefetch,
            2);
  // At most the slots; at least one prefetched record, and no late read when a quarter of the
  // compute does not cover one.
  EXPECT_EQ(release::ReadTimeBudget(timings, 1'000'000, 1'000'000, 256, 0.25).prefetch, 256);
  EXPECT_EQ(release::ReadTimeBudget(timings, 1'000'000, 1'000'000, 256, 0.25).late, 256);
  b = release::ReadTimeBudget(timings, 10, 1'000'000, 256, 0.25);
  EXPECT_EQ(b.prefetch, 1);
  EXPECT_EQ(b.late, 0);
}

// After one prefill the object has timed a layer's compute and its reads, and the next prefill's
// budget is by time; that prefill's reads keep within it, layer by layer.
TEST_F(PrefillExpertsTest, OncePrefillsAreTimedTheBudgetIsByTimeAndReadsKeepWithinIt) {
  absl::StatusOr<std::unique_ptr<release::PrefillExperts>> prefill = release::PrefillExperts::Create(
      *two_bit_.decoder, *backend_, experts(), {.slots = experts(), .full_span_tokens = 1 << 20, .decoder_layers = layers()});
  ASSERT_THAT(prefill, IsOk());
  EXPECT_FALSE((*prefill)->timings().measured());
  std::map<int64_t, std::vector<int32_t>> chosen;
  std::map<int64_t, std::vector<int64_t>> calls;
  LayerMajor(**prefill, &chosen, &calls);
  const release::PrefillTimings timings = (*prefill)->timings();
  ASSERT_TRUE(timings.measured()) << "a prefill of " << MoeLayers() << " MoE layers times their compute and reads";
  const release::PrefillReadBudget budget = (*prefill)->Budget(kPromptTokens);
  EXPECT_TRUE(budget.by_time);
  const int64_t rec_bytes = (*prefill)->slot_bytes();
  const release::PrefillReadBudget expected = release::ReadTimeBudget(timings, kPromptTokens, rec_bytes, experts(), 0.25);
  EXPECT_EQ(budget.prefetch, expected.prefetch);
  EXPECT_EQ(budget.late, expected.late);

  const release::PrefillExpertStats before = (*prefill)->totals();
  two_bit_.model->ResetCache();
  chosen.clear();
  LayerMajor(**prefill, &chosen, &calls);
  const release::PrefillExpertStats& after = (*prefill)->totals();
  const int64_t layers_run = static_cast<int64_t>(chosen.size());
  EXPECT_LE(after.records_read_late - before.records_read_late, budget.late * layers_run);
  EXPECT_LE(after.records_prefetched_used - before.records_prefetched_used, budget.prefetch * layers_run);
  // The budget's most-routed experts that the prefetch or a late read brought ran at 4 bits,
  // and no more than the budget allows (the rest of the calls at 2 bits when it is short).
  for (const auto& [layer, slot_of] : chosen) {
    int64_t held = 0;
    for (int32_t s : slot_of) held += s >= 0 ? 1 : 0;
    EXPECT_LE(held, budget.prefetch + budget.late) << "layer " << layer;
  }
}

// A record damaged on disk fails its checksum when the prefill reads it: that expert runs at 2
// bits in its layer, the prefetch still reads the rest of the layer, and the prefill completes
// with the logits of token order at exactly that precision.
TEST_F(PrefillExpertsTest, ADamagedRecordRunsItsExpertAt2BitsAndTheRestAt4) {
  namespace fs = std::filesystem;
  const fs::path copy = fs::temp_directory_path() / absl::StrCat("nq-prefill-damaged-", getpid());
  fs::remove_all(copy);
  fs::copy(std::string(NQ_EMBEDDED_MODEL_DIR) + "/release", copy, fs::copy_options::recursive);
  const uint32_t layer = two_bit_.decoder->moe_layer_ids().front();
  constexpr int32_t kDamaged = 3;
  absl::StatusOr<const format::LayerEntry*> entry = two_bit_.decoder->release().Layer(0, layer);
  ASSERT_THAT(entry, IsOk());
  {
    const std::string path = (copy / (*entry)->records.file).string();
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const std::streamoff at = static_cast<std::streamoff>((*entry)->records.offset + kDamaged * (*entry)->layout.rec_bytes + 7);
    f.seekg(at);
    char c = 0;
    f.get(c);
    f.seekp(at);
    f.put(static_cast<char>(c ^ 0x40));
  }
  absl::StatusOr<std::unique_ptr<release::ReleaseExpertDecoder>> damaged = release::ReleaseExpertDecoder::Open(
      copy.string(), NQ_EMBEDDED_MODEL_DIR, two_bit_.model->config(), {});
  ASSERT_THAT(damaged, IsOk()) << "record files are checked as they are read, not at open";
  for (const bool io_uring : {false, true}) {
    SCOPED_TRACE(io_uring ? "read through the io_uring store" : "read with pread");
    two_bit_.model->ResetCache();
    four_bit_.model->ResetCache();
    four_bit_.model->SetExpertSlotSource(nullptr);
    release::PrefillExpertsOptions options{.slots = experts(), .full_span_tokens = 256, .decoder_layers = layers()};
    if (io_uring) {
      absl::StatusOr<std::unique_ptr<RecordStorePrefillReader>> reader = RecordStorePrefillReader::Open(copy.string(), 0);
      ASSERT_THAT(reader, IsOk());
      options.reader = *std::move(reader);
    }
    absl::StatusOr<std::unique_ptr<release::PrefillExperts>> prefill =
        release::PrefillExperts::Create(**damaged, *backend_, experts(), options);
    ASSERT_THAT(prefill, IsOk());
    std::map<int64_t, std::vector<int32_t>> chosen;
    std::map<int64_t, std::vector<int64_t>> calls;
    const auto layer_major = LayerMajor(**prefill, &chosen, &calls);
    ASSERT_FALSE(layer_major.first.empty());
    ASSERT_GT(calls[layer][kDamaged], 0) << "the prompt routes the damaged expert (pick another one)";
    EXPECT_EQ(chosen[layer][kDamaged], -1) << "the damaged record ran at 4 bits";
    for (const auto& [l, slot_of] : chosen) {
      for (int32_t e = 0; e < experts(); ++e) {
        if (calls[l][e] == 0 || (l == layer && e == kDamaged)) continue;
        EXPECT_GE(slot_of[e], 0) << "layer " << l << " expert " << e << " ran at 2 bits";
      }
    }
    // The prefetch read past the damaged record: nothing else of that layer had to be read late.
    EXPECT_EQ((*prefill)->totals().records_read_late, 0);
    four_bit_.model->SetExpertSlotSource([&](int64_t l, int32_t expert, int64_t) {
      return chosen.at(l)[expert] >= 0 ? expert : -1;
    });
    const auto same_precision = TokenOrder(*four_bit_.model);
    EXPECT_EQ(layer_major.first, same_precision.first);
  }
  fs::remove_all(copy);
}

// The worker's reads go through the streamer's io_uring store, a batch at once: the prefill is
// the all-4-bit model's bit for bit, as with pread, and every record it ran came through the
// store.
TEST_F(PrefillExpertsTest, ReadsThroughTheIoUringStoreGiveThePreadPrefill) {
  absl::StatusOr<std::unique_ptr<RecordStorePrefillReader>> opened =
      RecordStorePrefillReader::Open(std::string(NQ_EMBEDDED_MODEL_DIR) + "/release", 0);
  ASSERT_THAT(opened, IsOk());
  std::shared_ptr<RecordStorePrefillReader> reader = *std::move(opened);
  release::PrefillExpertsOptions options{.slots = experts(), .full_span_tokens = 256, .decoder_layers = layers()};
  options.reader = reader;
  absl::StatusOr<std::unique_ptr<release::PrefillExperts>> prefill =
      release::PrefillExperts::Create(*two_bit_.decoder, *backend_, experts(), options);
  ASSERT_THAT(prefill, IsOk());
  std::map<int64_t, std::vector<int32_t>> chosen;
  std::map<int64_t, std::vector<int64_t>> calls;
  const auto layer_major = LayerMajor(**prefill, &chosen, &calls);
  const auto all_4bit = TokenOrder(*four_bit_.model);
  ASSERT_FALSE(layer_major.first.empty());
  EXPECT_EQ(layer_major.first, all_4bit.first);
  EXPECT_EQ(layer_major.second, all_4bit.second);
  const release::PrefillExpertStats& stats = (*prefill)->totals();
  EXPECT_EQ(stats.CallShare4Bit(), 1.0);
  // Every record the prefill read (prefetched, used or not, and late) went through the store.
  EXPECT_GE(reader->reads_issued(), static_cast<uint64_t>(stats.records_prefetched_used + stats.records_read_late));
  EXPECT_GT(reader->reads_issued(), 0u);
}

// A reader over a directory without a release is refused by name (the worker then warns and
// reads with pread, prefill_setup.cc); a read of an expert past the layer's is refused alone.
TEST_F(PrefillExpertsTest, TheIoUringReaderRefusesWhatItCannotRead) {
  EXPECT_THAT(RecordStorePrefillReader::Open("/nonexistent/release", 0).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("/nonexistent/release")));
  absl::StatusOr<std::unique_ptr<RecordStorePrefillReader>> reader =
      RecordStorePrefillReader::Open(std::string(NQ_EMBEDDED_MODEL_DIR) + "/release", 0);
  ASSERT_THAT(reader, IsOk());
  const uint32_t layer = two_bit_.decoder->moe_layer_ids().front();
  const size_t bytes = static_cast<size_t>(*two_bit_.decoder->RecordBytes(layer));
  std::vector<std::byte> storage(2 * bytes + 4096);
  const size_t skew = reinterpret_cast<uintptr_t>(storage.data()) % 4096;
  std::span<std::byte> aligned = std::span<std::byte>(storage).subspan(skew == 0 ? 0 : 4096 - skew, 2 * bytes);
  const std::vector<release::PrefillRecordRead> reads = {
      {.expert = static_cast<int32_t>(experts()), .destination = aligned.first(bytes)},
      {.expert = 0, .destination = aligned.subspan(bytes, bytes)}};
  const std::vector<absl::Status> done = (*reader)->ReadMany(layer, reads);
  ASSERT_EQ(done.size(), 2u);
  EXPECT_THAT(done[0], StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert")));
  EXPECT_THAT(done[1], IsOk());
  absl::StatusOr<std::vector<std::byte>> record = two_bit_.decoder->ReadRecord(layer, 0);
  ASSERT_THAT(record, IsOk());
  EXPECT_TRUE(std::equal(record->begin(), record->end(), aligned.subspan(bytes, bytes).begin()));
}

TEST_F(PrefillExpertsTest, ExpertsReadyInTheWorkersSlotsJoinWithoutARead) {
  // A worker's slot arena with experts 5, 13, 21 and 29 of every MoE layer READY (their records
  // copied in, as the streamer would), and a read budget of one expert a layer.
  const model::ModelConfig& config = two_bit_.model->config();
  absl::StatusOr<SlotGeometry> geometry = ReleaseArenaGeometry(*two_bit_.decoder, config, {});
  ASSERT_THAT(geometry, IsOk());
  SlotTable table(*geometry);
  std::vector<std::byte> arena(geometry->ArenaBytes());
  SlotRuntime slots(&table, arena, two_bit_.decoder.get());
  const std::vector<int32_t> ready = {5, 13, 21, 29};
  nq::v1::SlotTableUpdate update;
  update.set_generation(1);
  for (size_t i = 0; i < geometry->moe_layer_ids.size(); ++i) {
    const uint32_t layer = geometry->moe_layer_ids[i];
    for (uint32_t s = 0; s < ready.size(); ++s) {
      absl::StatusOr<std::vector<std::byte>> record = two_bit_.decoder->ReadRecord(layer, ready[s]);
      ASSERT_THAT(record, IsOk());
      std::copy(record->begin(), record->end(), arena.begin() + static_cast<std::ptrdiff_t>(geometry->SlotOffset(i, s)));
      nq::v1::SlotChange* change = update.add_changes();
      change->set_kind(nq::v1::SlotChange::KIND_READY);
      change->set_layer(layer);
      change->set_slot(s);
      change->set_expert(static_cast<uint32_t>(ready[s]));
    }
  }
  slots.Post(update);
  ASSERT_EQ(slots.ready_slots(), geometry->moe_layer_ids.size() * ready.size());
  release::PrefillExpertsOptions options{.slots = experts(), .full_span_tokens = 1 << 20, .decoder_layers = layers()};
  options.copy_ready = [&](int64_t layer, int32_t expert, std::span<std::byte> out) {
    return slots.CopyReadyResidual(layer, expert, out);
  };
  absl::StatusOr<std::unique_ptr<release::PrefillExperts>> prefill =
      release::PrefillExperts::Create(*two_bit_.decoder, *backend_, experts(), options);
  ASSERT_THAT(prefill, IsOk());
  ASSERT_EQ((*prefill)->Budget(kPromptTokens).prefetch, 1);
  std::map<int64_t, std::vector<int32_t>> chosen;
  std::map<int64_t, std::vector<int64_t>> calls;
  slots.BeginStep(0);  // as the worker runs a prefill: inside one slot step
  const auto layer_major = LayerMajor(**prefill, &chosen, &calls);
  slots.EndStep();
  int64_t borrowed = 0;
  for (const auto& [layer, slot_of] : chosen) {
    for (int32_t e : ready) {
      if (calls[layer][e] == 0) continue;
      EXPECT_GE(slot_of[e], 0) << "layer " << layer << " expert " << e << " was READY but ran at 2 bits";
      ++borrowed;
    }
  }
  EXPECT_GT(borrowed, 0);
  const release::PrefillExpertStats& stats = (*prefill)->totals();
  EXPECT_GT(stats.records_from_slots, 0);
  // Reads stay within the budget of one a layer, for the prefetch and for the late reads each.
  EXPECT_LE(stats.records_read_late, static_cast<int64_t>(chosen.size()));
  EXPECT_LE(stats.records_prefetched_used, static_cast<int64_t>(chosen.size()));
  // And the borrowed residuals are the experts' own: token order at the same precision agrees.
  four_bit_.model->SetExpertSlotSource([&](int64_t layer, int32_t expert, int64_t) {
    return chosen.at(layer)[expert] >= 0 ? expert : -1;
  });
  const auto same_precision = TokenOrder(*four_bit_.model);
  EXPECT_EQ(layer_major.first, same_precision.first);
  EXPECT_EQ(layer_major.second, same_precision.second);
}

// nq bench-prefill's runner (issue #23): the worker's prefill through SequenceRunner, a fresh
// prompt per request, the first token timed, and the 4-bit share of the layer-major rows from
// the prefill experts' own counts.
TEST_F(PrefillExpertsTest, ThePrefillBenchRunsTheWorkersPrefillAndCountsItsPrecision) {
  absl::StatusOr<std::unique_ptr<release::PrefillExperts>> prefill = release::PrefillExperts::Create(
      *two_bit_.decoder, *backend_, experts(), {.slots = experts(), .full_span_tokens = 256, .decoder_layers = layers()});
  ASSERT_THAT(prefill, IsOk());
  const PrefillBenchOptions options{.prompt_tokens = {100, 300}, .rounds = 2, .seed = 3, .chunk_tokens = kChunk,
                                    .layer_major_min_tokens = 200};
  absl::StatusOr<std::vector<PrefillBenchRow>> rows = RunPrefillBench(*two_bit_.model, prefill->get(), options);
  ASSERT_THAT(rows, IsOk());
  ASSERT_EQ(rows->size(), 4u);
  const double per_token = MoeLayers() * two_bit_.model->config().num_experts_per_tok;
  for (const PrefillBenchRow& row : *rows) {
    SCOPED_TRACE(absl::StrCat(row.prompt_tokens, " tokens, round ", row.round));
    EXPECT_GT(row.seconds, 0);
    if (row.prompt_tokens == 100) {
      // Below the threshold: token order, every call at the loaded 2 bits, nothing read.
      EXPECT_FALSE(row.layer_major);
      EXPECT_EQ(row.share_4bit, 0);
      EXPECT_EQ(row.calls_4bit + row.calls_2bit, 0);
    } else {
      // A span past full_span_tokens: every call at 4 bits, counted for this request alone.
      EXPECT_TRUE(row.layer_major);
      EXPECT_EQ(row.calls_4bit, 300 * per_token);
      EXPECT_EQ(row.calls_2bit, 0);
      EXPECT_EQ(row.share_4bit, 1.0);
      EXPECT_GT(row.read_bytes_per_second, 0);
    }
  }
  // The rounds were different prompts, so neither reused the other's cache: the second 300-token
  // request read its records again (prefetched or late) rather than finding them.
  EXPECT_GT((*rows)[3].records_prefetched_used + (*rows)[3].records_read_late, 0);
  EXPECT_EQ(two_bit_.model->cache_length(), 0) << "the bench leaves the cache empty";
  const nlohmann::ordered_json json = PrefillBenchJson(*rows);
  ASSERT_EQ(json.size(), 4u);
  EXPECT_EQ(json[2]["prefill"], "layer-major");
  EXPECT_EQ(json[2]["share_4bit"], 1.0);
  EXPECT_THAT(PrefillBenchTable(*rows), HasSubstr("layer-major"));
}

TEST_F(PrefillExpertsTest, ThePrefillBenchRefusesWhatCannotRun) {
  EXPECT_THAT(CheckPrefillBench({.prompt_tokens = {}}, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no prompt lengths")));
  EXPECT_THAT(CheckPrefillBench({.prompt_tokens = {0}}, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("a prompt of 0 tokens")));
  EXPECT_THAT(CheckPrefillBench({.prompt_tokens = {1024}}, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("exceed the context window")));
  EXPECT_THAT(CheckPrefillBench({.prompt_tokens = {10}, .rounds = 0}, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("0 rounds")));
  EXPECT_THAT(CheckPrefillBench({.prompt_tokens = {10}, .chunk_tokens = 0}, 1024),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--prefill_chunk_tokens")));
  EXPECT_THAT(CheckPrefillBench({.prompt_tokens = {1023}}, 1024), IsOk());
}

}  // namespace
}  // namespace nq::worker
