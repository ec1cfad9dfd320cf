// The hysteresis-margin sweep behind kJfDefaultMargin (services/streamer/jf_model.h): replays
// a trace at F floating slots once per margin, exactly as `nq replay --trace T --release_dir R
// --slots F [--predictor P] --hysteresis M` does (the release's fixed sets and static ranking,
// read budget 64), and prints one table row per margin. A manual benchmark (bench/README.md,
// "jF's hysteresis margin"); `nq replay` remains the tool for one run.
//
// Usage: predictor_margin_sweep TRACE RELEASE_DIR SLOTS PREDICTOR|v0 MARGIN...
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "services/common/status_macros.h"
#include "services/format/release_reader.h"
#include "services/streamer/jf_model.h"
#include "services/streamer/replay.h"
#include "services/streamer/routing_trace.h"

namespace nq::streamer {
namespace {

absl::Status Sweep(const std::string& trace_path, const std::string& release_dir, uint32_t slots,
                   const std::string& predictor, const std::vector<float>& margins) {
  ASSIGN_OR_RETURN(RoutingTrace trace, ReadTrace(trace_path));
  PredictorOptions options;
  options.num_layers = trace.num_layers();
  options.experts_per_layer = trace.experts_per_layer;
  options.floating_slots = slots;
  options.top_k = trace.top_k;
  if (predictor != "v0") {
    ASSIGN_OR_RETURN(options.learned, JfModel::Load(predictor));
  }
  ASSIGN_OR_RETURN(format::Release release, format::Release::Open(release_dir));
  for (uint32_t layer : trace.layer_ids) {
    const format::ManifestLayer* ml = release.manifest().FindLayer(layer);
    if (ml == nullptr) return absl::FailedPreconditionError(absl::StrCat("the release has no layer ", layer));
    options.fixed.push_back(ml->fixed_4bit);
    options.static_ranking.push_back(ml->ranking);
  }
  std::printf("%s, %zu tokens, F = %u, predictor %s (default margin %.2f)\n", trace_path.c_str(), trace.num_tokens(),
              slots, options.learned ? "jF" : "v0", DefaultHysteresisMargin(options.learned.get()));
  std::printf("| margin | calls at 4 bits | weight at 4 bits | loads per refresh | oracle calls |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: |\n");
  for (float margin : margins) {
    options.hysteresis_margin = margin;
    ASSIGN_OR_RETURN(ReplayResult r, Replay(trace, options));
    std::printf("| %.2f | %.4f | %.4f | %.2f | %.4f |\n", margin, r.predictor.calls, r.predictor.weight,
                static_cast<double>(r.predictor_loads) / static_cast<double>(r.blocks), r.oracle.calls);
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace nq::streamer

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s TRACE RELEASE_DIR SLOTS PREDICTOR|v0 MARGIN...\n", argv[0]);
    return 2;
  }
  std::vector<float> margins;
  for (int i = 5; i < argc; ++i) margins.push_back(std::strtof(argv[i], nullptr));
  const absl::Status status =
      nq::streamer::Sweep(argv[1], argv[2], static_cast<uint32_t>(std::atoi(argv[3])), argv[4], margins);
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
