// A small synthetic release for the format tests: TP 2, MoE layers {3, 4}, 4 experts, a
// two-segment record layout; every byte derives from a seed so two writes are comparable.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "services/format/manifest.h"
#include "services/format/rank_index.h"
#include "services/format/record_layout.h"

namespace nq::format::testing {

inline constexpr uint32_t kTpSize = 2;
inline constexpr uint32_t kExperts = 4;

Manifest TestManifest();
RecordLayout TestLayout();
// Writes a complete release into `dir` (created); `seed` varies every record and tensor.
void WriteTestRelease(const std::string& dir, uint32_t seed = 1);

// A fresh empty directory under the test's temporary directory.
std::string MakeTempDir();
// Every regular file under `dir`: relative path -> contents.
std::map<std::string, std::string> Snapshot(const std::string& dir);
std::string ReadAll(const std::string& path);
void WriteAll(const std::string& path, const std::string& contents);
// Flips one bit of the byte at `offset` in `path`.
void FlipByte(const std::string& path, uint64_t offset);
// Applies `edit` to every rank index of `dir`'s release and updates COMPLETE to match (so the
// release still opens).
void EditRankIndexes(const std::string& dir, const std::function<void(RankIndex&)>& edit);
// Makes `dir`'s release look written before XXH3 record checksums (no record_xxh3).
void DropRecordXxh3(const std::string& dir);

}  // namespace nq::format::testing
