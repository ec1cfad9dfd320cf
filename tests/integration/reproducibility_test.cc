// What sampling.seed promises (proto/nq/v1/sampling.proto): the same seeded request yields the
// same tokens whenever every expert runs at the same precision as before. That always holds when
// the experts' precision is static (checkpoint experts, or a release with --expert_bits 2, 4 or
// fixed), including across prefix reuse of the KV cache; these tests send one seeded, sampled
// request repeatedly, and with a longer prompt that reuses the first one's prefix, and require
// identical text each time.
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/serving_fixture.h"

namespace nq::testing {
namespace {

class ReproducibilityTest : public ServingTest {
 protected:
  // The texts of `repeats` sends of one seeded request at temperature 0.9.
  std::vector<std::string> Texts(const std::string& prompt, int repeats) {
    const Json request = {{"model", "embedded"}, {"prompt", prompt},       {"max_tokens", 16},
                          {"temperature", 0.9},  {"top_p", 0.95},           {"seed", 20261201},
                          {"ignore_eos", true}};
    std::vector<std::string> texts;
    for (int i = 0; i < repeats; ++i) {
      absl::StatusOr<std::pair<int, Json>> reply = PostJson("/v1/completions", request);
      EXPECT_TRUE(reply.ok()) << reply.status();
      if (!reply.ok()) break;
      EXPECT_EQ(reply->first, 200) << reply->second.dump();
      texts.push_back(reply->second["choices"][0]["text"].get<std::string>());
    }
    return texts;
  }

  void ExpectReproducible() {
    const std::string prompt = "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n";
    const std::vector<std::string> texts = Texts(prompt, 5);
    ASSERT_EQ(texts.size(), 5u);
    EXPECT_EQ(std::set<std::string>(texts.begin(), texts.end()).size(), 1u) << "five sends, more than one text";
    // A longer prompt reuses the first one's KV prefix; sending it twice (and after the first
    // prompt again) must give one text too.
    const std::vector<std::string> longer = Texts(prompt + "    out = []\n", 2);
    const std::vector<std::string> again = Texts(prompt, 1);
    ASSERT_EQ(longer.size(), 2u);
    ASSERT_EQ(again.size(), 1u);
    EXPECT_EQ(longer[0], longer[1]);
    EXPECT_EQ(again[0], texts[0]);
  }
};

TEST_F(ReproducibilityTest, SeededRequestsRepeatWithCheckpointExperts) {
  StartCluster();
  ExpectReproducible();
}

TEST_F(ReproducibilityTest, SeededRequestsRepeatWithStaticTwoBitExperts) {
  StartCluster({}, /*streamed=*/true, {"--expert_bits=2"});
  ExpectReproducible();
}

TEST_F(ReproducibilityTest, SeededRequestsRepeatWithTheFixedSetAtFourBits) {
  StartCluster({}, /*streamed=*/true, {"--expert_bits=fixed"});
  ExpectReproducible();
}

}  // namespace
}  // namespace nq::testing
