#include "services/tokenizer/post_processor.h"

#include "services/common/status_macros.h"
#include "services/tokenizer/json_fields.h"

namespace nq::tokenizer {
namespace {

using json_fields::Json;
using TokenId = std::function<std::optional<int32_t>(const std::string&)>;

absl::StatusOr<int32_t> Resolve(const std::string& token, const std::string& path, const TokenId& token_id) {
  std::optional<int32_t> id = token_id(token);
  if (!id.has_value()) {
    return absl::InvalidArgumentError("tokenizer.json: " + path + " names token '" + token +
                                      "', which is neither in the vocabulary nor an added token");
  }
  return *id;
}

absl::Status Apply(const Json& config, const std::string& path, const TokenId& token_id, PostProcessor* out) {
  ASSIGN_OR_RETURN(const std::string type, json_fields::Type(config, path));
  if (type == "ByteLevel") return absl::OkStatus();
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, json_fields::Array(config, "processors", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(Apply((*list)[i], path + ".processors[" + std::to_string(i) + "]", token_id, out));
    }
    return absl::OkStatus();
  }
  // Each wrapping processor applies to the output of the previous ones.
  std::vector<int32_t> prefix, suffix;
  if (type == "TemplateProcessing") {
    ASSIGN_OR_RETURN(const Json* single, json_fields::Array(config, "single", path));
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const Json& item = (*single)[i];
      const std::string item_path = path + ".single[" + std::to_string(i) + "]";
      if (item.is_object() && item.contains("SpecialToken")) {
        ASSIGN_OR_RETURN(std::string name, json_fields::String(item["SpecialToken"], "id", item_path + ".SpecialToken"));
        ASSIGN_OR_RETURN(int32_t id, Resolve(name, item_path, token_id));
        (seen_sequence ? suffix : prefix).push_back(id);
      } else if (item.is_object() && item.contains("Sequence")) {
        seen_sequence = true;
      } else {
        return json_fields::Missing(item_path, "{\"SpecialToken\": ...} or {\"Sequence\": ...}");
      }
    }
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    for (const char* key : {"cls", "sep"}) {
      auto it = config.find(key);
      if (it == config.end() || !it->is_array() || it->empty() || !(*it)[0].is_string()) {
        return json_fields::Missing(path + "." + key, "[token, id]");
      }
      ASSIGN_OR_RETURN(int32_t id, Resolve((*it)[0].get<std::string>(), path + "." + key, token_id));
      (std::string(key) == "cls" ? prefix : suffix).push_back(id);
    }
  } else {
    return absl::UnimplementedError(path + ": post-processor type '" + type +
                                    "' is not supported (supported: ByteLevel, TemplateProcessing, "
                                    "BertProcessing, RobertaProcessing, Sequence)");
  }
  prefix.insert(prefix.end(), out->prefix.begin(), out->prefix.end());
  out->prefix = std::move(prefix);
  out->suffix.insert(out->suffix.end(), suffix.begin(), suffix.end());
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PostProcessor> MakePostProcessor(const Json& config, const TokenId& token_id) {
  PostProcessor out;
  if (config.is_null()) return out;
  RETURN_IF_ERROR(Apply(config, "post_processor", token_id, &out));
  return out;
}

}  // namespace nq::tokenizer
