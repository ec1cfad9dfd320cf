#include "services/tokenizer/added_tokens.h"

#include <algorithm>

#include "services/tokenizer/normalizer.h"

namespace nq::tokenizer {

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens) : tokens_(tokens) {
  nodes_.emplace_back();
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& content = tokens[t].content;
    if (content.empty()) continue;  // the reference's trie never reports an empty match
    first_byte_[static_cast<uint8_t>(content[0])] = true;
    int32_t node = 0;
    for (char c : content) {
      const auto byte = static_cast<uint8_t>(c);
      int32_t next = Child(node, byte);
      if (next < 0) {
        next = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
        auto& children = nodes_[node].children;
        children.insert(std::upper_bound(children.begin(), children.end(), std::make_pair(byte, INT32_MIN),
                                         [](const auto& a, const auto& b) { return a.first < b.first; }),
                        {byte, next});
      }
      node = next;
    }
    // Two tokens with the same content: the reference's trie keeps one string, and its map
    // keeps the last token with that content.
    nodes_[node].token = static_cast<int32_t>(t);
  }
}

int32_t AddedTokenMatcher::Child(int32_t node, uint8_t byte) const {
  const auto& children = nodes_[node].children;
  auto it = std::lower_bound(children.begin(), children.end(), byte,
                             [](const auto& child, uint8_t b) { return child.first < b; });
  return it != children.end() && it->first == byte ? it->second : -1;
}

std::vector<Section> AddedTokenMatcher::Split(std::string_view text) const {
  std::vector<Section> sections;
  size_t start = 0, i = 0;
  const size_t n = text.size();
  while (i < n) {
    if (!first_byte_[static_cast<uint8_t>(text[i])]) {
      ++i;
      continue;
    }
    int32_t node = 0, match = -1;
    size_t match_end = i;
    for (size_t j = i; j < n; ++j) {
      node = Child(node, static_cast<uint8_t>(text[j]));
      if (node < 0) break;
      if (nodes_[node].token >= 0) {
        match = nodes_[node].token;  // keep the longest
        match_end = j + 1;
      }
    }
    if (match < 0) {
      ++i;
      continue;
    }
    if (i > start) sections.push_back({text.substr(start, i - start), -1});
    sections.push_back({text.substr(i, match_end - i), match});
    i = start = match_end;
  }
  if (start < n) sections.push_back({text.substr(start), -1});

  // lstrip / rstrip trim the neighbours (trimEnd / trimStart), whatever they are.
  for (size_t s = 0; s < sections.size(); ++s) {
    if (sections[s].added_index < 0) continue;
    const AddedToken& token = tokens_[sections[s].added_index];
    if (token.lstrip && s > 0) sections[s - 1].text = JsTrimEnd(sections[s - 1].text);
    if (token.rstrip && s + 1 < sections.size()) sections[s + 1].text = JsTrimStart(sections[s + 1].text);
  }
  // A token whose own content lost characters to a neighbour's strip is no longer that token:
  // the reference looks sections up by content.
  for (Section& section : sections) {
    if (section.added_index >= 0 && section.text != tokens_[section.added_index].content) section.added_index = -1;
  }
  return sections;
}

}  // namespace nq::tokenizer
