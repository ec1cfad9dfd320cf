// Subcommands of the `nq` tool. Each returns the process exit code: 0 on success, 1 on a
// failure it has already reported on stderr, 2 on bad usage.
#pragma once

#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"

// --out: the output file or directory of every command (defined in nq_main.cc).
ABSL_DECLARE_FLAG(std::string, out);

namespace nq::tools {

// Prints a failed command's status and maps it to the exit code (2: bad usage, 1: failure).
int ReportCommandStatus(const char* command, const absl::Status& status);

// nq logits --model DIR --tokens 1,2,3 [--tp W] [--decode] [--mtp] --out FILE
int RunLogits(const std::vector<std::string>& args);
// nq synth-model --config JSON --out DIR [--dtype f32|bf16|fp8] [--seed N] [--max_shard_mb N]
int RunSynthModel(const std::vector<std::string>& args);
// nq tokenize --tokenizer FILE [--add_special_tokens] < text (prints comma-separated ids)
int RunTokenize(const std::vector<std::string>& args);
// nq detokenize --tokenizer FILE [--skip_special_tokens] < ids (writes the decoded bytes)
int RunDetokenize(const std::vector<std::string>& args);

// nq encode --model HF_DIR --out RELEASE --tp W [--fixed-per-layer N]
int RunEncode(const std::vector<std::string>& args);
// nq synth-release --model DIR --out RELEASE [--tp W] [--fixed-per-layer N] [--codec C] [--seed N]
int RunSynthRelease(const std::vector<std::string>& args);
// nq calibrate --model DIR --tokens_file FILE --out H
int RunCalibrate(const std::vector<std::string>& args);
// nq trace --model DIR --tokens FILE --out TRACE
// nq trace --worker HOST:PORT --out TRACE [--trace-tokens N] [--seconds S]
int RunTrace(const std::vector<std::string>& args);
// nq replay --trace TRACE [--release-dir R] [--slots F] [--landing-tokens N]
int RunReplay(const std::vector<std::string>& args);
// nq lookahead --model DIR --tokens FILE [--depths 1,2,3]
int RunLookahead(const std::vector<std::string>& args);
// nq verify RELEASE
int RunVerify(const std::vector<std::string>& args);
// nq assemble --src REL --into DIR [--layers a-b] [--dry-run]
int RunAssemble(const std::vector<std::string>& args);
// nq bench-codec [--size N]
int RunBenchCodec(const std::vector<std::string>& args);
// nq bench-decode --model DIR [--release R --expert-bits 2|4|fixed] [--backend cpu|cuda] [--gpu N]
//                 [--prompt-tokens P] [--warmup W] [--decode-tokens N] [--seed S]
//                 [--kv-cache-dtype f32|bf16] [--max-model-len L] [--out JSON]
int RunBenchDecode(const std::vector<std::string>& args);
// nq bench-prefill --model DIR [--release R --expert-bits 2|4] [--backend cpu|cuda] [--gpu N]
//                  [--prefill-lengths 4096,32768] [--prefill-rounds 2] [--layer-major-prefill-tokens 2048]
//                  [--prefill-chunk-tokens 2048] [--prefill-full-span-tokens 32768] [--out JSON]
int RunBenchPrefill(const std::vector<std::string>& args);
// nq kld --teacher HF_DIR --release R --mode MODE --tokens FILE[,FILE] [--window N] [--slots F]
//        [--domains a,b] [--out JSON]
// nq kld --teacher HF_DIR --release R --prefill_tokens P --prefill_mode 2-bit|layer-major-4-bit|all-4-bit
//        --tokens FILE[,FILE] [--window N] [--prefill_chunk_tokens C] [--full_span_tokens S] [--out JSON]
int RunKld(const std::vector<std::string>& args);
// nq mtp-acceptance --model DIR --tokens FILE[,FILE] [--window N] [--release R --expert-bits B]
int RunMtpAcceptance(const std::vector<std::string>& args);

// nq nvfp4 quantize --model DIR --out DIR [--scale-search off|nonclip|clip] [--tap FILE.jsonl]
//                   [--include GLOBS] [--exclude GLOBS] [--threads N]
// nq nvfp4 dequantize --model NVFP4_DIR --out DIR
// nq nvfp4 repack-error --model NVFP4_DIR --reference HF_DIR [--tp W]
int RunNvfp4(const std::vector<std::string>& args);
// nq census --model NVFP4_DIR [--json]
int RunCensus(const std::vector<std::string>& args);
// nq probe-utf8 --url URL [--runs N] [--probe-model M] [--stream] [--probe-json]
int RunProbeUtf8(const std::vector<std::string>& args);

}  // namespace nq::tools
