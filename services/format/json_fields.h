// Checked access to the release's JSON files (manifest.json, rank{r}.json): a missing or
// mistyped field is an InvalidArgumentError naming the file and the field's path, never an
// exception (nlohmann throws on a type mismatch, and no exception may leave this module).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::format::json_fields {

using Json = nlohmann::json;

// `where` is "<file>: <path>", e.g. "manifest.json: layers[2]".
inline absl::Status Wrong(const std::string& where, const std::string& key, const char* what) {
  return absl::InvalidArgumentError(where + "." + key + " must be " + what);
}

inline absl::StatusOr<const Json*> Field(const Json& obj, const std::string& key,
                                         const std::string& where) {
  if (!obj.is_object()) return absl::InvalidArgumentError(where + " must be an object");
  auto it = obj.find(key);
  if (it == obj.end()) return absl::InvalidArgumentError(where + "." + key + " is missing");
  return &*it;
}

inline absl::StatusOr<std::string> String(const Json& obj, const std::string& key,
                                          const std::string& where) {
  auto field = Field(obj, key, where);
  if (!field.ok()) return field.status();
  if (!(*field)->is_string()) return Wrong(where, key, "a string");
  return (*field)->get<std::string>();
}

inline absl::StatusOr<uint64_t> Uint(const Json& obj, const std::string& key,
                                     const std::string& where) {
  auto field = Field(obj, key, where);
  if (!field.ok()) return field.status();
  if (!(*field)->is_number_unsigned()) return Wrong(where, key, "a non-negative integer");
  return (*field)->get<uint64_t>();
}

inline absl::StatusOr<uint32_t> Uint32(const Json& obj, const std::string& key,
                                       const std::string& where) {
  auto value = Uint(obj, key, where);
  if (!value.ok()) return value.status();
  if (*value > UINT32_MAX) return Wrong(where, key, "below 2^32");
  return static_cast<uint32_t>(*value);
}

inline absl::StatusOr<const Json*> Array(const Json& obj, const std::string& key,
                                         const std::string& where) {
  auto field = Field(obj, key, where);
  if (!field.ok()) return field.status();
  if (!(*field)->is_array()) return Wrong(where, key, "an array");
  return *field;
}

inline absl::StatusOr<const Json*> Object(const Json& obj, const std::string& key,
                                          const std::string& where) {
  auto field = Field(obj, key, where);
  if (!field.ok()) return field.status();
  if (!(*field)->is_object()) return Wrong(where, key, "an object");
  return *field;
}

// Parses `text` without exceptions; INVALID_ARGUMENT naming `file` on a syntax error.
inline absl::StatusOr<Json> Parse(const std::string& text, const std::string& file) {
  Json json = Json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::InvalidArgumentError(file + " is not valid JSON");
  if (!json.is_object()) return absl::InvalidArgumentError(file + " must hold a JSON object");
  return json;
}

}  // namespace nq::format::json_fields
