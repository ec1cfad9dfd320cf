#include "services/tokenizer/tokenizer.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "absl/container/flat_hash_set.h"
#include "services/common/status_macros.h"
#include "services/tokenizer/byte_level.h"
#include "services/tokenizer/json_fields.h"
#include "services/tokenizer/utf8.h"

namespace nq::tokenizer {
namespace {

using json_fields::Json;

// The id table's limit: ids below kMaxIdSpread x the number of tokens + kMaxIdSlack (Load).
constexpr int64_t kMaxIdSpread = 4;
constexpr int64_t kMaxIdSlack = 65536;

absl::StatusOr<std::vector<AddedToken>> ParseAddedTokens(const Json& root) {
  std::vector<AddedToken> tokens;
  auto it = root.find("added_tokens");
  if (it == root.end() || it->is_null()) return tokens;
  if (!it->is_array()) return json_fields::Missing("added_tokens", "an array");
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& entry = (*it)[i];
    const std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (!entry.is_object()) return json_fields::Missing(path, "an object");
    AddedToken token;
    auto id = entry.find("id");
    if (id == entry.end() || !id->is_number_integer() || id->get<int64_t>() < 0 || id->get<int64_t>() > INT32_MAX) {
      return json_fields::Missing(path + ".id", "a non-negative integer");
    }
    token.id = static_cast<int32_t>(id->get<int64_t>());
    ASSIGN_OR_RETURN(token.content, json_fields::String(entry, "content", path));
    ASSIGN_OR_RETURN(token.special, json_fields::Bool(entry, "special", path, false));
    ASSIGN_OR_RETURN(token.lstrip, json_fields::Bool(entry, "lstrip", path, false));
    ASSIGN_OR_RETURN(token.rstrip, json_fields::Bool(entry, "rstrip", path, false));
    ASSIGN_OR_RETURN(token.normalized, json_fields::Bool(entry, "normalized", path, false));
    ASSIGN_OR_RETURN(token.single_word, json_fields::Bool(entry, "single_word", path, false));
    tokens.push_back(std::move(token));
  }
  return tokens;
}

// Collects the decoder types of `config`, flattening Sequence.
absl::Status DecoderTypes(const Json& config, const std::string& path, std::vector<std::string>* types) {
  ASSIGN_OR_RETURN(const std::string type, json_fields::Type(config, path));
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, json_fields::Array(config, "decoders", path));
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(DecoderTypes((*list)[i], path + ".decoders[" + std::to_string(i) + "]", types));
    }
    return absl::OkStatus();
  }
  if (type != "ByteLevel" && type != "ByteFallback" && type != "Fuse") {
    return absl::UnimplementedError(path + ": decoder type '" + type +
                                    "' is not supported (supported: ByteLevel, ByteFallback, Fuse, Sequence)");
  }
  types->push_back(type);
  return absl::OkStatus();
}

// "<0xXX>" -> XX.
std::optional<uint8_t> FallbackByte(std::string_view token) {
  if (token.size() != 6 || token.substr(0, 3) != "<0x" || token[5] != '>') return std::nullopt;
  unsigned value = 0;
  for (char c : token.substr(3, 2)) {
    value *= 16;
    if (c >= '0' && c <= '9') value += c - '0';
    else if (c >= 'A' && c <= 'F') value += c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') value += c - 'a' + 10;
    else return std::nullopt;
  }
  return static_cast<uint8_t>(value);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(std::string_view json_text) {
  std::unique_ptr<Tokenizer> tokenizer(new Tokenizer());
  // nlohmann reports errors by exception; none may leave this module.
  try {
    RETURN_IF_ERROR(tokenizer->Load(json_text));
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(std::string("tokenizer.json: ") + e.what());
  }
  return tokenizer;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  // gzread reads plain files unchanged, so one path serves tokenizer.json and .json.gz.
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) return absl::NotFoundError("cannot open tokenizer file " + path);
  std::unique_ptr<gzFile_s, int (*)(gzFile)> closer(file, gzclose);
  std::string text;
  constexpr size_t kChunk = 1 << 20;
  for (;;) {
    const size_t old_size = text.size();
    text.resize(old_size + kChunk);
    const int n = gzread(file, text.data() + old_size, kChunk);
    int errnum = Z_OK;
    const char* message = gzerror(file, &errnum);
    if (n < 0 || errnum == Z_BUF_ERROR) {
      // zlib's message already names the file; Z_BUF_ERROR is a truncated gzip stream.
      return absl::DataLossError("cannot read tokenizer file: " +
                                 std::string(message != nullptr && *message != 0 ? message : path));
    }
    text.resize(old_size + static_cast<size_t>(n));
    if (n == 0) break;
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer = FromJson(text);
  if (!tokenizer.ok()) return Annotate(tokenizer.status(), path);
  return tokenizer;
}

absl::Status Tokenizer::Load(std::string_view json_text) {
  Json root = Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    // Parse again with exceptions for the position and reason.
    try {
      root = Json::parse(json_text.begin(), json_text.end());
    } catch (const nlohmann::json::parse_error& e) {
      return absl::InvalidArgumentError(std::string("tokenizer.json is not valid JSON: ") + e.what());
    }
  }
  if (!root.is_object()) return absl::InvalidArgumentError("tokenizer.json: the top level must be an object");
  for (const char* key : {"truncation", "padding"}) {
    if (auto it = root.find(key); it != root.end() && !it->is_null()) {
      return absl::UnimplementedError(std::string("tokenizer.json: ") + key + " is not supported (must be null)");
    }
  }

  ASSIGN_OR_RETURN(added_tokens_, ParseAddedTokens(root));
  matcher_ = AddedTokenMatcher(added_tokens_);
  static const Json kNull;
  auto field = [&](const char* key) -> const Json& {
    auto it = root.find(key);
    return it == root.end() ? kNull : *it;
  };
  ASSIGN_OR_RETURN(normalizer_, MakeNormalizer(field("normalizer"), "normalizer"));
  ASSIGN_OR_RETURN(pre_, MakePreTokenizer(field("pre_tokenizer")));

  std::vector<std::pair<std::string, int32_t>> overrides;
  for (const AddedToken& token : added_tokens_) overrides.emplace_back(token.content, token.id);
  auto model = root.find("model");
  if (model == root.end()) return json_fields::Missing("model", "an object");
  ASSIGN_OR_RETURN(model_, BpeModel::FromJson(*model, pre_.byte_level, overrides));

  ASSIGN_OR_RETURN(post_, MakePostProcessor(field("post_processor"), [this](const std::string& token) {
                     return TokenToId(token);
                   }));

  std::vector<std::string> decoder_types;
  if (!field("decoder").is_null()) RETURN_IF_ERROR(DecoderTypes(field("decoder"), "decoder", &decoder_types));
  auto has = [&](const char* type) {
    return std::find(decoder_types.begin(), decoder_types.end(), type) != decoder_types.end();
  };
  if (has("ByteLevel") && has("ByteFallback")) {
    return absl::UnimplementedError("decoder: ByteLevel together with ByteFallback is not supported");
  }
  decoder_ = has("ByteLevel")      ? DecoderKind::kByteLevel
             : has("ByteFallback") ? DecoderKind::kByteFallback
             : has("Fuse")         ? DecoderKind::kConcat
                                   : DecoderKind::kSpaceJoin;

  // The id table: the model's strings (vocabulary, then added tokens over it).
  int32_t max_id = -1;
  for (const auto& [token, id] : model_->token_to_id()) max_id = std::max(max_id, id);
  // The table has a row per id up to the largest: ids far past the number of tokens would make it
  // mostly holes, as large as the largest id says (a fuzzed file asked for 48 GB). Real
  // vocabularies are dense, their added tokens right after them.
  const int64_t count = static_cast<int64_t>(model_->token_to_id().size());
  if (int64_t{max_id} >= kMaxIdSpread * count + kMaxIdSlack) {
    return absl::InvalidArgumentError(absl::StrCat("model.vocab: ids run to ", max_id, " for ", count,
                                                   " tokens; ids must stay below ", kMaxIdSpread, " x the tokens + ",
                                                   kMaxIdSlack));
  }
  tokens_.assign(static_cast<size_t>(max_id) + 1, TokenInfo{});
  for (const auto& [token, id] : model_->token_to_id()) {
    tokens_[id].present = true;
    tokens_[id].text = token;
  }
  for (const AddedToken& token : added_tokens_) tokens_[token.id].text = token.content;
  // Both decoding rules go by string, as in the reference: a token whose string is an added
  // token's content is emitted verbatim (ByteLevel), and skipped when that one is special.
  absl::flat_hash_set<std::string> added_contents, special_contents;
  for (const AddedToken& token : added_tokens_) {
    added_contents.insert(token.content);
    if (token.special) special_contents.insert(token.content);
  }
  for (TokenInfo& info : tokens_) {
    if (!info.present) continue;
    info.special = special_contents.contains(info.text);
    if (decoder_ == DecoderKind::kByteLevel && !added_contents.contains(info.text)) {
      // A string outside the byte alphabet is emitted as its own UTF-8, as Hugging Face does.
      if (!ByteLevelToBytes(info.text, &info.bytes)) info.bytes = info.text;
    } else if (decoder_ == DecoderKind::kByteFallback && FallbackByte(info.text).has_value()) {
      info.bytes = std::string(1, static_cast<char>(*FallbackByte(info.text)));
    } else {
      info.bytes = info.text;
    }
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::EncodeSection(std::string_view text, std::vector<int32_t>* ids) const {
  std::string normalized;
  if (normalizer_ != nullptr) {
    normalized = std::string(text);
    RETURN_IF_ERROR(normalizer_->Normalize(&normalized));
    if (normalized.empty()) return absl::OkStatus();
    text = normalized;
  }
  Pieces pieces{text};
  PieceArena arena;
  if (pre_.pre_tokenizer != nullptr) RETURN_IF_ERROR(pre_.pre_tokenizer->Split(&pieces, &arena));
  for (std::string_view piece : pieces) RETURN_IF_ERROR(model_->Encode(piece, ids));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  std::string sanitized;
  if (!IsValidUtf8(text)) {
    sanitized = SanitizeUtf8(text);
    text = sanitized;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  if (add_special_tokens) ids.insert(ids.end(), post_.prefix.begin(), post_.prefix.end());
  for (const Section& section : matcher_.Split(text)) {
    if (section.added_index >= 0) {
      ids.push_back(added_tokens_[section.added_index].id);
    } else if (!section.text.empty()) {
      RETURN_IF_ERROR(EncodeSection(section.text, &ids));
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), post_.suffix.begin(), post_.suffix.end());
  return ids;
}

absl::StatusOr<std::string_view> Tokenizer::TokenBytes(int32_t id, bool skip_special_tokens) const {
  if (id < 0 || id >= vocab_size() || !tokens_[id].present) {
    return absl::InvalidArgumentError("token id " + std::to_string(id) + " is not in the vocabulary (size " +
                                      std::to_string(vocab_size()) + ")");
  }
  const TokenInfo& info = tokens_[id];
  if (skip_special_tokens && info.special) return std::string_view();
  return std::string_view(info.bytes);
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string out;
  bool first = true;
  for (int32_t id : ids) {
    ASSIGN_OR_RETURN(std::string_view bytes, TokenBytes(id, skip_special_tokens));
    if (skip_special_tokens && tokens_[id].special) continue;
    if (decoder_ == DecoderKind::kSpaceJoin && !first) out.push_back(' ');
    out.append(bytes);
    first = false;
  }
  return out;
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  const auto& map = model_->token_to_id();
  auto it = map.find(absl::string_view(token.data(), token.size()));
  if (it == map.end()) return std::nullopt;
  return it->second;
}

std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= vocab_size() || !tokens_[id].present) return std::nullopt;
  return tokens_[id].text;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size() && tokens_[id].present && tokens_[id].special;
}

std::vector<int32_t> Tokenizer::SpecialTokenIds() const {
  std::vector<int32_t> ids;
  for (const AddedToken& token : added_tokens_) {
    if (token.special) ids.push_back(token.id);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace nq::tokenizer
