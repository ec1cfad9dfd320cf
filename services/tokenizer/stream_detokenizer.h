// Streaming detokenization for generated tokens: feed ids one at a time, get text that only
// ever holds whole UTF-8 characters.
//
// A token may end inside a multi-byte character (byte-level BPE splits rare characters and
// emoji into several tokens): those bytes are held until the character completes. Bytes that
// can never complete (an invalid sequence the model really produced) are emitted as U+FFFD,
// one per maximal invalid subsequence, and counted; the router exports the count as
// nq_detokenize_invalid_utf8_total. Flush() at the end of the sequence turns a still-incomplete
// character into one U+FFFD (counted too).
//
// The concatenated output equals SanitizeUtf8(Tokenizer::Decode(all ids)), i.e. the reference's
// decoding. Not thread-safe: one per sequence.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "services/common/metrics/counter.h"
#include "services/tokenizer/tokenizer.h"
#include "services/tokenizer/utf8.h"

namespace nq::tokenizer {

class StreamDetokenizer {
 public:
  struct Options {
    bool skip_special_tokens = false;
    // Incremented with every invalid sequence, when set; must outlive the detokenizer.
    metrics::Counter* invalid_utf8_counter = nullptr;
  };

  // `tokenizer` must outlive the detokenizer.
  StreamDetokenizer(const Tokenizer& tokenizer, Options options);
  explicit StreamDetokenizer(const Tokenizer& tokenizer) : StreamDetokenizer(tokenizer, Options{}) {}

  // The text that `id` completes (possibly empty). InvalidArgumentError for an id that is not
  // a token; the stream is unchanged then.
  absl::StatusOr<std::string> Feed(int32_t id);
  // The end of the sequence: a held, incomplete character becomes U+FFFD. The detokenizer can
  // be reused for a new sequence afterwards.
  std::string Flush();

  // Invalid sequences replaced so far (over all sequences).
  int64_t invalid_sequences() const { return invalid_sequences_; }
  // Bytes currently held back (0..3).
  size_t pending_bytes() const { return decoder_.pending_bytes(); }

 private:
  void Count(int64_t n);

  const Tokenizer& tokenizer_;
  Options options_;
  Utf8Decoder decoder_;
  bool first_token_ = true;
  int64_t invalid_sequences_ = 0;
};

}  // namespace nq::tokenizer
