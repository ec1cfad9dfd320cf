// Checked access to tokenizer.json fields: a missing or mistyped field is an
// InvalidArgumentError naming its path, never an exception (nlohmann throws on a type
// mismatch, and no exception may leave this module).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::tokenizer::json_fields {

using Json = nlohmann::json;

inline absl::Status Missing(const std::string& path, const char* what) {
  return absl::InvalidArgumentError("tokenizer.json: " + path + " must be " + what);
}

// The string at obj[key]; `fallback` when absent or null (if given), else an error.
inline absl::StatusOr<std::string> String(const Json& obj, const char* key, const std::string& path,
                                          const std::string* fallback = nullptr) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) {
    if (fallback != nullptr) return *fallback;
    return Missing(path + "." + key, "a string");
  }
  if (!it->is_string()) return Missing(path + "." + key, "a string");
  return it->get<std::string>();
}

// The boolean at obj[key]; `fallback` when absent or null.
inline absl::StatusOr<bool> Bool(const Json& obj, const char* key, const std::string& path, bool fallback) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Missing(path + "." + key, "a boolean");
  return it->get<bool>();
}

// The array at obj[key] (required).
inline absl::StatusOr<const Json*> Array(const Json& obj, const char* key, const std::string& path) {
  auto it = obj.find(key);
  if (it == obj.end() || !it->is_array()) return Missing(path + "." + key, "an array");
  return &*it;
}

// obj["type"], required for every component.
inline absl::StatusOr<std::string> Type(const Json& obj, const std::string& path) {
  if (!obj.is_object()) return Missing(path, "an object");
  return String(obj, "type", path);
}

}  // namespace nq::tokenizer::json_fields
