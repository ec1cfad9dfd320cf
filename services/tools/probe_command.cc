// nq probe-utf8: U+FFFD / malformed tool-call probe of an OpenAI-compatible endpoint
// (services/nvfp4/utf8_probe.h). Exit 0 when clean, 1 on any corruption or failed request.
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "services/nvfp4/utf8_probe.h"
#include "services/tools/commands.h"

ABSL_FLAG(std::string, url, "", "probe-utf8: the endpoint, http[s]://host:port (optionally ending in /v1)");
ABSL_FLAG(int, runs, 1, "probe-utf8: times each prompt is sent");
ABSL_FLAG(std::string, probe_model, "", "probe-utf8: model name to request (default: the first of /v1/models)");
ABSL_FLAG(int, max_tokens, 96, "probe-utf8: max_tokens per request");
ABSL_FLAG(double, temperature, 0.7, "probe-utf8: sampling temperature (> 0 so runs differ)");
ABSL_FLAG(std::string, api_key, "", "probe-utf8: bearer token, if the endpoint wants one");
ABSL_FLAG(bool, stream, false, "probe-utf8: request SSE streams and join the deltas");
ABSL_FLAG(bool, probe_json, false, "probe-utf8: print the report as JSON");

namespace nq::tools {

int RunProbeUtf8(const std::vector<std::string>& args) {
  if (!args.empty()) return ReportCommandStatus("probe-utf8", absl::InvalidArgumentError("unexpected argument " + args[0]));
  nvfp4::ProbeOptions options;
  options.url = absl::GetFlag(FLAGS_url);
  if (options.url.empty()) return ReportCommandStatus("probe-utf8", absl::InvalidArgumentError("--url is required"));
  options.runs = absl::GetFlag(FLAGS_runs);
  options.model = absl::GetFlag(FLAGS_probe_model);
  options.max_tokens = absl::GetFlag(FLAGS_max_tokens);
  options.temperature = absl::GetFlag(FLAGS_temperature);
  options.api_key = absl::GetFlag(FLAGS_api_key);
  options.stream = absl::GetFlag(FLAGS_stream);
  absl::StatusOr<nvfp4::ProbeReport> report = nvfp4::RunUtf8Probe(options);
  if (!report.ok()) return ReportCommandStatus("probe-utf8", report.status());
  if (absl::GetFlag(FLAGS_probe_json)) {
    // The examples quote served text; replace (never throw on) anything that is not UTF-8.
    std::printf("%s\n", nvfp4::ProbeJson(*report).dump(2, ' ', false, nlohmann::json::error_handler_t::replace).c_str());
  } else {
    std::printf("%s", nvfp4::ProbeText(*report).c_str());
  }
  return report->Clean() ? 0 : 1;
}

}  // namespace nq::tools
