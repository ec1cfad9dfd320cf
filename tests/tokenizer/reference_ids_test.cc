// Exact ids against the reference (@lenml/tokenizers) for every corpus entry and tokenizer.
// The expected ids come from scripts/tokenizer/make_expected.mjs.
#include <atomic>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/common/status_matchers.h"
#include "tests/tokenizer/test_data.h"

namespace nq::tokenizer {
namespace {

using ::nq::testing::IsOk;
using testing::Corpus;
using testing::Expected;
using testing::LoadedTokenizer;

// Describes the first difference between two id sequences, with the tokens around it.
std::string DescribeMismatch(const Tokenizer& tokenizer, const std::vector<int32_t>& expected,
                             const std::vector<int32_t>& actual) {
  size_t i = 0;
  while (i < expected.size() && i < actual.size() && expected[i] == actual[i]) ++i;
  auto window = [&](const std::vector<int32_t>& ids) {
    std::ostringstream out;
    const size_t begin = i >= 3 ? i - 3 : 0;
    for (size_t k = begin; k < ids.size() && k < i + 4; ++k) {
      out << (k == i ? " >>" : " ") << ids[k] << "'" << tokenizer.IdToToken(ids[k]).value_or("?") << "'";
    }
    return out.str();
  };
  std::ostringstream out;
  out << "first difference at index " << i << " (expected " << expected.size() << " ids, got " << actual.size()
      << ")\n  expected:" << window(expected) << "\n  actual:  " << window(actual);
  return out.str();
}

class ReferenceIdsTest : public ::testing::TestWithParam<std::string> {};

TEST_P(ReferenceIdsTest, EveryCorpusEntryMatchesTheReference) {
  const Tokenizer& tokenizer = LoadedTokenizer(GetParam());
  const auto& corpus = Corpus();
  const auto& expected = Expected(GetParam());
  ASSERT_EQ(corpus.size(), expected.size()) << "regenerate expected_" << GetParam() << ".json";
  int matched = 0;
  for (size_t e = 0; e < corpus.size(); ++e) {
    ASSERT_EQ(corpus[e].name, expected[e].name);
    absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(corpus[e].bytes, /*add_special_tokens=*/false);
    ASSERT_THAT(ids, IsOk()) << corpus[e].name;
    absl::StatusOr<std::vector<int32_t>> ids_special = tokenizer.Encode(corpus[e].bytes, /*add_special_tokens=*/true);
    ASSERT_THAT(ids_special, IsOk()) << corpus[e].name;
    const bool ok = *ids == expected[e].ids && *ids_special == expected[e].ids_add_special;
    if (ok) {
      ++matched;
      continue;
    }
    if (*ids != expected[e].ids) {
      ADD_FAILURE() << GetParam() << " / " << corpus[e].name << ": "
                    << DescribeMismatch(tokenizer, expected[e].ids, *ids);
    } else {
      ADD_FAILURE() << GetParam() << " / " << corpus[e].name << " (add_special_tokens): "
                    << DescribeMismatch(tokenizer, expected[e].ids_add_special, *ids_special);
    }
  }
  std::printf("[ reference ] %s: %d/%zu corpus entries match exactly\n", GetParam().c_str(), matched, corpus.size());
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, ReferenceIdsTest, ::testing::ValuesIn(testing::TokenizerNames()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace nq::tokenizer

namespace nq::tokenizer {
namespace {

TEST(ReferenceConcurrencyTest, ConcurrentEncodersAgreeWithTheReference) {
  // Encode is const and shared by the router's request threads: the word cache, the regex
  // match state and the merge buffers must not leak between them.
  const Tokenizer& tokenizer = testing::LoadedTokenizer("deepseek_v3");
  const auto& corpus = testing::Corpus();
  const auto& expected = testing::Expected("deepseek_v3");
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (size_t k = 0; k < corpus.size(); ++k) {
          const size_t e = (k + static_cast<size_t>(t) * 17) % corpus.size();  // different orders
          absl::StatusOr<std::vector<int32_t>> ids = tokenizer.Encode(corpus[e].bytes, false);
          if (!ids.ok() || *ids != expected[e].ids) ++mismatches;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(mismatches.load(), 0);
}

}  // namespace
}  // namespace nq::tokenizer
