// jF against the pure-Python reference (scripts/predictor/jf_reference.py): the committed
// fixture tests/fixtures/jf/ holds a trace with three sequences, a deterministic model and
// the reference's features and outputs at every 16 tokens of each sequence and at its end
// (regenerate with scripts/predictor/make_jf_fixture.py). A trained model's reference.json
// (train_jf.py, the torch forward) has the same layout: the committed trained model is checked
// against it, or NQ_JF_REFERENCE_DIR=dir for another.
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "services/model/safetensors_writer.h"
#include "services/streamer/jf_features.h"
#include "services/streamer/jf_model.h"
#include "services/streamer/routing_trace.h"
#include "tests/common/status_matchers.h"

namespace nq::streamer {
namespace {

using ::nq::testing::IsOk;
using ::nq::testing::StatusIs;
using ::testing::HasSubstr;

const std::string kFixture = std::string(NQ_SOURCE_DIR) + "/tests/fixtures/jf";

// The reference computes in double; the C++ in float, with EMAs kept scaled between folds.
constexpr double kRelTolerance = 2e-4;
constexpr double kAbsTolerance = 2e-5;

nlohmann::json ReadJson(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void ExpectNear(double actual, double expected, const std::string& what) {
  EXPECT_NEAR(actual, expected, kAbsTolerance + kRelTolerance * std::fabs(expected)) << what;
}

// Replays the fixture trace through JfFeatureState (and the model when given), comparing every
// checkpoint; returns the number of values compared.
size_t CheckAgainstReference(const std::string& dir, const JfModel* model) {
  absl::StatusOr<RoutingTrace> trace = ReadTrace(dir + "/trace.nqrt");
  EXPECT_THAT(trace.status(), IsOk());
  if (!trace.ok()) return 0;
  const nlohmann::json expected = ReadJson(dir + "/expected.json");
  const uint32_t L = trace->num_layers(), E = trace->experts_per_layer;
  absl::StatusOr<JfFeatureState> state = JfFeatureState::Create(L, E, trace->top_k);
  EXPECT_THAT(state.status(), IsOk());
  const uint32_t S = JfFeatureStride(E);
  std::vector<float> rows(static_cast<size_t>(S) * kJfFeatures), out(E);
  size_t point = 0, compared = 0;
  for (const auto& [begin, end] : trace->Sequences()) {
    state->NewSequence();
    for (size_t t = begin; t < end; ++t) {
      state->Observe(trace->TokenExperts(t), trace->TokenWeights(t), trace->TokenNorms(t));
      if ((t + 1 - begin) % 16 != 0 && t + 1 != end) continue;
      const nlohmann::json& p = expected["points"][point];
      EXPECT_EQ(p["after_token"].get<size_t>(), t + 1);
      for (uint32_t l = 0; l < L; ++l) {
        const nlohmann::json& layer = p["layers"][l];
        const std::vector<uint8_t> resident = layer["resident"].get<std::vector<uint8_t>>();
        state->Fill(l, resident, rows);
        for (uint32_t e = 0; e < E; ++e) {
          for (uint32_t d = 0; d < kJfFeatures; ++d) {
            ExpectNear(rows[d * S + e], layer["features"][e][d].get<double>(),
                       "point " + std::to_string(point) + " layer " + std::to_string(l) + " expert " +
                           std::to_string(e) + " feature " + std::to_string(d));
            ++compared;
          }
        }
        if (model == nullptr) continue;
        model->Forward(l, rows, out);
        for (uint32_t e = 0; e < E; ++e) {
          ExpectNear(out[e], layer["output"][e].get<double>(),
                     "output, point " + std::to_string(point) + " layer " + std::to_string(l) + " expert " +
                         std::to_string(e));
          ++compared;
        }
      }
      ++point;
    }
  }
  EXPECT_EQ(point, expected["points"].size());
  return compared;
}

TEST(JfModelTest, FeaturesAndForwardEqualTheReference) {
  absl::StatusOr<std::shared_ptr<const JfModel>> model = JfModel::Load(kFixture + "/model.safetensors");
  ASSERT_THAT(model.status(), IsOk());
  EXPECT_EQ((*model)->geometry().hidden, 8u);
  EXPECT_EQ((*model)->geometry().queries, 2u);
  // 9 checkpoints x 2 layers x 8 experts x (16 features + 1 output).
  EXPECT_EQ(CheckAgainstReference(kFixture, model->get()), 9u * 2 * 8 * 17);
}

// The committed models (bench/predictor/glm5_nano/jf: 64 tokens ahead, trained on the H200;
// jf_h16: the next block, trained on a CPU), each with torch's outputs in expected.json, or
// another train_jf.py output directory named by NQ_JF_REFERENCE_DIR.
TEST(JfModelTest, TrainedModelEqualsTorch) {
  const char* env = std::getenv("NQ_JF_REFERENCE_DIR");
  const std::string committed = std::string(NQ_SOURCE_DIR) + "/bench/predictor/glm5_nano/";
  const std::vector<std::string> dirs =
      env != nullptr ? std::vector<std::string>{env} : std::vector<std::string>{committed + "jf", committed + "jf_h16"};
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    absl::StatusOr<std::shared_ptr<const JfModel>> model = JfModel::Load(dir + "/model.safetensors");
    ASSERT_THAT(model.status(), IsOk());
    EXPECT_GT(CheckAgainstReference(dir, model->get()), 0u);
  }
}

// The header's forward, in double, straight from its formulas: the reference for Forward's
// blocked, feature-major float version. `f` is experts x features row-major.
std::vector<double> ForwardByTheFormulas(const std::map<std::string, std::vector<float>>& p, uint32_t layer,
                                         uint32_t E, uint32_t H, uint32_t Q, const std::vector<double>& f) {
  const uint32_t D = kJfFeatures;
  auto at = [&](const char* name, size_t i) { return static_cast<double>(p.at(name)[i]); };
  std::vector<double> h0(static_cast<size_t>(E) * H), out(E);
  for (uint32_t e = 0; e < E; ++e) {
    for (uint32_t i = 0; i < H; ++i) {
      double a = at("b_in", i) + at("emb", (static_cast<size_t>(layer) * E + e) * H + i);
      for (uint32_t d = 0; d < D; ++d) a += at("w_in", i * D + d) * f[e * D + d];
      h0[e * H + i] = std::max(a, 0.0);
    }
  }
  std::vector<double> c(static_cast<size_t>(Q) * H, 0.0);
  for (uint32_t q = 0; q < Q; ++q) {
    std::vector<double> logit(E);
    double top = -INFINITY, total = 0;
    for (uint32_t e = 0; e < E; ++e) {
      logit[e] = 0;
      for (uint32_t i = 0; i < H; ++i) logit[e] += at("query", q * H + i) * h0[e * H + i];
      logit[e] /= std::sqrt(static_cast<double>(H));
      top = std::max(top, logit[e]);
    }
    for (uint32_t e = 0; e < E; ++e) total += std::exp(logit[e] - top);
    for (uint32_t e = 0; e < E; ++e) {
      for (uint32_t i = 0; i < H; ++i) c[q * H + i] += std::exp(logit[e] - top) / total * h0[e * H + i];
    }
  }
  for (uint32_t e = 0; e < E; ++e) {
    double y = at("b_out", 0);
    for (uint32_t i = 0; i < H; ++i) {
      double a = at("b_h", i);
      for (uint32_t j = 0; j < Q * H; ++j) a += at("w_ctx", i * Q * H + j) * c[j];
      for (uint32_t j = 0; j < H; ++j) a += at("w_h", i * H + j) * h0[e * H + j];
      y += at("w_out", i) * std::max(a, 0.0);
    }
    out[e] = std::log1p(std::exp(y));
  }
  return out;
}

// 13 experts: Forward's rows are padded to 16, and the padding must take no part in the
// layer's attention (it would shift every expert's context) nor get an output.
// A model file of L layers x E experts, hidden H, Q queries, top-K, with weights uniform in
// [-0.5, 0.5) from an LCG seeded by `seed` (queries x 8, so the attention is far from uniform);
// the weights by tensor name go to *params.
std::string WriteRandomModel(const std::string& name, uint32_t L, uint32_t E, uint32_t H, uint32_t Q, uint32_t K,
                             uint32_t& state, std::map<std::string, std::vector<float>>* params) {
  auto uniform = [&]() {
    state = 1664525u * state + 1013904223u;
    return static_cast<float>(state) / 4294967296.0f - 0.5f;
  };
  const std::pair<const char*, std::vector<int64_t>> shapes[] = {
      {"emb", {L, E, H}}, {"w_in", {H, kJfFeatures}}, {"b_in", {H}}, {"query", {Q, H}}, {"w_ctx", {H, Q * H}},
      {"w_h", {H, H}},    {"b_h", {H}},               {"w_out", {H}}, {"b_out", {1}}};
  model::SafetensorsWriter writer;
  for (const auto& [tensor, shape] : shapes) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::vector<float> v(n);
    for (float& x : v) x = uniform() * (std::string(tensor) == "query" ? 8.0f : 1.0f);
    EXPECT_THAT(writer.AddFloat32(tensor, shape, v), IsOk());
    if (params != nullptr) (*params)[tensor] = std::move(v);
  }
  const std::pair<const char*, uint32_t> meta[] = {{"num_layers", L}, {"experts_per_layer", E}, {"top_k", K},
                                                   {"features", kJfFeatures}, {"hidden", H}, {"queries", Q},
                                                   {"horizon", kJfHorizon}};
  for (const auto& [key, value] : meta) writer.SetMetadata(key, std::to_string(value));
  writer.SetMetadata("format", kJfFormat);
  writer.SetMetadata("version", std::to_string(kJfVersion));
  writer.SetMetadata("feature_set", std::string(kJfFeatureSet));
  const std::string path = ::testing::TempDir() + "/" + name + ".safetensors";
  EXPECT_THAT(writer.Write(path), IsOk());
  return path;
}

TEST(JfModelTest, ForwardWithPaddedExpertsEqualsTheFormulas) {
  constexpr uint32_t L = 2, E = 13, H = 16, Q = 3, K = 2;
  uint32_t state = 7;
  auto uniform = [&]() {
    state = 1664525u * state + 1013904223u;
    return static_cast<float>(state) / 4294967296.0f - 0.5f;
  };
  std::map<std::string, std::vector<float>> params;
  const std::string path = WriteRandomModel("padded", L, E, H, Q, K, state, &params);
  absl::StatusOr<std::shared_ptr<const JfModel>> model = JfModel::Load(path);
  ASSERT_THAT(model.status(), IsOk());
  const uint32_t S = JfFeatureStride(E);
  ASSERT_EQ(S, 16u);
  std::vector<double> rows(static_cast<size_t>(E) * kJfFeatures);
  std::vector<float> features(static_cast<size_t>(S) * kJfFeatures, 0.0f), out(E);
  for (uint32_t e = 0; e < E; ++e) {
    for (uint32_t d = 0; d < kJfFeatures; ++d) {
      const float x = 2.0f * uniform() + 0.5f;
      rows[e * kJfFeatures + d] = x;
      features[d * S + e] = x;
    }
  }
  for (uint32_t layer = 0; layer < L; ++layer) {
    (*model)->Forward(layer, features, out);
    const std::vector<double> want = ForwardByTheFormulas(params, layer, E, H, Q, rows);
    for (uint32_t e = 0; e < E; ++e) {
      EXPECT_NEAR(out[e], want[e], 1e-5 + 1e-5 * std::fabs(want[e])) << "layer " << layer << " expert " << e;
    }
  }
}

// The forward dispatches to an AVX2 build where the CPU has it: the same operations in the same
// order per expert, only wider, so its outputs must equal the portable build's bit for bit (a
// replay or a plan must not depend on the machine). Every compiled hidden width, a padded expert
// count, and GLM-5's 256 experts. On a CPU without AVX2 both calls take the portable path.
TEST(JfModelTest, TheVectorBuildsGiveTheSameBits) {
  uint32_t state = 11;
  for (const uint32_t H : {8u, 16u, 32u}) {
    for (const uint32_t E : {13u, 256u}) {
      const std::string path =
          WriteRandomModel("isa_" + std::to_string(H) + "_" + std::to_string(E), 2, E, H, 2, 8, state, nullptr);
      absl::StatusOr<std::shared_ptr<const JfModel>> model = JfModel::Load(path);
      ASSERT_THAT(model.status(), IsOk());
      const uint32_t S = JfFeatureStride(E);
      std::vector<float> features(static_cast<size_t>(S) * kJfFeatures, 0.0f), best(E), portable(E);
      for (uint32_t d = 0; d < kJfFeatures; ++d) {
        for (uint32_t e = 0; e < E; ++e) {
          state = 1664525u * state + 1013904223u;
          features[d * S + e] = 4.0f * (static_cast<float>(state) / 4294967296.0f);
        }
      }
      for (uint32_t layer = 0; layer < 2; ++layer) {
        (*model)->Forward(layer, features, best);
        (*model)->Forward(layer, features, portable, JfModel::Isa::kPortable);
        EXPECT_EQ(std::memcmp(best.data(), portable.data(), E * sizeof(float)), 0)
            << "H " << H << " E " << E << " layer " << layer;
      }
    }
  }
}

TEST(JfModelTest, MissingFileIsNotFound) {
  EXPECT_THAT(JfModel::Load(kFixture + "/no-such.safetensors").status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no-such.safetensors")));
}

TEST(JfModelTest, TruncatedFileIsDataLoss) {
  const std::string bytes = ReadBytes(kFixture + "/model.safetensors");
  const std::string path = ::testing::TempDir() + "/truncated.safetensors";
  WriteBytes(path, bytes.substr(0, bytes.size() - 16));
  EXPECT_THAT(JfModel::Load(path).status(),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("predictor file " + path)));
}

TEST(JfModelTest, NotASafetensorsFileIsRefused) {
  const std::string path = ::testing::TempDir() + "/garbage.safetensors";
  WriteBytes(path, "this is not a model");
  EXPECT_FALSE(JfModel::Load(path).ok());
}

// The fixture with one metadata value replaced (same length keeps the offsets valid).
std::string WithMetadata(const std::string& from, const std::string& to) {
  std::string bytes = ReadBytes(kFixture + "/model.safetensors");
  const size_t at = bytes.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) bytes.replace(at, from.size(), to);
  return bytes;
}

TEST(JfModelTest, WrongFeatureSetIsRefused) {
  const std::string path = ::testing::TempDir() + "/features.safetensors";
  WriteBytes(path, WithMetadata("\"jf-features-1\"", "\"jf-features-9\""));
  EXPECT_THAT(JfModel::Load(path).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("feature set \"jf-features-9\"")));
}

TEST(JfModelTest, WrongFormatIsRefused) {
  const std::string path = ::testing::TempDir() + "/format.safetensors";
  WriteBytes(path, WithMetadata("\"nq-jf\"", "\"nq-xx\""));
  EXPECT_THAT(JfModel::Load(path).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("format is \"nq-xx\"")));
}

// The fixture with metadata `key` set to `value`: the header is rewritten (the tensors' offsets
// count from the data section, so they stay valid).
std::string WithMetadataValue(const std::string& key, const std::string& value) {
  const std::string bytes = ReadBytes(kFixture + "/model.safetensors");
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = header_bytes << 8 | static_cast<unsigned char>(bytes[static_cast<size_t>(i)]);
  nlohmann::json header = nlohmann::json::parse(bytes.substr(8, header_bytes));
  header["__metadata__"][key] = value;
  const std::string text = header.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(text.size() >> (8 * i) & 0xff);
  return out + text + bytes.substr(8 + header_bytes);
}

TEST(JfModelTest, HysteresisMarginComesFromTheFileElseTheDefault) {
  absl::StatusOr<std::shared_ptr<const JfModel>> plain = JfModel::Load(kFixture + "/model.safetensors");
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->hysteresis_margin(), kJfDefaultMargin);
  const std::string path = ::testing::TempDir() + "/margin.safetensors";
  WriteBytes(path, WithMetadataValue("hysteresis_margin", "0.3"));
  absl::StatusOr<std::shared_ptr<const JfModel>> with = JfModel::Load(path);
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_FLOAT_EQ((*with)->hysteresis_margin(), 0.3f);
  for (const char* bad : {"-1", "abc", "nan", "inf", "0.3x", ""}) {
    WriteBytes(path, WithMetadataValue("hysteresis_margin", bad));
    EXPECT_THAT(JfModel::Load(path).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"hysteresis_margin\" = \"" + std::string(bad))))
        << bad;
  }
}

TEST(JfModelTest, AnyHorizonUpToTheLimitLoads) {
  // The streamer converts expected hits to share units by the file's own horizon, so a model
  // trained for the next block (16 tokens) serves as well as one trained for 64.
  const std::string path = ::testing::TempDir() + "/horizon.safetensors";
  for (uint32_t horizon : {1u, 16u, 64u, kJfMaxHorizon}) {
    WriteBytes(path, WithMetadataValue("horizon", std::to_string(horizon)));
    absl::StatusOr<std::shared_ptr<const JfModel>> model = JfModel::Load(path);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ((*model)->geometry().horizon, horizon);
  }
  for (const std::string& bad : {std::string("0"), std::to_string(kJfMaxHorizon + 1), std::string("16.5")}) {
    WriteBytes(path, WithMetadataValue("horizon", bad));
    EXPECT_THAT(JfModel::Load(path).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"horizon\" = \"" + bad)))
        << bad;
  }
}

TEST(JfModelTest, GeometryDisagreeingWithTensorsIsRefused) {
  // The header says 3 layers; emb holds 2.
  const std::string path = ::testing::TempDir() + "/layers.safetensors";
  WriteBytes(path, WithMetadata("\"num_layers\":\"2\"", "\"num_layers\":\"3\""));
  EXPECT_THAT(JfModel::Load(path).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("tensor emb has shape [2, 8, 8]")));
}

TEST(JfModelTest, CheckGeometryNamesBoth) {
  absl::StatusOr<std::shared_ptr<const JfModel>> model = JfModel::Load(kFixture + "/model.safetensors");
  ASSERT_THAT(model.status(), IsOk());
  EXPECT_THAT((*model)->CheckGeometry(2, 8, 2), IsOk());
  EXPECT_THAT((*model)->CheckGeometry(75, 256, 8),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("trained for 2 MoE layers x 8 experts, top-2; the model served has 75 x 256, top-8")));
  EXPECT_THAT((*model)->CheckGeometry(2, 8, 4), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("top-2")));
}

TEST(JfFeatureStateTest, SaveRestoreContinuesIdentically) {
  absl::StatusOr<RoutingTrace> trace = ReadTrace(kFixture + "/trace.nqrt");
  ASSERT_THAT(trace.status(), IsOk());
  absl::StatusOr<JfFeatureState> a = JfFeatureState::Create(2, 8, 2);
  ASSERT_THAT(a.status(), IsOk());
  for (size_t t = 0; t < 50; ++t) a->Observe(trace->TokenExperts(t), trace->TokenWeights(t), trace->TokenNorms(t));
  absl::StatusOr<JfFeatureState> b = JfFeatureState::Create(2, 8, 2);
  ASSERT_THAT(b->Restore(a->Save()), IsOk());
  for (size_t t = 50; t < trace->num_tokens(); ++t) {
    a->Observe(trace->TokenExperts(t), trace->TokenWeights(t), trace->TokenNorms(t));
    b->Observe(trace->TokenExperts(t), trace->TokenWeights(t), trace->TokenNorms(t));
  }
  std::vector<float> fa(JfFeatureStride(8) * kJfFeatures), fb(JfFeatureStride(8) * kJfFeatures);
  const std::vector<uint8_t> resident(8, 0);
  for (uint32_t l = 0; l < 2; ++l) {
    a->Fill(l, resident, fa);
    b->Fill(l, resident, fb);
    EXPECT_EQ(fa, fb);
  }
}

TEST(JfFeatureStateTest, RestoreRefusesOtherGeometryAndTruncation) {
  absl::StatusOr<JfFeatureState> a = JfFeatureState::Create(2, 8, 2);
  absl::StatusOr<JfFeatureState> other = JfFeatureState::Create(2, 16, 2);
  ASSERT_THAT(a.status(), IsOk());
  const std::string bytes = a->Save();
  EXPECT_THAT(other->Restore(bytes), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 layers x 8 experts")));
  EXPECT_THAT(a->Restore(bytes.substr(0, bytes.size() - 3)),
              StatusIs(absl::StatusCode::kDataLoss, HasSubstr("truncated")));
  EXPECT_THAT(a->Restore(bytes + "x"), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("trailing")));
  EXPECT_THAT(a->Restore("NQPS"), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("bad magic")));
}

TEST(JfFeatureStateTest, NewSequenceClearsPerRequestSignalsOnly) {
  absl::StatusOr<JfFeatureState> s = JfFeatureState::Create(1, 4, 1);
  ASSERT_THAT(s.status(), IsOk());
  const uint32_t expert[] = {2};
  const float weight[] = {1.0f};
  for (int t = 0; t < 20; ++t) s->Observe(expert, weight, {});
  s->NewSequence();
  const uint32_t S = JfFeatureStride(4);
  std::vector<float> f(S * kJfFeatures, -1.0f);
  s->Fill(0, std::vector<uint8_t>(4, 0), f);
  auto e2 = [&](uint32_t d) { return f[d * S + 2]; };
  EXPECT_GT(e2(0), 1.0f);      // the EMA carries over
  EXPECT_EQ(e2(10), 0.0f);     // no hits in this sequence's window
  EXPECT_EQ(e2(12), 1.0f);     // never hit in this sequence
  EXPECT_EQ(e2(13), 0.0f);     // position 0
  EXPECT_EQ(e2(15), 0.0f);     // sequence rate
  // Experts 4..7 are the rows' padding: every feature 0.
  for (uint32_t d = 0; d < kJfFeatures; ++d) {
    for (uint32_t e = 4; e < S; ++e) EXPECT_EQ(f[d * S + e], 0.0f) << d << " " << e;
  }
}

}  // namespace
}  // namespace nq::streamer
