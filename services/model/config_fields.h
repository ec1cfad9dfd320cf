// Typed, defaulted reads of the keys of a config.json object (Fields), and parsing its text
// into a JSON object with the position of a syntax error. Used by model_config_parse.cc;
// nothing here throws.
#pragma once

#include <cstdint>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "services/common/status_macros.h"
#include "services/model/model_config_internal.h"

namespace nq::model::config_internal {

using Json = nlohmann::json;

// `value` as compact JSON, cut to a length that fits an error message.
std::string Quote(const Json& value);

// Typed, defaulted access to the keys of one JSON object, with errors that name the key by
// its full path ("quantization_config.fmt"). Absent keys take the fallback; a present null
// is a type error unless the accessor says it is nullable. Nothing here throws.
class Fields {
 public:
  Fields(const Json& object, std::string path) : object_(object), path_(std::move(path)) {}

  const Json* Find(const char* key) const {
    auto it = object_.find(key);
    return it == object_.end() ? nullptr : &*it;
  }
  bool Has(const char* key) const { return Find(key) != nullptr; }
  bool HasNonNull(const char* key) const {
    const Json* value = Find(key);
    return value != nullptr && !value->is_null();
  }
  std::string Name(const char* key) const {
    return path_.empty() ? std::string(key) : absl::StrCat(path_, ".", key);
  }
  absl::Status Missing(const char* key, absl::string_view hint = "") const {
    return Invalid("missing required key \"", Name(key), "\"", hint);
  }
  absl::Status WrongType(const char* key, absl::string_view expected, const Json& value) const {
    return Invalid("key \"", Name(key), "\" must be ", expected, ", got ", value.type_name(), " ",
                   Quote(value));
  }

  absl::StatusOr<int64_t> AsInt(const char* key, const Json& value) const {
    if (!value.is_number_integer()) return WrongType(key, "an integer", value);
    if (value.is_number_unsigned() &&
        value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return Invalid("key \"", Name(key), "\" is out of range: ", Quote(value));
    }
    return value.get<int64_t>();
  }
  absl::StatusOr<int64_t> RequiredInt(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr) return Missing(key);
    return AsInt(key, *value);
  }
  absl::StatusOr<int64_t> Int(const char* key, int64_t fallback) const {
    const Json* value = Find(key);
    return value == nullptr ? fallback : AsInt(key, *value);
  }
  // Absent: `fallback`; null: nullopt.
  absl::StatusOr<std::optional<int64_t>> NullableInt(const char* key,
                                                     std::optional<int64_t> fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (value->is_null()) return std::optional<int64_t>();
    ASSIGN_OR_RETURN(int64_t result, AsInt(key, *value));
    return std::optional<int64_t>(result);
  }
  absl::StatusOr<double> Double(const char* key, double fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_number()) return WrongType(key, "a number", *value);
    return value->get<double>();
  }
  absl::StatusOr<bool> Bool(const char* key, bool fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) return WrongType(key, "a boolean", *value);
    return value->get<bool>();
  }
  absl::StatusOr<std::string> String(const char* key, std::string fallback) const {
    const Json* value = Find(key);
    if (value == nullptr) return fallback;
    if (!value->is_string()) return WrongType(key, "a string", *value);
    return value->get<std::string>();
  }
  absl::StatusOr<std::vector<std::string>> StringList(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr) return Missing(key);
    if (!value->is_array()) return WrongType(key, "an array of strings", *value);
    std::vector<std::string> out;
    for (const Json& item : *value) {
      if (!item.is_string()) return WrongType(key, "an array of strings", *value);
      out.push_back(item.get<std::string>());
    }
    return out;
  }
  // The nested object at `key`, or nullptr when absent or null.
  absl::StatusOr<const Json*> Object(const char* key) const {
    const Json* value = Find(key);
    if (value == nullptr || value->is_null()) return nullptr;
    if (!value->is_object()) return WrongType(key, "an object", *value);
    return value;
  }

 private:
  const Json& object_;
  std::string path_;
};

// Parses `text` as one JSON object. INVALID_ARGUMENT "malformed JSON: ... line L, column C"
// for a syntax error, or naming the type of a root that is not an object.
absl::StatusOr<Json> ParseJsonObject(const std::string& text);

}  // namespace nq::model::config_internal
