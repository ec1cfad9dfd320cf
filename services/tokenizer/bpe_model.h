// The BPE model of tokenizer.json ("model": {"type": "BPE"}): a vocabulary and ranked merges.
//
// Merging follows the reference exactly: repeatedly merge the adjacent pair with the lowest
// merge rank, the leftmost one on a tie; a duplicated merge keeps its last rank (the
// reference builds a Map). Symbols are interned: each vocabulary string and each merge side
// and result gets a dense symbol index, merges are looked up by (left, right) symbol pairs,
// and pieces of a byte-level tokenizer are handled as raw bytes, never as alphabet strings.
// Short pieces merge with a linear scan, long ones with a heap over a linked list; both orders
// are (rank, position). Results of short pieces are cached.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace nq::tokenizer {

class BpeModel {
 public:
  // `byte_level`: pieces arrive as raw bytes and the vocabulary is in GPT-2's byte alphabet.
  // `overrides` maps token strings (vocabulary form) to ids that take precedence over the
  // vocabulary's (the added tokens, as the reference registers them with the model).
  static absl::StatusOr<std::unique_ptr<BpeModel>> FromJson(
      const nlohmann::json& model, bool byte_level,
      const std::vector<std::pair<std::string, int32_t>>& overrides);

  BpeModel(const BpeModel&) = delete;
  BpeModel& operator=(const BpeModel&) = delete;

  // Appends the ids of one pre-tokenized piece. Fails only when a piece has characters the
  // vocabulary cannot express and there is neither byte fallback nor an unknown token.
  absl::Status Encode(std::string_view piece, std::vector<int32_t>* ids) const;

  // Vocabulary strings (the form tokenizer.json stores) and ids, overrides applied.
  const absl::flat_hash_map<std::string, int32_t>& token_to_id() const { return token_to_id_; }

 private:
  struct Merge {
    int32_t rank;
    int32_t result;  // symbol index
  };
  // A symbol: the key (raw bytes for byte-level, else UTF-8) and its token id, or -1 when the
  // string is not in the vocabulary (an intermediate merge result or an unknown character).
  struct Symbol {
    std::string key;
    int32_t id;
  };

  BpeModel() = default;
  int32_t Intern(const std::string& key);
  int32_t FindSymbol(std::string_view key) const;
  static uint64_t PairKey(int32_t left, int32_t right) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
  }
  const Merge* FindMerge(int32_t left, int32_t right) const;

  // Splits `piece` into its initial symbols (bytes, or characters); unknown characters get
  // symbol -1 and keep their text in `unknown`.
  void InitialSymbols(std::string_view piece, std::vector<int32_t>* symbols,
                      std::vector<std::string_view>* texts) const;
  void MergeShort(std::vector<int32_t>* symbols, std::vector<std::string_view>* texts) const;
  void MergeLong(std::vector<int32_t>* symbols, std::vector<std::string_view>* texts) const;
  absl::Status EmitSymbols(const std::vector<int32_t>& symbols, const std::vector<std::string_view>& texts,
                           std::vector<int32_t>* ids) const;
  absl::Status EncodeUncached(std::string_view piece, std::vector<int32_t>* ids) const;

  bool byte_level_ = false;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  std::string unk_token_;
  std::vector<Symbol> symbols_;
  absl::flat_hash_map<std::string, int32_t> key_to_symbol_;
  absl::flat_hash_map<uint64_t, Merge> merges_;
  std::array<int32_t, 256> byte_symbol_{};        // byte-level: symbol of each single byte
  std::array<int32_t, 256> fallback_byte_id_{};   // byte_fallback: id of "<0xXX>", or -1
  absl::flat_hash_map<std::string, int32_t> token_to_id_;

  // Word cache, sharded so concurrent encoders rarely meet on a lock.
  static constexpr size_t kCacheShards = 16;
  static constexpr size_t kCacheEntriesPerShard = 4096;
  static constexpr size_t kMaxCachedPieceBytes = 256;
  // std::mutex rather than absl::Mutex: Debian's Abseil runs deadlock detection on every
  // absl::Mutex lock, which cost a fifth of encoding time here.
  struct CacheShard {
    std::mutex mu;
    absl::flat_hash_map<std::string, std::vector<int32_t>> entries;  // guarded by mu
  };
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace nq::tokenizer
