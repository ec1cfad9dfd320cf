#include "tests/format/test_release.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "services/format/file_io.h"
#include "services/format/rank_index.h"
#include "services/format/release_writer.h"
#include "services/model/safetensors_writer.h"
#include "tests/common/status_matchers.h"

namespace nq::format::testing {
namespace fs = std::filesystem;
using ::nq::testing::IsOk;

Manifest TestManifest() {
  Manifest m;
  m.source_model = "test/tiny-moe";
  m.config_hash = std::string(64, 'a');
  m.tp_size = kTpSize;
  m.experts_per_layer = kExperts;
  m.codec = "scalar-nested";
  m.codec_params = {{"base_bits", 2}, {"residual_bits", 2}};
  m.layers = {{3, {128, 11}, {2, 0}, {2, 0, 3, 1}}, {4, {512, 12}, {1}, {1, 3, 2, 0}}};
  return m;
}

RecordLayout TestLayout() {
  std::vector<SegmentSpec> specs = {{"gate_up.residual", 5000}, {"down.residual", 300}};
  return RecordLayout::Build(specs).value();
}

void WriteTestRelease(const std::string& dir, uint32_t seed) {
  auto writer = ReleaseWriter::Create(dir, TestManifest());
  ASSERT_THAT(writer.status(), IsOk());
  const RecordLayout layout = TestLayout();
  for (uint32_t layer : {3u, 4u}) {
    for (uint32_t rank = 0; rank < kTpSize; ++rank) {
      std::vector<std::vector<std::byte>> records;
      for (uint32_t e = 0; e < kExperts; ++e) {
        std::vector<std::vector<std::byte>> segs;
        for (const Segment& s : layout.segments) {
          std::vector<std::byte> bytes(s.bytes);
          for (size_t i = 0; i < bytes.size(); ++i) {
            bytes[i] = std::byte((i * 7 + e * 13 + rank * 31 + layer * 5 + seed * 101) & 0xff);
          }
          segs.push_back(std::move(bytes));
        }
        std::vector<std::span<const std::byte>> views(segs.begin(), segs.end());
        records.push_back(layout.Pack(views).value());
      }
      model::SafetensorsWriter resident;
      std::vector<float> values(64);
      for (size_t i = 0; i < values.size(); ++i) values[i] = float(i + seed + layer + rank);
      ASSERT_THAT(resident.AddFloat32("experts.base_codes", {8, 8}, values), IsOk());
      ASSERT_THAT(writer->WriteLayer(rank, layer, layout, records, resident), IsOk());
    }
  }
  ASSERT_THAT(writer->Finish(), IsOk());
}

std::string MakeTempDir() {
  std::string pattern = (fs::path(::testing::TempDir()) / "nq_format_XXXXXX").string();
  char* made = ::mkdtemp(pattern.data());
  EXPECT_NE(made, nullptr);
  return pattern;
}

std::map<std::string, std::string> Snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  if (!fs::exists(dir)) return files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) {
      files[fs::relative(entry.path(), dir).string()] = ReadAll(entry.path().string());
    }
  }
  return files;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteAll(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

void DropRecordXxh3(const std::string& dir) {
  EditRankIndexes(dir, [](RankIndex& index) {
    for (LayerEntry& layer : index.layers) layer.record_xxh3.clear();
  });
}

void EditRankIndexes(const std::string& dir, const std::function<void(RankIndex&)>& edit) {
  auto complete = ParseComplete(ReadAll(dir + "/" + kCompleteFile));
  ASSERT_TRUE(complete.ok()) << complete.status();
  for (uint32_t rank = 0; rank < kTpSize; ++rank) {
    auto index = ReadRankIndex(dir, rank);
    ASSERT_TRUE(index.ok()) << index.status();
    edit(*index);
    const std::string text = SerializeRankIndex(*index);
    WriteAll(dir + "/" + RankIndexFile(rank), text);
    for (CompleteEntry& entry : *complete) {
      if (entry.path == RankIndexFile(rank)) entry.sha256 = Sha256Hex(text);
    }
  }
  WriteAll(dir + "/" + kCompleteFile, SerializeComplete(*complete));
}

void FlipByte(const std::string& path, uint64_t offset) {
  std::string contents = ReadAll(path);
  ASSERT_LT(offset, contents.size());
  contents[offset] ^= 0x01;
  WriteAll(path, contents);
}

}  // namespace nq::format::testing
