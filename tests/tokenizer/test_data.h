// Shared test data: the corpus, the reference's expected ids and the three tokenizers.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "services/tokenizer/tokenizer.h"

namespace nq::tokenizer::testing {

// The tokenizers the reference ids were produced with (data/<name>.tokenizer.json.gz).
inline const std::vector<std::string>& TokenizerNames() {
  static const std::vector<std::string> names = {"deepseek_v3", "qwen3", "llama3"};
  return names;
}

struct CorpusEntry {
  std::string name;
  std::string bytes;  // raw input; may be invalid UTF-8 for "hex" entries
};

struct ExpectedEntry {
  std::string name;
  std::vector<int32_t> ids;
  std::vector<int32_t> ids_add_special;
  std::string decoded;
  std::string decoded_skip_special;
};

std::string DataPath(const std::string& file);
const std::vector<CorpusEntry>& Corpus();
const std::vector<ExpectedEntry>& Expected(const std::string& tokenizer_name);
// Loaded once per process; aborts the test binary if the committed file does not load.
const Tokenizer& LoadedTokenizer(const std::string& tokenizer_name);

}  // namespace nq::tokenizer::testing
