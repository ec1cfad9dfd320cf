// A small byte-level tokenizer.json built in memory, for component and error tests.
#pragma once

#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "services/tokenizer/byte_level.h"

namespace nq::tokenizer::testing {

// Vocabulary: the 256 byte-alphabet characters with id == byte value, then `merges` in order
// (each result gets the next id). Pre-tokenizer ByteLevel with the GPT-2 regex, ByteLevel
// post-processor and decoder, no normalizer, no added tokens.
inline nlohmann::json MiniTokenizerJson(const std::vector<std::pair<std::string, std::string>>& merges) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    const char byte = static_cast<char>(b);
    BytesToByteLevel(std::string_view(&byte, 1), &ch);
    vocab[ch] = b;
  }
  nlohmann::json merge_list = nlohmann::json::array();
  int next_id = 256;
  for (const auto& [left, right] : merges) {
    merge_list.push_back({left, right});
    if (!vocab.contains(left + right)) vocab[left + right] = next_id++;
  }
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", nlohmann::json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
}

// Adds an added token entry.
inline void AddToken(nlohmann::json* tokenizer, int id, const std::string& content, bool special,
                     bool lstrip = false, bool rstrip = false) {
  (*tokenizer)["added_tokens"].push_back({{"id", id},
                                          {"content", content},
                                          {"single_word", false},
                                          {"lstrip", lstrip},
                                          {"rstrip", rstrip},
                                          {"normalized", false},
                                          {"special", special}});
}

}  // namespace nq::tokenizer::testing
