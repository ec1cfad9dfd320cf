#include "tests/tokenizer/test_data.h"

#include <fstream>
#include <map>
#include <mutex>
#include <sstream>

#include <gtest/gtest.h>

#include "nlohmann/json.hpp"

namespace nq::tokenizer::testing {
namespace {

nlohmann::json ReadJson(const std::string& file) {
  std::ifstream in(DataPath(file), std::ios::binary);
  if (!in) {
    ADD_FAILURE() << "cannot open " << DataPath(file);
    return nlohmann::json::object();
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  return nlohmann::json::parse(buffer.str());
}

std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

}  // namespace

std::string DataPath(const std::string& file) { return std::string(NQ_TOKENIZER_TEST_DATA) + "/" + file; }

const std::vector<CorpusEntry>& Corpus() {
  static const std::vector<CorpusEntry>* corpus = [] {
    auto* entries = new std::vector<CorpusEntry>();
    const nlohmann::json json = ReadJson("corpus.json");
    for (const auto& e : json["entries"]) {
      CorpusEntry entry;
      entry.name = e["name"].get<std::string>();
      entry.bytes = e.contains("hex") ? FromHex(e["hex"].get<std::string>()) : e["text"].get<std::string>();
      entries->push_back(std::move(entry));
    }
    return entries;
  }();
  return *corpus;
}

const std::vector<ExpectedEntry>& Expected(const std::string& tokenizer_name) {
  static std::mutex mu;
  static std::map<std::string, std::vector<ExpectedEntry>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(tokenizer_name);
  if (it != cache.end()) return it->second;
  std::vector<ExpectedEntry> entries;
  const nlohmann::json json = ReadJson("expected_" + tokenizer_name + ".json");
  for (const auto& e : json["entries"]) {
    ExpectedEntry entry;
    entry.name = e["name"].get<std::string>();
    entry.ids = e["ids"].get<std::vector<int32_t>>();
    entry.ids_add_special = e["ids_add_special"].get<std::vector<int32_t>>();
    entry.decoded = e["decoded"].get<std::string>();
    entry.decoded_skip_special = e["decoded_skip_special"].get<std::string>();
    entries.push_back(std::move(entry));
  }
  return cache.emplace(tokenizer_name, std::move(entries)).first->second;
}

const Tokenizer& LoadedTokenizer(const std::string& tokenizer_name) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(tokenizer_name);
  if (it != cache.end()) return *it->second;
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      Tokenizer::FromFile(DataPath(tokenizer_name + ".tokenizer.json.gz"));
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "loading %s: %s\n", tokenizer_name.c_str(), tokenizer.status().ToString().c_str());
    std::abort();
  }
  return *cache.emplace(tokenizer_name, *std::move(tokenizer)).first->second;
}

}  // namespace nq::tokenizer::testing
