// libFuzzer target for a model's tokenizer.json (scripts/fuzz.sh tokenizer_json).
//
// The router loads the tokenizer.json of whatever checkpoint it is pointed at, so on any bytes
// Tokenizer::FromJson must return a Status without crashing or tripping a sanitizer (the file
// carries regexes, normalizers, merges and added tokens, each parsed here). A tokenizer it
// accepts must then encode any text to ids inside its vocabulary (or refuse with a Status), and
// decode those ids, and every id of its vocabulary, without crashing.
//
// Input: the first byte is the length (0-255) of a text to encode, taken from the end of the
// input; the rest is the tokenizer.json.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "fuzz/fuzz_require.h"
#include "services/tokenizer/tokenizer.h"

using nq::fuzz::Require;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t text_bytes = std::min<std::size_t>(data[0], size - 1);
  const std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const std::string_view json = rest.substr(0, rest.size() - text_bytes);
  const std::string_view text = rest.substr(rest.size() - text_bytes);
  absl::StatusOr<std::unique_ptr<nq::tokenizer::Tokenizer>> tokenizer = nq::tokenizer::Tokenizer::FromJson(json);
  if (!tokenizer.ok()) {
    Require(!tokenizer.status().message().empty());
    return 0;
  }
  const nq::tokenizer::Tokenizer& t = **tokenizer;
  for (bool special : {false, true}) {
    absl::StatusOr<std::vector<int32_t>> ids = t.Encode(text, special);
    if (!ids.ok()) {
      Require(!ids.status().message().empty());
      continue;
    }
    for (int32_t id : *ids) Require(id >= 0 && id < t.vocab_size());
    (void)t.Decode(*ids, /*skip_special_tokens=*/!special);
  }
  // Every id of the vocabulary decodes (or is refused) on its own; out-of-range ids are refused.
  for (int32_t id = 0; id < t.vocab_size() && id < 4096; ++id) (void)t.TokenBytes(id, false);
  const int32_t outside[] = {-1, t.vocab_size()};
  Require(!t.Decode(outside, false).ok());
  return 0;
}
