// Pre-tokenizers of tokenizer.json ("pre_tokenizer"): they cut a normalized section into the
// pieces BPE encodes one at a time. Supported: Sequence, Split, ByteLevel, Digits.
//
// Split follows the Hugging Face semantics for every `behavior` and `invert`. The reference
// implements only part of them (it treats MergedWithPrevious, MergedWithNext and Contiguous as
// Isolated, and with invert keeps only the matches); the tokenizers we serve use
// Isolated without invert, where both agree.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::tokenizer {

// Pieces are views into the section being tokenized or into strings a step had to create
// (ByteLevel's prefix space), which live in the arena until the section is encoded.
using Pieces = std::vector<std::string_view>;
using PieceArena = std::deque<std::string>;

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces `pieces` by their finer split. Pieces are valid UTF-8 and never empty.
  virtual absl::Status Split(Pieces* pieces, PieceArena* arena) const = 0;
};

struct PreTokenizerConfig {
  std::unique_ptr<PreTokenizer> pre_tokenizer;  // null when tokenizer.json has none
  // The chain ends in ByteLevel: pieces are raw bytes the model sees through GPT-2's alphabet.
  bool byte_level = false;
};

// Builds the pre-tokenizer described by `config` (a tokenizer.json "pre_tokenizer" value).
// UnimplementedError names a type this module lacks, or a ByteLevel that is not the last step.
absl::StatusOr<PreTokenizerConfig> MakePreTokenizer(const nlohmann::json& config);

}  // namespace nq::tokenizer
