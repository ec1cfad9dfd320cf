#include "services/release/calibration.h"

#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "services/common/status_macros.h"
#include "services/model/model.h"
#include "services/model/safetensors.h"
#include "services/model/safetensors_load.h"
#include "services/model/safetensors_writer.h"

namespace nq::release {
namespace {

std::string Key(uint32_t layer, uint32_t expert, const char* what) {
  return absl::StrCat("layers.", layer, ".experts.", expert, ".", what);
}

void Accumulate(quant::Hessian& h, std::span<const float> rows, int64_t dim) {
  if (h.dim == 0) {
    h.dim = dim;
    h.values.assign(static_cast<size_t>(dim * dim), 0.0);
  }
  const int64_t n = static_cast<int64_t>(rows.size()) / dim;
  for (int64_t r = 0; r < n; ++r) {
    const float* x = rows.data() + r * dim;
    for (int64_t i = 0; i < dim; ++i) {
      const double xi = x[i];
      double* row = h.values.data() + i * dim;
      for (int64_t j = 0; j < dim; ++j) row[j] += xi * x[j];
    }
  }
}

}  // namespace

absl::StatusOr<std::vector<std::vector<int32_t>>> ReadTokenFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError("cannot read " + path);
  std::vector<std::vector<int32_t>> sequences;
  std::string line;
  int line_number = 0;
  while (std::getline(in, line)) {
    ++line_number;
    std::vector<int32_t> ids;
    for (absl::string_view part : absl::StrSplit(line, absl::ByAnyChar(", \t"), absl::SkipWhitespace())) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(part, &id) || id < 0) {
        return absl::InvalidArgumentError(absl::StrCat(path, ":", line_number, ": '", std::string(part),
                                                       "' is not a token id"));
      }
      ids.push_back(id);
    }
    if (!ids.empty()) sequences.push_back(std::move(ids));
  }
  if (sequences.empty()) return absl::InvalidArgumentError(path + " holds no token ids");
  return sequences;
}

absl::StatusOr<Calibration> Calibrate(const std::string& model_dir, const std::vector<std::vector<int32_t>>& sequences,
                                      const std::string& out_path,
                                      const std::function<void(const ProgressState&)>& progress) {
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::Backend> backend, kernels::CreateBackend("cpu"));
  int64_t longest = 1;
  for (const auto& s : sequences) longest = std::max<int64_t>(longest, static_cast<int64_t>(s.size()));
  ASSIGN_OR_RETURN(std::unique_ptr<model::Model> model,
                   model::Model::Load(model_dir, *backend, nullptr, {.max_tokens = longest}));
  const model::ModelConfig& config = model->config();
  Calibration calibration;
  model->SetExpertObserver([&](const model::Model::ExpertActivations& a) {
    ExpertHessians& h = calibration.experts[{static_cast<uint32_t>(a.layer), static_cast<uint32_t>(a.expert)}];
    Accumulate(a.down_input ? h.down : h.gate_up, a.rows, a.dim);
    if (!a.down_input) {
      const int64_t n = static_cast<int64_t>(a.rows.size()) / a.dim;
      h.samples += static_cast<double>(n);
      std::vector<double>& counts = calibration.routing_counts[static_cast<uint32_t>(a.layer)];
      counts.resize(static_cast<size_t>(config.n_routed_experts), 0.0);
      counts[a.expert] += static_cast<double>(n);
    }
  });
  ProgressState state{.total = static_cast<int64_t>(sequences.size())};
  for (const std::vector<int32_t>& sequence : sequences) {
    model->ResetCache();
    RETURN_IF_ERROR(model->Forward(sequence).status());
    ++state.done;
    state.work += static_cast<double>(sequence.size());
    if (progress) progress(state);
  }
  model::SafetensorsWriter writer;
  for (auto& [key, h] : calibration.experts) {
    for (quant::Hessian* hessian : {&h.gate_up, &h.down}) {
      for (double& v : hessian->values) v /= h.samples;  // the mean of x x^T
    }
    std::vector<float> gate_up(h.gate_up.values.begin(), h.gate_up.values.end());
    std::vector<float> down(h.down.values.begin(), h.down.values.end());
    RETURN_IF_ERROR(writer.AddFloat32(Key(key.first, key.second, "gate_up_hessian"), {h.gate_up.dim, h.gate_up.dim}, gate_up));
    RETURN_IF_ERROR(writer.AddFloat32(Key(key.first, key.second, "down_hessian"), {h.down.dim, h.down.dim}, down));
    const float samples = static_cast<float>(h.samples);
    RETURN_IF_ERROR(writer.AddFloat32(Key(key.first, key.second, "samples"), {1}, std::span<const float>(&samples, 1)));
  }
  for (const auto& [layer, counts] : calibration.routing_counts) {
    std::vector<float> values(counts.begin(), counts.end());
    RETURN_IF_ERROR(writer.AddFloat32(absl::StrCat("layers.", layer, ".routing_counts"),
                                      {static_cast<int64_t>(values.size())}, values));
  }
  writer.SetMetadata("format", "nestquant-calibration-v1");
  writer.SetMetadata("model", model_dir);
  RETURN_IF_ERROR(writer.Write(out_path));
  return calibration;
}

absl::StatusOr<Calibration> LoadCalibration(const std::string& path) {
  ASSIGN_OR_RETURN(model::SafetensorsFile file, model::SafetensorsFile::Open(path));
  Calibration calibration;
  for (const std::string& name : file.Names()) {
    std::vector<std::string> parts = absl::StrSplit(name, '.');
    uint32_t layer = 0, expert = 0;
    if (parts.size() < 3 || parts[0] != "layers" || !absl::SimpleAtoi(parts[1], &layer)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected tensor ", name));
    }
    ASSIGN_OR_RETURN(model::TensorView view, file.Find(name));
    ASSIGN_OR_RETURN(std::vector<float> values, model::ConvertToFloat32(view.dtype, view.data));
    if (parts.size() == 3 && parts[2] == "routing_counts") {
      calibration.routing_counts[layer].assign(values.begin(), values.end());
      continue;
    }
    if (parts.size() != 5 || parts[2] != "experts" || !absl::SimpleAtoi(parts[3], &expert)) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected tensor ", name));
    }
    ExpertHessians& h = calibration.experts[{layer, expert}];
    if (parts[4] == "samples") {
      h.samples = values.empty() ? 0 : values[0];
      continue;
    }
    quant::Hessian& target = parts[4] == "down_hessian" ? h.down : h.gate_up;
    if (view.shape.size() != 2 || view.shape[0] != view.shape[1]) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, " is not a square matrix"));
    }
    target.dim = view.shape[0];
    target.values.assign(values.begin(), values.end());
  }
  return calibration;
}

}  // namespace nq::release
