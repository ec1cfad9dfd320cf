// The tensors a checkpoint of a given config holds, in the HF hub layout (experts stored one
// by one: model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight). One list serves the
// loader (every tensor present, with its shape), `nq synth-model` (what to write), and the
// FP8 variant (which tensors are stored as F8_E4M3 with 128x128 weight_scale_inv).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "services/model/model_config.h"

namespace nq::model {

struct ExpectedTensor {
  std::string name;
  std::vector<int64_t> shape;
  // A linear weight that FP8 hub checkpoints store as F8_E4M3 with block scales.
  bool fp8_eligible = false;
  // Initialisation hint for synthetic weights: norms start at 1, biases at 0.
  enum class Init { kLinear, kNormWeight, kZero, kEmbedding } init = Init::kLinear;
};

// Prefix of decoder (or MTP) layer `layer`: "model.layers.<layer>."
std::string LayerPrefix(int64_t layer);

// Every tensor of the model, MTP layers included (config.num_nextn_predict_layers).
std::vector<ExpectedTensor> ExpectedTensors(const ModelConfig& config);

}  // namespace nq::model
