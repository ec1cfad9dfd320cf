#include "services/model/config_fields.h"

#include "absl/strings/str_cat.h"
#include "services/model/model_config_internal.h"

namespace nq::model::config_internal {
namespace {

// Longest value quoted back in an error message.
constexpr size_t kMaxQuotedValue = 60;

// Records where nlohmann's parser gave up, to report malformed JSON with its position.
class ParseErrorRecorder : public nlohmann::json_sax<Json> {
 public:
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return true; }
  bool key(string_t&) override { return true; }
  bool end_object() override { return true; }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& error) override {
    // what() reads "[json.exception.parse_error.101] parse error at line 3, column 5: ...".
    std::string what = error.what();
    const size_t bracket = what.find("] ");
    message_ = bracket == std::string::npos ? what : what.substr(bracket + 2);
    return false;
  }
  std::string Describe() const { return absl::StrCat("malformed JSON: ", message_); }

 private:
  std::string message_ = "unknown error";
};

}  // namespace

std::string Quote(const Json& value) {
  std::string text = value.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (text.size() > kMaxQuotedValue) text = text.substr(0, kMaxQuotedValue) + "...";
  return text;
}

absl::StatusOr<Json> ParseJsonObject(const std::string& text) {
  Json root = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    ParseErrorRecorder recorder;
    Json::sax_parse(text, &recorder);
    return Invalid(recorder.Describe());
  }
  if (!root.is_object())
    return Invalid("config.json must be a JSON object, got ", root.type_name());
  return root;
}

}  // namespace nq::model::config_internal
