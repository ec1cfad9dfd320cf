#include "services/tokenizer/bpe_model.h"

#include <climits>
#include <cstdio>
#include <algorithm>
#include <functional>

#include "absl/hash/hash.h"
#include "absl/strings/string_view.h"
#include "services/common/status_macros.h"
#include "services/tokenizer/byte_level.h"
#include "services/tokenizer/json_fields.h"
#include "services/tokenizer/utf8.h"

namespace nq::tokenizer {
namespace {

using json_fields::Json;

// Pieces up to this many symbols merge by linear scans (fewer allocations and hash lookups);
// longer ones (runs of spaces, long CJK runs) use the O(n log n) heap.
constexpr size_t kMaxLinearSymbols = 48;

constexpr int32_t kNoRank = INT32_MAX;

}  // namespace

int32_t BpeModel::Intern(const std::string& key) {
  auto [it, inserted] = key_to_symbol_.try_emplace(key, static_cast<int32_t>(symbols_.size()));
  if (inserted) symbols_.push_back({key, -1});
  return it->second;
}

int32_t BpeModel::FindSymbol(std::string_view key) const {
  auto it = key_to_symbol_.find(absl::string_view(key.data(), key.size()));
  return it == key_to_symbol_.end() ? -1 : it->second;
}

const BpeModel::Merge* BpeModel::FindMerge(int32_t left, int32_t right) const {
  if (left < 0 || right < 0) return nullptr;
  auto it = merges_.find(PairKey(left, right));
  return it == merges_.end() ? nullptr : &it->second;
}

absl::StatusOr<std::unique_ptr<BpeModel>> BpeModel::FromJson(
    const Json& model, bool byte_level, const std::vector<std::pair<std::string, int32_t>>& overrides) {
  const std::string path = "model";
  if (!model.is_object()) return json_fields::Missing(path, "an object");
  const std::string bpe = "BPE";
  ASSIGN_OR_RETURN(const std::string type, json_fields::String(model, "type", path, &bpe));
  if (type != "BPE") {
    return absl::UnimplementedError("model type '" + type + "' is not supported (only BPE)");
  }
  const std::string none;
  ASSIGN_OR_RETURN(const std::string prefix, json_fields::String(model, "continuing_subword_prefix", path, &none));
  ASSIGN_OR_RETURN(const std::string suffix, json_fields::String(model, "end_of_word_suffix", path, &none));
  if (!prefix.empty()) return absl::UnimplementedError("BPE continuing_subword_prefix is not supported");
  if (!suffix.empty()) return absl::UnimplementedError("BPE end_of_word_suffix is not supported");

  std::unique_ptr<BpeModel> m(new BpeModel());
  m->byte_level_ = byte_level;
  ASSIGN_OR_RETURN(m->ignore_merges_, json_fields::Bool(model, "ignore_merges", path, false));
  ASSIGN_OR_RETURN(m->byte_fallback_, json_fields::Bool(model, "byte_fallback", path, false));
  ASSIGN_OR_RETURN(m->fuse_unk_, json_fields::Bool(model, "fuse_unk", path, false));
  ASSIGN_OR_RETURN(m->unk_token_, json_fields::String(model, "unk_token", path, &none));

  // The key a vocabulary string is looked up by: its raw bytes for a byte-level model. A
  // string outside the byte alphabet can never come out of byte-level merges.
  auto key_of = [&](const std::string& token, std::string* key) -> bool {
    if (!byte_level) {
      *key = token;
      return true;
    }
    key->clear();
    return ByteLevelToBytes(token, key);
  };

  auto vocab = model.find("vocab");
  if (vocab == model.end() || !vocab->is_object()) return json_fields::Missing(path + ".vocab", "an object");
  m->token_to_id_.reserve(vocab->size());
  m->symbols_.reserve(vocab->size() * 3 / 2);
  m->key_to_symbol_.reserve(vocab->size() * 3 / 2);
  std::string key;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() > INT32_MAX) {
      return absl::InvalidArgumentError("tokenizer.json: model.vocab['" + it.key() + "'] is not a token id");
    }
    const auto id = static_cast<int32_t>(it.value().get<int64_t>());
    m->token_to_id_[it.key()] = id;
    if (key_of(it.key(), &key)) m->symbols_[m->Intern(key)].id = id;
  }
  for (const auto& [token, id] : overrides) {
    m->token_to_id_[token] = id;
    if (key_of(token, &key)) m->symbols_[m->Intern(key)].id = id;
  }

  ASSIGN_OR_RETURN(const Json* merges, json_fields::Array(model, "merges", path));
  m->merges_.reserve(merges->size());
  std::string left_key, right_key;
  for (size_t rank = 0; rank < merges->size(); ++rank) {
    const Json& merge = (*merges)[rank];
    std::string left, right;
    if (merge.is_string()) {
      // The pre-0.20 format "left right": x.split(" ", 2) in the reference.
      const std::string& text = merge.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      if (space == std::string::npos) {
        return absl::InvalidArgumentError("tokenizer.json: model.merges[" + std::to_string(rank) + "] '" + text +
                                          "' is not two tokens separated by a space");
      }
      left = text.substr(0, space);
      const size_t next_space = text.find(' ', space + 1);
      right = text.substr(space + 1, next_space == std::string::npos ? std::string::npos : next_space - space - 1);
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string()) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      return absl::InvalidArgumentError("tokenizer.json: model.merges[" + std::to_string(rank) +
                                        "] is neither \"a b\" nor [\"a\", \"b\"]");
    }
    if (!key_of(left, &left_key) || !key_of(right, &right_key)) continue;
    const int32_t l = m->Intern(left_key);
    const int32_t r = m->Intern(right_key);
    const int32_t result = m->Intern(left_key + right_key);
    // A repeated pair keeps its last rank, as the reference's Map does.
    m->merges_[PairKey(l, r)] = Merge{static_cast<int32_t>(rank), result};
  }

  for (int b = 0; b < 256; ++b) {
    m->byte_symbol_[b] = byte_level ? m->Intern(std::string(1, static_cast<char>(b))) : -1;
    char name[8];
    std::snprintf(name, sizeof(name), "<0x%02X>", b);
    auto it = m->token_to_id_.find(name);
    m->fallback_byte_id_[b] = it == m->token_to_id_.end() ? -1 : it->second;
  }
  if (!m->unk_token_.empty()) {
    auto it = m->token_to_id_.find(m->unk_token_);
    if (it != m->token_to_id_.end()) m->unk_id_ = it->second;
  }
  return m;
}

void BpeModel::InitialSymbols(std::string_view piece, std::vector<int32_t>* symbols,
                              std::vector<std::string_view>* texts) const {
  symbols->clear();
  texts->clear();
  if (byte_level_) {
    for (size_t i = 0; i < piece.size(); ++i) {
      symbols->push_back(byte_symbol_[static_cast<uint8_t>(piece[i])]);
      texts->push_back(piece.substr(i, 1));
    }
    return;
  }
  size_t i = 0;
  while (i < piece.size()) {
    const size_t len = Utf8CharLength(static_cast<uint8_t>(piece[i]));
    const std::string_view ch = piece.substr(i, len);
    symbols->push_back(FindSymbol(ch));
    texts->push_back(ch);
    i += len;
  }
}

void BpeModel::MergeShort(std::vector<int32_t>* symbols, std::vector<std::string_view>* texts) const {
  std::vector<int32_t>& s = *symbols;
  std::vector<std::string_view>& t = *texts;
  auto rank_at = [&](size_t i) {
    const Merge* merge = FindMerge(s[i], s[i + 1]);
    return merge == nullptr ? kNoRank : merge->rank;
  };
  std::vector<int32_t> ranks(s.size() > 1 ? s.size() - 1 : 0);
  for (size_t i = 0; i < ranks.size(); ++i) ranks[i] = rank_at(i);
  while (!ranks.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < ranks.size(); ++i) {
      if (ranks[i] < ranks[best]) best = i;  // strict: the leftmost wins a tie
    }
    if (ranks[best] == kNoRank) break;
    s[best] = FindMerge(s[best], s[best + 1])->result;
    t[best] = std::string_view(t[best].data(), t[best].size() + t[best + 1].size());
    s.erase(s.begin() + best + 1);
    t.erase(t.begin() + best + 1);
    ranks.erase(ranks.begin() + best);
    if (best > 0) ranks[best - 1] = rank_at(best - 1);
    if (best < ranks.size()) ranks[best] = rank_at(best);
  }
}

void BpeModel::MergeLong(std::vector<int32_t>* symbols, std::vector<std::string_view>* texts) const {
  struct Node {
    int32_t symbol;
    int32_t prev, next;  // -1 at the ends
    std::string_view text;
  };
  struct Candidate {
    int32_t rank;
    int32_t left;  // node index == original position, which orders ties
    int32_t right;
    int32_t left_symbol, right_symbol;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  const auto n = static_cast<int32_t>(symbols->size());
  // Reused per thread: long pieces are frequent in CJK text.
  thread_local std::vector<Node> nodes;
  thread_local std::vector<Candidate> heap_storage;
  nodes.resize(n);
  for (int32_t i = 0; i < n; ++i) nodes[i] = {(*symbols)[i], i - 1, i + 1 < n ? i + 1 : -1, (*texts)[i]};
  // A min-heap on (rank, position) via std::push_heap / pop_heap with greater<>.
  std::vector<Candidate>& queue = heap_storage;
  queue.clear();
  auto consider = [&](int32_t left) {
    if (left < 0 || nodes[left].next < 0) return;
    const int32_t right = nodes[left].next;
    if (const Merge* merge = FindMerge(nodes[left].symbol, nodes[right].symbol)) {
      queue.push_back({merge->rank, left, right, nodes[left].symbol, nodes[right].symbol});
      std::push_heap(queue.begin(), queue.end(), std::greater<Candidate>());
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), std::greater<Candidate>());
    const Candidate c = queue.back();
    queue.pop_back();
    // Stale when either side merged since: a node's symbol only ever grows, so equal
    // symbols and adjacency mean the pair is unchanged. Merged-away nodes have symbol -2.
    Node& left = nodes[c.left];
    if (left.next != c.right || left.symbol != c.left_symbol || nodes[c.right].symbol != c.right_symbol) continue;
    Node& right = nodes[c.right];
    left.symbol = FindMerge(c.left_symbol, c.right_symbol)->result;
    left.text = std::string_view(left.text.data(), left.text.size() + right.text.size());
    left.next = right.next;
    if (right.next >= 0) nodes[right.next].prev = c.left;
    right.symbol = -2;
    consider(left.prev);
    consider(c.left);
  }
  symbols->clear();
  texts->clear();
  for (int32_t i = 0; i >= 0; i = nodes[i].next) {
    symbols->push_back(nodes[i].symbol);
    texts->push_back(nodes[i].text);
  }
}

absl::Status BpeModel::EmitSymbols(const std::vector<int32_t>& symbols, const std::vector<std::string_view>& texts,
                                   std::vector<int32_t>* ids) const {
  for (size_t i = 0; i < symbols.size(); ++i) {
    const int32_t symbol = symbols[i];
    if (symbol >= 0 && symbols_[symbol].id >= 0) {
      ids->push_back(symbols_[symbol].id);
      continue;
    }
    if (byte_fallback_) {
      // The reference encodes the token *string* (the alphabet form for byte-level) as UTF-8.
      std::string bytes;
      if (byte_level_) {
        BytesToByteLevel(texts[i], &bytes);
      } else {
        bytes = std::string(texts[i]);
      }
      bool all_known = true;
      for (char b : bytes) all_known = all_known && fallback_byte_id_[static_cast<uint8_t>(b)] >= 0;
      if (all_known) {
        for (char b : bytes) ids->push_back(fallback_byte_id_[static_cast<uint8_t>(b)]);
        continue;
      }
    }
    if (unk_id_ < 0) {
      return absl::InvalidArgumentError("text '" + std::string(texts[i]) +
                                        "' has no token in the vocabulary and the model has no unk_token");
    }
    if (fuse_unk_ && !ids->empty() && ids->back() == unk_id_) continue;
    ids->push_back(unk_id_);
  }
  return absl::OkStatus();
}

absl::Status BpeModel::EncodeUncached(std::string_view piece, std::vector<int32_t>* ids) const {
  thread_local std::vector<int32_t> symbols;
  thread_local std::vector<std::string_view> texts;
  InitialSymbols(piece, &symbols, &texts);
  if (symbols.size() <= kMaxLinearSymbols) {
    MergeShort(&symbols, &texts);
  } else {
    MergeLong(&symbols, &texts);
  }
  return EmitSymbols(symbols, texts, ids);
}

absl::Status BpeModel::Encode(std::string_view piece, std::vector<int32_t>* ids) const {
  if (piece.empty()) return absl::OkStatus();
  if (ignore_merges_) {
    // The whole piece is a token: the reference emits it without merging.
    const int32_t symbol = FindSymbol(piece);
    if (symbol >= 0 && symbols_[symbol].id >= 0) {
      ids->push_back(symbols_[symbol].id);
      return absl::OkStatus();
    }
  }
  if (piece.size() > kMaxCachedPieceBytes) return EncodeUncached(piece, ids);
  // Debian's Abseil has its own string_view; heterogeneous lookups need that type.
  const absl::string_view key(piece.data(), piece.size());
  const size_t hash = absl::Hash<absl::string_view>()(key);
  CacheShard& shard = cache_[hash % kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.entries.find(key);
    if (it != shard.entries.end()) {
      size_t skip = 0;
      if (fuse_unk_ && !it->second.empty() && it->second.front() == unk_id_ && !ids->empty() &&
          ids->back() == unk_id_) {
        skip = 1;
      }
      ids->insert(ids->end(), it->second.begin() + skip, it->second.end());
      return absl::OkStatus();
    }
  }
  std::vector<int32_t> piece_ids;
  RETURN_IF_ERROR(EncodeUncached(piece, &piece_ids));
  size_t skip = 0;
  if (fuse_unk_ && !piece_ids.empty() && piece_ids.front() == unk_id_ && !ids->empty() && ids->back() == unk_id_) {
    skip = 1;
  }
  ids->insert(ids->end(), piece_ids.begin() + skip, piece_ids.end());
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.entries.size() >= kCacheEntriesPerShard) shard.entries.clear();
  shard.entries.emplace(std::string(piece), std::move(piece_ids));
  return absl::OkStatus();
}

}  // namespace nq::tokenizer
