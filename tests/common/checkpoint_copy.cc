#include "tests/common/checkpoint_copy.h"

#include <filesystem>
#include <string>
#include <vector>

#include "services/common/status_macros.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_writer.h"

namespace nq::testing {

absl::Status CopyCheckpointWithout(const std::string& from, const std::string& to,
                                   const std::function<bool(const std::string& name)>& drop) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::create_directories(to, error);
  if (error) return absl::InternalError("creating " + to + ": " + error.message());
  for (const fs::directory_entry& entry : fs::directory_iterator(from)) {
    if (entry.path().extension() != ".json" || entry.path().filename().string() == std::string(model::Checkpoint::kIndexFileName)) {
      continue;
    }
    fs::copy_file(entry.path(), fs::path(to) / entry.path().filename(), fs::copy_options::overwrite_existing, error);
    if (error) return absl::InternalError("copying " + entry.path().string() + ": " + error.message());
  }
  ASSIGN_OR_RETURN(model::Checkpoint checkpoint, model::Checkpoint::Open(from));
  model::SafetensorsWriter writer;
  for (const std::string& name : checkpoint.Names()) {
    if (drop(name)) continue;
    ASSIGN_OR_RETURN(model::TensorView view, checkpoint.Find(name));
    RETURN_IF_ERROR(writer.Add(name, view.dtype, std::vector<int64_t>(view.shape.begin(), view.shape.end()),
                               std::vector<std::byte>(view.data.begin(), view.data.end())));
  }
  return writer.WriteCheckpoint(to);
}

}  // namespace nq::testing
