#include "bench/streamer/synthetic_release.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "services/format/release_writer.h"
#include "services/model/safetensors_writer.h"
#include "services/common/status_macros.h"

namespace nq::streamer::bench {
namespace {

constexpr uint32_t kExperts = 32;
constexpr uint64_t kRecordBytes = 1 << 20;

}  // namespace

absl::Status WriteSyntheticRelease(const std::string& dir, uint64_t megabytes) {
  const uint32_t layers = std::max<uint32_t>(1, static_cast<uint32_t>((megabytes << 20) / (kRecordBytes * kExperts)));
  format::Manifest m;
  m.source_model = "bench/record-read";
  m.config_hash = std::string(64, 'b');
  m.tp_size = 1;
  m.experts_per_layer = kExperts;
  m.codec = "scalar-nested";
  for (uint32_t l = 0; l < layers; ++l) {
    format::ManifestLayer ml{.layer = l, .rotation = {128, l}, .fixed_4bit = {}, .ranking = {}};
    for (uint32_t e = 0; e < kExperts; ++e) ml.ranking.push_back(e);
    m.layers.push_back(ml);
  }
  ASSIGN_OR_RETURN(format::ReleaseWriter writer, format::ReleaseWriter::Create(dir, m));
  std::vector<format::SegmentSpec> specs = {{"residual", kRecordBytes}};
  ASSIGN_OR_RETURN(format::RecordLayout layout, format::RecordLayout::Build(specs));
  std::mt19937_64 rng(1);
  for (uint32_t l = 0; l < layers; ++l) {
    ASSIGN_OR_RETURN(bool have, writer.HasLayer(0, l));
    if (have) continue;
    std::vector<std::vector<std::byte>> records;
    for (uint32_t e = 0; e < kExperts; ++e) {
      std::vector<std::byte> segment(kRecordBytes);
      for (size_t i = 0; i + 8 <= segment.size(); i += 8) {
        const uint64_t v = rng();
        std::memcpy(segment.data() + i, &v, 8);
      }
      std::vector<std::span<const std::byte>> views = {segment};
      ASSIGN_OR_RETURN(std::vector<std::byte> packed, layout.Pack(views));
      records.push_back(std::move(packed));
    }
    model::SafetensorsWriter resident;
    std::vector<float> values(16, static_cast<float>(l));
    RETURN_IF_ERROR(resident.AddFloat32("experts.base_codes", {4, 4}, values));
    RETURN_IF_ERROR(writer.WriteLayer(0, l, layout, records, resident));
  }
  return writer.Finish();
}

}  // namespace nq::streamer::bench
