// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json, producing the ids of the
// reference implementation (@lenml/tokenizers 3.7.2, i.e. transformers.js) exactly; tested
// against it on the DeepSeek-V3, Qwen3 and Llama 3 tokenizers (tests/tokenizer/).
//
// Encode: added tokens are cut out of the raw text first (added_tokens.h); every other section
// is normalized (normalizer.h), pre-tokenized (pre_tokenizer.h) and BPE-encoded
// (bpe_model.h); add_special_tokens wraps the result as the post-processor says
// (post_processor.h).
//
// Input that is not valid UTF-8 does not fail: each maximal invalid subsequence becomes
// U+FFFD first, as the reference's input path (TextDecoder) does, so "\xFF" encodes like "\uFFFD".
//
// Decode: ids back to raw bytes, as the decoder says (ByteLevel maps the byte alphabet back;
// added tokens are copied verbatim). The bytes may be invalid UTF-8 (a token can end inside
// a character); the reference returns them through TextDecoder, i.e. SanitizeUtf8(Decode(..)).
// For streaming, see StreamDetokenizer.
//
// A Tokenizer is immutable after loading; Encode and Decode are thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "services/tokenizer/added_tokens.h"
#include "services/tokenizer/bpe_model.h"
#include "services/tokenizer/normalizer.h"
#include "services/tokenizer/post_processor.h"
#include "services/tokenizer/pre_tokenizer.h"

namespace nq::tokenizer {

class Tokenizer {
 public:
  // Parses tokenizer.json text. InvalidArgumentError for malformed JSON or fields (naming the
  // field); UnimplementedError naming an unsupported model, normalizer, pre-tokenizer,
  // post-processor or decoder type.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(std::string_view json_text);
  // Reads a tokenizer.json file, plain or gzip-compressed.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);

  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Token ids of `text` (any bytes; see above). `add_special_tokens` applies the
  // post-processor's template. Fails only for a vocabulary that cannot express a character
  // and has no unknown token or byte fallback, or when a regex exceeds PCRE2's limits.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens) const;

  // Raw bytes of `ids`. InvalidArgumentError for an id that is not a token.
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids, bool skip_special_tokens) const;

  // The bytes one token contributes to a decoding (empty for a skipped special token). For
  // the ByteLevel decoder, Decode is the concatenation of these.
  absl::StatusOr<std::string_view> TokenBytes(int32_t id, bool skip_special_tokens) const;

  // Token string as tokenizer.json spells it (byte alphabet for byte-level vocabularies,
  // content for added tokens) <-> id.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  std::optional<std::string> IdToToken(int32_t id) const;

  bool IsSpecial(int32_t id) const;
  // Ids of the added tokens marked special, ascending.
  std::vector<int32_t> SpecialTokenIds() const;
  const std::vector<AddedToken>& added_tokens() const { return added_tokens_; }
  // One past the largest id (vocabulary and added tokens); ids below it may have holes.
  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  // True when pieces go through GPT-2's byte alphabet (a ByteLevel pre-tokenizer).
  bool byte_level() const { return pre_.byte_level; }
  // True when tokenizer.json has no decoder, so decoded tokens are joined with spaces.
  bool joins_with_spaces() const { return decoder_ == DecoderKind::kSpaceJoin; }

 private:
  enum class DecoderKind {
    kByteLevel,     // byte alphabet back to bytes
    kByteFallback,  // "<0xXX>" tokens to bytes, others verbatim
    kConcat,        // tokens verbatim (Fuse)
    kSpaceJoin,     // no decoder: tokens joined with spaces, like the reference
  };
  struct TokenInfo {
    bool present = false;
    bool special = false;  // its string is the content of a special added token
    std::string text;      // tokenizer.json spelling
    std::string bytes;     // what the decoder emits for it
  };

  Tokenizer() = default;
  absl::Status Load(std::string_view json_text);
  absl::Status EncodeSection(std::string_view text, std::vector<int32_t>* ids) const;

  std::vector<AddedToken> added_tokens_;
  AddedTokenMatcher matcher_;
  std::unique_ptr<Normalizer> normalizer_;
  PreTokenizerConfig pre_;
  std::unique_ptr<BpeModel> model_;
  PostProcessor post_;
  DecoderKind decoder_ = DecoderKind::kSpaceJoin;
  std::vector<TokenInfo> tokens_;  // by id
};

}  // namespace nq::tokenizer
