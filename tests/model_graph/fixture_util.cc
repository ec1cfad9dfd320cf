#include "tests/model_graph/fixture_util.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace nq::model::testing {

std::string FixtureDir(const std::string& name) { return std::string(NQ_FIXTURE_DIR) + "/" + name; }

std::vector<int32_t> ReadTokens(const std::string& dir) {
  std::ifstream in(dir + "/tokens.json");
  std::stringstream text;
  text << in.rdbuf();
  nlohmann::json json = nlohmann::json::parse(text.str(), nullptr, false);
  EXPECT_FALSE(json.is_discarded()) << dir;
  return json["input_ids"].get<std::vector<int32_t>>();
}

std::vector<float> ReadFloats(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  EXPECT_TRUE(in.good()) << path;
  const std::streamsize bytes = in.tellg();
  in.seekg(0);
  std::vector<float> values(static_cast<size_t>(bytes) / sizeof(float));
  in.read(reinterpret_cast<char*>(values.data()), bytes);
  return values;
}

Comparison Compare(const std::vector<float>& actual, const std::vector<float>& reference, int64_t row_begin,
                   int64_t cols) {
  Comparison c;
  EXPECT_LE(static_cast<size_t>(row_begin * cols + actual.size()), reference.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    const double ref = reference[row_begin * cols + i];
    c.max_abs_ref = std::max(c.max_abs_ref, std::abs(ref));
    c.max_abs_diff = std::max(c.max_abs_diff, std::abs(actual[i] - ref));
  }
  return c;
}

}  // namespace nq::model::testing
