#include "services/tokenizer/stream_detokenizer.h"

#include "services/common/status_macros.h"

namespace nq::tokenizer {

StreamDetokenizer::StreamDetokenizer(const Tokenizer& tokenizer, Options options)
    : tokenizer_(tokenizer), options_(options) {}

void StreamDetokenizer::Count(int64_t n) {
  if (n == 0) return;
  invalid_sequences_ += n;
  if (options_.invalid_utf8_counter != nullptr) options_.invalid_utf8_counter->Increment(static_cast<double>(n));
}

absl::StatusOr<std::string> StreamDetokenizer::Feed(int32_t id) {
  ASSIGN_OR_RETURN(std::string_view bytes, tokenizer_.TokenBytes(id, options_.skip_special_tokens));
  std::string out;
  if (bytes.empty()) return out;
  // Tokenizers without a decoder join tokens with spaces (Tokenizer::Decode).
  if (!first_token_ && tokenizer_.joins_with_spaces()) Count(decoder_.Feed(" ", &out));
  first_token_ = false;
  Count(decoder_.Feed(bytes, &out));
  return out;
}

std::string StreamDetokenizer::Flush() {
  std::string out;
  Count(decoder_.Flush(&out));
  first_token_ = true;
  return out;
}

}  // namespace nq::tokenizer
