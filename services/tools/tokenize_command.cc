// nq tokenize / nq detokenize: the tokenizer from a shell, for scripts and tests.
//   nq tokenize --tokenizer FILE [--add_special_tokens] < text      -> "id,id,...\n"
//   nq detokenize --tokenizer FILE [--skip_special_tokens] < "id,id,..." -> raw bytes
// FILE is a tokenizer.json, plain or gzipped. Detokenize writes exactly the bytes the tokens
// decode to (possibly invalid UTF-8); pipe through `iconv` or similar to sanitise.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "services/common/status_macros.h"
#include "services/tokenizer/tokenizer.h"
#include "services/tools/commands.h"

ABSL_FLAG(std::string, tokenizer, "", "tokenize/detokenize: tokenizer.json (or .json.gz)");
ABSL_FLAG(bool, add_special_tokens, false, "tokenize: wrap the ids as the tokenizer's post-processor says");
ABSL_FLAG(bool, skip_special_tokens, false, "detokenize: leave special tokens out");

namespace nq::tools {
namespace {

std::string ReadStdin() {
  std::ios::sync_with_stdio(false);
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

// Bad usage: the message, or empty when the command line is fine.
std::string UsageError(const std::vector<std::string>& args) {
  if (!args.empty()) return "unexpected argument '" + args[0] + "'";
  if (absl::GetFlag(FLAGS_tokenizer).empty()) return "--tokenizer is required";
  return "";
}

absl::StatusOr<std::unique_ptr<tokenizer::Tokenizer>> LoadTokenizer() {
  return tokenizer::Tokenizer::FromFile(absl::GetFlag(FLAGS_tokenizer));
}

absl::StatusOr<std::vector<int32_t>> ParseIds(const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, absl::ByAnyChar(", \t\r\n"), absl::SkipEmpty())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id) || id < 0) {
      return absl::InvalidArgumentError("'" + std::string(part) + "' is not a token id");
    }
    ids.push_back(id);
  }
  return ids;
}

absl::Status Tokenize() {
  ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::Tokenizer> tok, LoadTokenizer());
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok->Encode(ReadStdin(), absl::GetFlag(FLAGS_add_special_tokens)));
  std::printf("%s\n", absl::StrJoin(ids, ",").c_str());
  return absl::OkStatus();
}

absl::Status Detokenize() {
  ASSIGN_OR_RETURN(std::unique_ptr<tokenizer::Tokenizer> tok, LoadTokenizer());
  ASSIGN_OR_RETURN(std::vector<int32_t> ids, ParseIds(ReadStdin()));
  ASSIGN_OR_RETURN(std::string bytes, tok->Decode(ids, absl::GetFlag(FLAGS_skip_special_tokens)));
  if (std::fwrite(bytes.data(), 1, bytes.size(), stdout) != bytes.size()) {
    return absl::InternalError("cannot write to stdout");
  }
  return absl::OkStatus();
}

int Run(const char* command, const std::vector<std::string>& args, absl::Status (*body)()) {
  if (const std::string usage = UsageError(args); !usage.empty()) {
    std::fprintf(stderr, "nq %s: %s\n", command, usage.c_str());
    return 2;
  }
  const absl::Status status = body();
  if (status.ok()) return 0;
  std::fprintf(stderr, "nq %s: %s\n", command, std::string(status.message()).c_str());
  return 1;
}

}  // namespace

int RunTokenize(const std::vector<std::string>& args) { return Run("tokenize", args, Tokenize); }
int RunDetokenize(const std::vector<std::string>& args) { return Run("detokenize", args, Detokenize); }

}  // namespace nq::tools
