// The benchmark text: every "text" entry of tests/tokenizer/data/corpus.json (English prose,
// code, JSON, ten scripts, emoji, whitespace runs, digits, special tokens), joined with "\n",
// repeated until it reaches 1 MiB. bench_reference.mjs builds the same text for the reference.
#pragma once

#include <fstream>
#include <sstream>
#include <string>

#include "nlohmann/json.hpp"

namespace nq::tokenizer::bench {

inline constexpr size_t kBenchTextBytes = 1 << 20;

inline std::string BenchText(const std::string& corpus_path) {
  std::ifstream in(corpus_path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const nlohmann::json corpus = nlohmann::json::parse(buffer.str());
  std::string block;
  for (const auto& entry : corpus["entries"]) {
    if (!entry.contains("text")) continue;
    block += entry["text"].get<std::string>();
    block += "\n";
  }
  std::string text;
  while (text.size() < kBenchTextBytes && !block.empty()) text += block;
  return text;
}

}  // namespace nq::tokenizer::bench
