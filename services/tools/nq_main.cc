// nq: the NestQuant Serve command-line tool.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "services/tools/commands.h"

ABSL_FLAG(std::string, out, "", "Output file (logits) or directory (synth-model)");

namespace {

constexpr char kUsage[] =
    "nq <command> [flags]\n"
    "commands:\n"
    "  logits       run the model over token ids and write float32 logits\n"
    "                 --model DIR --tokens 1,2,3 [--tp W] [--decode] [--mtp] --out FILE\n"
    "  synth-model  write a random-weight checkpoint for a config.json\n"
    "                 --config JSON --out DIR [--dtype f32|bf16|fp8] [--seed N] [--max_shard_mb N]\n"
    "  tokenize     text on stdin -> comma-separated token ids on stdout\n"
    "                 --tokenizer FILE [--add_special_tokens]\n"
    "  detokenize   comma-separated token ids on stdin -> decoded bytes on stdout\n"
    "                 --tokenizer FILE [--skip_special_tokens]\n"
    "run 'nq --help' for every flag";

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> positional = absl::ParseCommandLine(argc, argv);
  if (positional.size() < 2) {
    std::fprintf(stderr, "%s\n", kUsage);
    return 2;
  }
  const std::string command = positional[1];
  std::vector<std::string> rest(positional.begin() + 2, positional.end());
  if (command == "logits") return nq::tools::RunLogits(rest);
  if (command == "synth-model") return nq::tools::RunSynthModel(rest);
  if (command == "tokenize") return nq::tools::RunTokenize(rest);
  if (command == "detokenize") return nq::tools::RunDetokenize(rest);
  std::fprintf(stderr, "nq: unknown command '%s'\n%s\n", command.c_str(), kUsage);
  return 2;
}
