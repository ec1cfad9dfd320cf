#include "services/eval/kld_harness.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "services/common/status_macros.h"
#include "services/release/calibration.h"

namespace nq::eval {
namespace {

// A JSON list of ids, or a list of such lists, as sequences.
absl::StatusOr<std::vector<std::vector<int32_t>>> JsonSequences(const nlohmann::ordered_json& value,
                                                                const std::string& where) {
  const absl::Status bad = absl::InvalidArgumentError(where + ": want a list of token ids or a list of such lists");
  if (!value.is_array()) return bad;
  auto ids_of = [&](const nlohmann::ordered_json& list) -> absl::StatusOr<std::vector<int32_t>> {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < list.size(); ++i) {
      const nlohmann::ordered_json& id = list[i];
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        return absl::InvalidArgumentError(absl::StrCat(where, "[", i, "]: ", id.dump(), " is not a token id"));
      }
      ids.push_back(id.get<int32_t>());
    }
    return ids;
  };
  std::vector<std::vector<int32_t>> sequences;
  if (!value.empty() && value[0].is_array()) {
    for (const nlohmann::ordered_json& list : value) {
      if (!list.is_array()) return bad;
      ASSIGN_OR_RETURN(std::vector<int32_t> ids, ids_of(list));
      if (!ids.empty()) sequences.push_back(std::move(ids));
    }
  } else {
    ASSIGN_OR_RETURN(std::vector<int32_t> ids, ids_of(value));
    if (!ids.empty()) sequences.push_back(std::move(ids));
  }
  if (sequences.empty()) return absl::InvalidArgumentError(where + " holds no token ids");
  return sequences;
}

absl::Status ReadOneFile(const std::string& path, std::vector<KldDomain>& domains) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError("cannot read token file " + path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string contents = text.str();
  const size_t first = contents.find_first_not_of(" \t\r\n");
  const std::string stem = std::filesystem::path(path).stem().string();
  if (first == std::string::npos || (contents[first] != '[' && contents[first] != '{')) {
    ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> sequences, release::ReadTokenFile(path));
    domains.push_back({.name = stem, .sequences = std::move(sequences)});
    return absl::OkStatus();
  }
  const nlohmann::ordered_json json = nlohmann::ordered_json::parse(contents, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return absl::InvalidArgumentError(path + " is not valid JSON");
  if (json.is_array()) {
    ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> sequences, JsonSequences(json, path));
    domains.push_back({.name = stem, .sequences = std::move(sequences)});
    return absl::OkStatus();
  }
  if (json.empty()) return absl::InvalidArgumentError(path + " names no domains");
  for (const auto& [name, value] : json.items()) {
    ASSIGN_OR_RETURN(std::vector<std::vector<int32_t>> sequences,
                     JsonSequences(value, absl::StrCat(path, ": \"", name, "\"")));
    domains.push_back({.name = name, .sequences = std::move(sequences)});
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<KldDomain>> ReadKldTokens(std::span<const std::string> paths) {
  if (paths.empty()) return absl::InvalidArgumentError("no token files");
  std::vector<KldDomain> domains;
  for (const std::string& path : paths) RETURN_IF_ERROR(ReadOneFile(path, domains));
  std::set<std::string> seen;
  for (const KldDomain& d : domains) {
    if (!seen.insert(d.name).second) {
      return absl::InvalidArgumentError("domain '" + d.name + "' is given twice (domains are file stems or JSON keys)");
    }
  }
  return domains;
}

absl::StatusOr<std::vector<KldDomain>> SelectDomains(std::vector<KldDomain> domains,
                                                     std::span<const std::string> names) {
  if (names.empty()) return domains;
  std::vector<KldDomain> selected;
  for (const std::string& name : names) {
    auto it = std::find_if(domains.begin(), domains.end(), [&](const KldDomain& d) { return d.name == name; });
    if (it == domains.end()) {
      std::vector<std::string> there;
      for (const KldDomain& d : domains) there.push_back(d.name);
      return absl::InvalidArgumentError(
          absl::StrCat("no domain '", name, "' in the token files (they hold: ", absl::StrJoin(there, ", "), ")"));
    }
    selected.push_back(*it);
  }
  return selected;
}

absl::Status CheckTokenIds(std::span<const KldDomain> domains, int64_t vocab_size) {
  for (const KldDomain& d : domains) {
    for (size_t s = 0; s < d.sequences.size(); ++s) {
      for (size_t i = 0; i < d.sequences[s].size(); ++i) {
        if (d.sequences[s][i] >= vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat("domain '", d.name, "' sequence ", s, " position ", i,
                                                         ": token ", d.sequences[s][i],
                                                         " is outside the model's vocabulary of ", vocab_size));
        }
      }
    }
  }
  return absl::OkStatus();
}

int64_t LongestWindow(std::span<const KldDomain> domains, int64_t window) {
  int64_t longest = 1;
  for (const KldDomain& d : domains) {
    for (const auto& s : d.sequences) longest = std::max<int64_t>(longest, static_cast<int64_t>(s.size()));
  }
  return std::min(longest, window);
}

absl::Status ModelLogitSource::BeginWindow() {
  model_.ResetCache();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ModelLogitSource::Next(std::span<const int32_t> block) {
  return model_.Forward(block);
}

absl::StatusOr<KldReport> MeasureKld(LogitSource& teacher, LogitSource& student, std::span<const KldDomain> domains,
                                     int64_t window) {
  if (window < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--window ", window, ": a window needs at least 2 tokens"));
  }
  const int64_t vocab = teacher.vocab_size();
  if (student.vocab_size() != vocab) {
    return absl::InvalidArgumentError(
        absl::StrCat("the teacher's vocabulary has ", vocab, " tokens, the student's ", student.vocab_size()));
  }
  KldReport report;
  std::vector<TokenKl> all;
  for (const KldDomain& domain : domains) {
    std::vector<TokenKl> scored;
    for (const std::vector<int32_t>& sequence : domain.sequences) {
      const std::span<const int32_t> ids(sequence);
      for (size_t start = 0; start < ids.size(); start += static_cast<size_t>(window)) {
        const std::span<const int32_t> w = ids.subspan(start, std::min<size_t>(window, ids.size() - start));
        RETURN_IF_ERROR(teacher.BeginWindow());
        RETURN_IF_ERROR(student.BeginWindow());
        for (size_t b = 0; b < w.size(); b += kKldBlockTokens) {
          const std::span<const int32_t> block = w.subspan(b, std::min<size_t>(kKldBlockTokens, w.size() - b));
          ASSIGN_OR_RETURN(std::vector<float> p, teacher.Next(block));
          ASSIGN_OR_RETURN(std::vector<float> q, student.Next(block));
          ASSIGN_OR_RETURN(std::vector<TokenKl> rows, KlDivergenceRows(p, q, vocab));
          scored.insert(scored.end(), rows.begin(), rows.end());
        }
      }
    }
    report.domains.push_back({.name = domain.name, .kl = SummarizeKl(scored)});
    all.insert(all.end(), scored.begin(), scored.end());
  }
  report.overall = SummarizeKl(all);
  return report;
}

}  // namespace nq::eval
