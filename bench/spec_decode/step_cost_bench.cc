// Cost of a speculative decoding step's parts on the CPU backend (issue #15): a plain decode
// forward (1 token), a verification forward (1 + N tokens), and one MTP draft (one MTP entry
// and its head), each at the same cache position after a held-out prompt, so the ratios say
// what N drafts cost against the tokens they save. A manual benchmark, not a ctest test.
//
//   step_cost_bench MODEL_DIR [PROMPT_TOKENS=256] [REPEATS=40]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/backend.h"
#include "services/model/model.h"

namespace {

using Clock = std::chrono::steady_clock;

int Fail(const std::string& what) {
  std::fprintf(stderr, "step_cost_bench: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return Fail("usage: step_cost_bench MODEL_DIR [PROMPT_TOKENS] [REPEATS]");
  const std::string dir = argv[1];
  const int prompt_tokens = argc > 2 ? std::atoi(argv[2]) : 256;
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 40;
  std::ifstream in(dir + "/eval/stdlib_code.tokens.json");
  std::stringstream text;
  text << in.rdbuf();
  const std::vector<int32_t> held_out = nlohmann::json::parse(text.str()).get<std::vector<int32_t>>();
  if (static_cast<int>(held_out.size()) < prompt_tokens + 8) return Fail("not enough held-out tokens");

  auto backend = nq::kernels::CreateBackend("cpu");
  if (!backend.ok()) return Fail(backend.status().ToString());
  auto model = nq::model::Model::Load(dir, **backend, nullptr, {.max_tokens = 1024, .tp = {}});
  if (!model.ok()) return Fail(model.status().ToString());
  nq::model::Model& m = **model;
  if (!m.has_mtp()) return Fail("the model has no MTP layer");
  const std::span<const int32_t> ids(held_out);
  if (!m.Forward(ids.first(prompt_tokens)).ok()) return Fail("prefill");
  const std::vector<float> hidden = m.last_hidden();
  const size_t D = static_cast<size_t>(m.config().hidden_size);
  const std::span<const float> last_row = std::span<const float>(hidden).last(D);
  if (!m.ForwardMtp(ids.subspan(1, prompt_tokens - 1),
                    std::span<const float>(hidden).first((prompt_tokens - 1) * D)).ok()) {
    return Fail("MTP prefill");
  }

  // Mean milliseconds of `run`, which must leave the caches as it found them.
  auto time_ms = [&](auto&& run) {
    run();  // warm
    const auto start = Clock::now();
    for (int r = 0; r < repeats; ++r) run();
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count() / repeats;
  };
  auto verify = [&](int tokens) {
    return time_ms([&] {
      if (!m.Forward(ids.subspan(prompt_tokens, tokens)).ok() || !m.TruncateCache(prompt_tokens).ok()) std::abort();
    });
  };
  const double plain = verify(1);
  const double mtp = time_ms([&] {
    const int64_t at = m.mtp_cache_length();
    if (!m.ForwardMtpLast(ids.subspan(prompt_tokens, 1), last_row).ok() || !m.TruncateMtpCache(at).ok()) {
      std::abort();
    }
  });
  std::printf("| part | ms | x plain step |\n| --- | ---: | ---: |\n");
  std::printf("| plain decode forward (1 token) | %.2f | 1.00 |\n", plain);
  for (int n = 1; n <= 3; ++n) {
    const double v = verify(1 + n);
    std::printf("| verification forward (1 + %d tokens) | %.2f | %.2f |\n", n, v, v / plain);
  }
  std::printf("| one MTP draft (1 entry + head) | %.2f | %.2f |\n", mtp, mtp / plain);
  return 0;
}
