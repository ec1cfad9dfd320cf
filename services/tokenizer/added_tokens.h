// Added tokens ("added_tokens" of tokenizer.json): special and user tokens matched in the raw
// text before normalization, so "<|im_end|>" is one id however the model would split it.
//
// Matching mirrors the reference (transformers.js' DictionarySplitter): scan left to right and
// at each position take the longest added token that starts there; every added token is
// matched, special or not, whatever its `normalized` and `single_word` flags (the reference
// ignores both). `lstrip` / `rstrip` trim JavaScript whitespace off the neighbouring text.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace nq::tokenizer {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool single_word = false;
};

// A run of input: plain text to tokenize, or one added token.
struct Section {
  std::string_view text;
  int32_t added_index = -1;  // index into the added tokens, or -1 for plain text
};

class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(const std::vector<AddedToken>& tokens);

  // Cuts `text` into sections and applies lstrip/rstrip. Plain sections may come out empty.
  std::vector<Section> Split(std::string_view text) const;

 private:
  struct Node {
    // Children sorted by byte; tokens are few and short, so a binary search per byte is cheap.
    std::vector<std::pair<uint8_t, int32_t>> children;
    int32_t token = -1;  // index of the token ending here
  };
  int32_t Child(int32_t node, uint8_t byte) const;

  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
  std::vector<AddedToken> tokens_;
};

}  // namespace nq::tokenizer
