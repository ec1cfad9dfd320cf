#include "services/model/safetensors_json.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace nq::model {
namespace {

using nlohmann::json;

// Longest name quoted in an error message; hostile headers may hold megabyte-long keys.
constexpr size_t kMaxQuotedBytes = 160;
// Longest parser message kept.
constexpr size_t kMaxErrorBytes = 400;

// Builds the DOM like nlohmann's own SAX DOM parser, but stops at the first duplicate key or
// at kMaxJsonDepth, and records errors instead of throwing them.
class StrictDomBuilder final : public nlohmann::json_sax<json> {
 public:
  bool null() override { return Put(json(nullptr)); }
  bool boolean(bool value) override { return Put(json(value)); }
  bool number_integer(number_integer_t value) override { return Put(json(value)); }
  bool number_unsigned(number_unsigned_t value) override { return Put(json(value)); }
  bool number_float(number_float_t value, const string_t& /*text*/) override {
    return Put(json(value));
  }
  bool string(string_t& value) override { return Put(json(std::move(value))); }
  bool binary(binary_t& value) override { return Put(json::binary(std::move(value))); }

  bool start_object(std::size_t /*elements*/) override { return Open(json::object()); }
  bool start_array(std::size_t /*elements*/) override { return Open(json::array()); }
  bool end_object() override { return Close(); }
  bool end_array() override { return Close(); }

  bool key(string_t& key) override {
    Frame& frame = stack_.back();
    // Values are inserted as soon as they start (containers when they open), so the
    // previous key is already in the object and a repeated key is found here.
    if (frame.value->contains(key)) {
      error_ = absl::StrCat("duplicate key ", QuoteForMessage(key), " in ",
                            stack_.size() == 1
                                ? std::string("the top-level object")
                                : absl::StrCat("the object at ", Pointer(stack_.size() - 1)));
      return false;
    }
    frame.key = std::move(key);
    return true;
  }

  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& ex) override {
    // nlohmann quotes the whole token it was reading, which may be megabytes long.
    const absl::string_view what = ex.what();
    error_ = what.size() <= kMaxErrorBytes
                 ? std::string(what)
                 : absl::StrCat(what.substr(0, kMaxErrorBytes), "... (cut)");
    return false;
  }

  json& root() { return root_; }
  const std::string& error() const { return error_; }

 private:
  struct Frame {
    json* value;
    std::string key;  // the pending key when `value` is an object
  };

  // Inserts a value where the parser is: the root, the end of an array, or under the
  // pending key. Returns where it landed; the address is stable until its container closes
  // (nothing else is inserted into that parent meanwhile).
  json* Insert(json value) {
    if (stack_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Frame& frame = stack_.back();
    if (frame.value->is_array()) {
      frame.value->push_back(std::move(value));
      return &frame.value->back();
    }
    json& slot = (*frame.value)[frame.key];
    slot = std::move(value);
    return &slot;
  }

  bool Put(json value) {
    Insert(std::move(value));
    return true;
  }

  bool Open(json container) {
    json* value = Insert(std::move(container));
    if (stack_.size() >= static_cast<size_t>(kMaxJsonDepth)) {
      error_ = absl::StrCat("JSON nests deeper than ", kMaxJsonDepth, " levels at ",
                            Pointer(stack_.size()));
      return false;
    }
    stack_.push_back(Frame{value, {}});
    return true;
  }

  bool Close() {
    stack_.pop_back();
    return true;
  }

  // JSON pointer (RFC 6901), quoted, of the value the first `frames` frames lead to: each
  // frame contributes its pending key or the index of its last element.
  std::string Pointer(size_t frames) const {
    std::string pointer;
    for (size_t i = 0; i < frames; ++i) {
      const Frame& frame = stack_[i];
      const std::string token = frame.value->is_array()
                                    ? absl::StrCat(frame.value->size() - 1)
                                    : frame.key.substr(0, kMaxQuotedBytes);
      pointer += '/';
      for (char c : token) {
        if (c == '~') {
          pointer += "~0";
        } else if (c == '/') {
          pointer += "~1";
        } else {
          pointer += c;
        }
      }
    }
    return absl::StrCat("'", absl::CHexEscape(pointer), "'");
  }

  json root_;
  std::vector<Frame> stack_;
  std::string error_;
};

}  // namespace

std::string QuoteForMessage(absl::string_view text) {
  if (text.size() <= kMaxQuotedBytes) return absl::StrCat("'", absl::CHexEscape(text), "'");
  return absl::StrCat("'", absl::CHexEscape(text.substr(0, kMaxQuotedBytes)), "...' (",
                      text.size(), " bytes)");
}

absl::StatusOr<json> ParseJsonStrict(absl::string_view text) {
  StrictDomBuilder builder;
  const bool ok = json::sax_parse(text.data(), text.data() + text.size(), &builder,
                                  json::input_format_t::json, /*strict=*/true,
                                  /*ignore_comments=*/false);
  if (!ok) {
    return absl::InvalidArgumentError(builder.error().empty() ? std::string("malformed JSON")
                                                              : builder.error());
  }
  return std::move(builder.root());
}

}  // namespace nq::model
