// nq: the NestQuant Serve command-line tool.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "services/tools/commands.h"

ABSL_FLAG(std::string, out, "",
          "Output file (logits; the JSON report of kld, mtp-acceptance, bench-decode) or directory (synth-model)");

namespace {

constexpr char kUsage[] =
    "nq <command> [flags]\n"
    "commands:\n"
    "  logits       run the model over token ids and write float32 logits\n"
    "                 --model DIR --tokens 1,2,3 [--tp W] [--decode] [--mtp] --out FILE\n"
    "  synth-model  write a random-weight checkpoint for a config.json\n"
    "                 --config JSON --out DIR [--dtype f32|bf16|fp8] [--seed N] [--max_shard_mb N]\n"
    "                 [--routed_experts=false]  (no routed expert weights: serve them from a release)\n"
    "  tokenize     text on stdin -> comma-separated token ids on stdout\n"
    "                 --tokenizer FILE [--add_special_tokens]\n"
    "  detokenize   comma-separated token ids on stdin -> decoded bytes on stdout\n"
    "                 --tokenizer FILE [--skip_special_tokens]\n"
    "  encode       HF checkpoint -> NestQuant release\n"
    "                 --model DIR --out RELEASE [--tp W] [--calib H] [--fixed-per-layer N] [--codec scalar|trellis]\n"
    "                 [--device cpu|cuda|cuda:N[,M...]] [--workers N] [--base_levels uniform|lloyd|uniform_nested]\n"
    "                 [--codebook_refinements N]   (docs/encoding.md)\n"
    "  synth-release  a release of made-up experts at the config's real sizes, for benchmarks (reads only config.json)\n"
    "                 --model DIR --out RELEASE [--tp W] [--fixed-per-layer N] [--codec scalar|trellis] [--seed N]\n"
    "  calibrate    per-expert input Hessians and routing counts over calibration tokens\n"
    "                 --model DIR --tokens FILE --out H\n"
    "  trace        routing traces of the model over token sequences: --model DIR --tokens FILE --out T\n"
    "                 or of a running worker: --worker HOST:PORT --out T [--trace-tokens N] [--seconds S]\n"
    "  replay       4-bit share of slot policies on a trace: --trace T [--release-dir R] [--slots F]\n"
    "                 [--landing-tokens N]\n"
    "  lookahead    how well a layer's router on earlier layers' output knows its experts:\n"
    "                 --model DIR --tokens FILE [--depths 1,2,3]\n"
    "  verify       hash every file and range of a release: nq verify RELEASE\n"
    "  assemble     install a release's layers: --src REL --into DIR [--layers a-b] [--dry-run]\n"
    "  bench-codec  the codecs side by side: distortion, bits, LDLQ, encode time [--size N --codecs scalar,trellis --device cuda[:N]]\n"
    "  bench-decode decode tokens/s of a model loaded as nq-worker loads it, no services in the way\n"
    "                 --model DIR [--release R --expert-bits 2|4|fixed] [--backend cpu|cuda] [--gpu N]\n"
    "                 [--decode_gemv auto|tensor|fma]\n"
    "                 [--prompt-tokens 128] [--warmup 4] [--decode-tokens 64] [--seed S] [--kv-cache-dtype f32|bf16]\n"
    "                 [--max-model-len 4096] [--speculative_tokens N] [--sampling_temperature T] [--out JSON]\n"
    "                 [--sampling_frequency_penalty P [--device_logit_adjust]]\n"
    "  bench-prefill  time to first token of long prompts: the worker's chunked and layer-major prefill\n"
    "                 --model DIR [--release R --expert-bits 2|4] [--backend cpu|cuda] [--prefill-lengths 2048]\n"
    "                 [--prefill-rounds 2] [--layer-major-prefill-tokens 2048] [--prefill-chunk-tokens 2048] [--out JSON]\n"
    "  kld          KL(full precision || release-served experts), teacher-forced, per domain\n"
    "                 --teacher HF_DIR --release R --mode all-4-bit|all-2-bit|fixed-set|oracle|previous-block|live\n"
    "                 --tokens FILE[,FILE] [--window 2048] [--slots F] [--domains a,b] [--out JSON]\n"
    "  mtp-acceptance  offline MTP draft acceptance (draft vs greedy next token)\n"
    "                 --model DIR --tokens FILE[,FILE] [--window N] [--release R --expert-bits 2|4|fixed] [--out JSON]\n"
    "  nvfp4        NVFP4 checkpoints (ModelOpt layout), routed experts by default\n"
    "                 quantize --model DIR --out DIR [--scale-search off|nonclip|clip] [--tap FILE.jsonl]\n"
    "                          [--include GLOBS] [--exclude GLOBS]\n"
    "                 dequantize --model NVFP4_DIR --out DIR   (F32 weights, for nq logits)\n"
    "                 repack-error --model NVFP4_DIR --reference HF_DIR [--tp W]\n"
    "  census       gate/up weight_scale_2 mismatches of an NVFP4 checkpoint: --model DIR [--json]\n"
    "  probe-utf8   U+FFFD / broken tool-call probe of an OpenAI endpoint: --url URL [--runs N] [--stream]\n"
    "run 'nq --help' for every flag";

}  // namespace

namespace nq::tools {

int ReportCommandStatus(const char* command, const absl::Status& status) {
  if (status.ok()) return 0;
  std::fprintf(stderr, "nq %s: %s\n", command, status.ToString().c_str());
  return status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
}

}  // namespace nq::tools

// Flags are spelled with dashes on the command line (--fixed-per-layer, --dry-run) as the
// issue texts and most CLIs do; absl names them with underscores.
std::vector<std::string> NormalizeFlagNames(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  for (std::string& arg : args) {
    if (arg.rfind("--", 0) != 0) continue;
    const size_t end = std::min(arg.find('='), arg.size());
    for (size_t i = 2; i < end; ++i) {
      if (arg[i] == '-') arg[i] = '_';
    }
  }
  return args;
}

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<std::string> normalized = NormalizeFlagNames(argc, argv);
  std::vector<char*> normalized_argv;
  for (std::string& arg : normalized) normalized_argv.push_back(arg.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(normalized_argv.size()), normalized_argv.data());
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
  if (command == "encode") return nq::tools::RunEncode(rest);
  if (command == "synth-release") return nq::tools::RunSynthRelease(rest);
  if (command == "calibrate") return nq::tools::RunCalibrate(rest);
  if (command == "trace") return nq::tools::RunTrace(rest);
  if (command == "replay") return nq::tools::RunReplay(rest);
  if (command == "lookahead") return nq::tools::RunLookahead(rest);
  if (command == "verify") return nq::tools::RunVerify(rest);
  if (command == "assemble") return nq::tools::RunAssemble(rest);
  if (command == "bench-codec") return nq::tools::RunBenchCodec(rest);
  if (command == "bench-decode") return nq::tools::RunBenchDecode(rest);
  if (command == "bench-prefill") return nq::tools::RunBenchPrefill(rest);
  if (command == "kld") return nq::tools::RunKld(rest);
  if (command == "mtp-acceptance") return nq::tools::RunMtpAcceptance(rest);
  if (command == "nvfp4") return nq::tools::RunNvfp4(rest);
  if (command == "census") return nq::tools::RunCensus(rest);
  if (command == "probe-utf8") return nq::tools::RunProbeUtf8(rest);
  std::fprintf(stderr, "nq: unknown command '%s'\n%s\n", command.c_str(), kUsage);
  return 2;
}
